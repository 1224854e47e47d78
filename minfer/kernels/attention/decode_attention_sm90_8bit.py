"""Paged decode attention over 8-bit caches (int8, fp8) for Hopper (sm_90) in Gluon: the consumer converts the
codes in its own registers and hands them to warpgroup MMA as the register operand, so no float16 copy of a
tile is ever written to shared memory.

The same computation as ``decode_attention.py``'s 8-bit path (its Triton kernel is this one's reference and the
path everywhere else), in the frame of ``decode_attention_sm90.py``: a program owns one KV head of one sequence
and one split of its context, with every query head of the GQA group; Sᵀ = K·Qᵀ and Oᵀ += Vᵀ·Pᵀ put the tile's
64 keys (Sᵀ) and the head dims (Oᵀ) along the MMA's 64 rows; a TMA copy warp streams each page's codes and its
per-key scales into a ring of ``STAGES`` slots.

Why registers: an 8-bit operand can be read by ``wgmma`` from shared memory only K-major, and V's codes are not
(they are stored [key, dim]), so a float16 copy of the tile had to be written by a converter partition and read
back; that round trip, not the bytes from HBM, set the pace. Here the A operand of both products comes from
registers instead, and the warpgroup loads it from the TMA's slot in whatever order makes the loads wide:

- **K**, the A operand of Sᵀ = K·Qᵀ, reduced along the head dims. The reduction's order is free as long as Q's
  columns follow it, so each thread reads D/4 contiguous codes of its two keys (``LDS.128`` at D = 128), and q
  is stored in shared memory with its dims permuted to match (``k_dim_order``).
- **V**, the A operand Vᵀ of Oᵀ += Vᵀ·Pᵀ, reduced along the keys. Vᵀ's rows (head dims) may be permuted
  instead, since the output is written by row index: each thread reads 4 contiguous dims of each key (its two
  rows in each of the two 64-row halves at D = 128), and the store maps rows back (``v_dim``).

Both reorderings are register renamings: the loaded tensors are reshaped and permuted into the MMA operand
layout, and ``convert_layout(..., assert_trivial=True)`` proves at compile time that no data moves. A slot is
released as soon as its codes are in registers, before the products that use them.

Codes convert exactly (``gluon_sm90.codes_to_f16``), so the products are float16 on exact values as in the
Triton kernel; K's per-key scales (with ``scale * log2 e``) multiply the score rows, V's the P rows. Windows,
soft-capping and sinks as in the 16-bit kernel: the split ranges (``gluon_sm90.split_range``) start at the window,
and so do the copy warp's page and scale lookups.

H200, B=64 x 4k, llama-3.1-8b heads: int8 / fp8_e4m3 145-148 us, 88-89% of 4.22 TB/s, 1.75x the bf16 kernel.
"""

from __future__ import annotations

import torch

from .gluon_sm90 import gluon

if gluon is not None:
    from .gluon_sm90 import (
        TensorDescriptor, _tma_load, barrier_ring, codes_to_f16, decode_max_start, fence_async_shared, gl,
        invalidate_ring, log2_scores, mbarrier, online_softmax, partition_barrier, reinterpret, split_range,
        warpgroup_mma, warpgroup_mma_wait, write_decode_output, write_empty_split,
    )

BLOCK_N = 64  # keys per tile: the MMA's 64 rows
STAGES = 4  # code slots (16 KB + scales at head_dim 128)
# Registers per thread at launch (2 warpgroups), so that two programs share an SM; setmaxnreg gives the consumer the
# copy warp's group's spare ones.
MAX_REGS = 128

if gluon is not None:
    PRODUCER_REGS = gl.constexpr(24)

    @gluon.constexpr_function
    def k_codes_layout(D):
        """A tile's K codes [64 keys, D]: each thread holds D/4 contiguous codes of two keys, the rows its
        register A operand of Sᵀ = K·Qᵀ covers (keys g and g + 8 of its warp's 16); its lane's pair sets which
        quarter of the dims."""
        reg = [[0, 1 << i] for i in range(D.bit_length() - 3)] + [[8, 0]]
        lane = [[0, D // 4], [0, D // 2], [1, 0], [2, 0], [4, 0]]
        return gl.DistributedLinearLayout(reg, lane, [[16, 0], [32, 0]], [], [64, D])

    @gluon.constexpr_function
    def v_codes_layout(D):
        """A tile's V codes [64 keys, D]: each thread holds 4 (D = 128) or 2 (D = 64) contiguous dims of 16 keys,
        the rows and columns its register A operand of Oᵀ += Vᵀ·Pᵀ covers."""
        if D == 128:
            reg = [[0, 1], [0, 2], [1, 0], [8, 0], [16, 0], [32, 0]]
            lane = [[2, 0], [4, 0], [0, 4], [0, 8], [0, 16]]
            warp = [[0, 32], [0, 64]]
        else:
            reg = [[0, 1], [1, 0], [8, 0], [16, 0], [32, 0]]
            lane = [[2, 0], [4, 0], [0, 2], [0, 4], [0, 8]]
            warp = [[0, 16], [0, 32]]
        return gl.DistributedLinearLayout(reg, lane, warp, [], [64, D])

    @gluon.constexpr_function
    def scale_layout(COPIES, ROWS):
        """A tile's scales as the copy warp lands them, [COPIES pages, ROWS keys]: the layout that flattens to the
        score tile's key rows (``SliceLayout(1, s_layout)``: keys g and g + 8 of each warp's 16, the same in the
        lanes of a quad)."""
        def key(bit):
            return [0, 1 << bit] if (1 << bit) < ROWS else [1 << bit >> (ROWS.bit_length() - 1), 0]
        lane = [[0, 0], [0, 0], key(0), key(1), key(2)]
        return gl.DistributedLinearLayout([key(3)], lane, [key(4), key(5)], [], [COPIES, ROWS])

    @gluon.jit
    def k_dim_order(k, D: gl.constexpr):
        """The head dim at column ``k`` of the K operand (``k_codes_layout`` after its reshape): q is stored in
        this order, so Q·Kᵀ sums the same products."""
        return (D // 4) * ((k >> 1) & 3) + 2 * (k >> 3) + (k & 1)

    @gluon.jit
    def v_dim(r, half, D: gl.constexpr):
        """The head dim of row ``r`` of Oᵀ's ``half`` (``v_codes_layout`` after its reshape)."""
        if D == 128:
            d = 32 * (r >> 4) + 4 * (r & 7) + 2 * half + ((r >> 3) & 1)
        else:
            d = 16 * (r >> 4) + 2 * (r & 7) + ((r >> 3) & 1)
        return d

    @gluon.jit
    def _k_operand(codes, a_layout: gl.constexpr, D: gl.constexpr):
        """K codes in ``k_codes_layout`` → the float16 A operand [64, D] of Sᵀ = K·Qᵀ, in ``k_dim_order``."""
        x = codes_to_f16(codes)
        x = gl.reshape(gl.permute(gl.reshape(x, [64, 4, D // 8, 2]), (0, 2, 1, 3)), [64, D])
        return gl.convert_layout(x, a_layout, assert_trivial=True)

    @gluon.jit
    def _v_operands(codes, a_layout: gl.constexpr, D: gl.constexpr):
        """V codes in ``v_codes_layout`` → the float16 A operands [64, 64] of the two (D = 128) halves of
        Oᵀ += Vᵀ·Pᵀ, rows in ``v_dim`` order (D = 64: one operand, returned twice)."""
        x = codes_to_f16(codes)
        if D == 128:
            x = gl.reshape(gl.permute(gl.reshape(x, [64, 4, 8, 2, 2]), (1, 4, 2, 0, 3)), [64, 64, 2])
            v0, v1 = gl.split(x)
            v0 = gl.convert_layout(v0, a_layout, assert_trivial=True)
            v1 = gl.convert_layout(v1, a_layout, assert_trivial=True)
        else:
            x = gl.reshape(gl.permute(gl.reshape(x, [64, 4, 8, 2]), (1, 3, 2, 0)), [64, 64])
            v0 = gl.convert_layout(x, a_layout, assert_trivial=True)
            v1 = v0
        return v0, v1

    @gluon.jit
    def _load_scales(sc_smem, i, key_layout: gl.constexpr, ROWS: gl.constexpr):
        """The float32 scales of one tile (``sc_smem`` [2 * STAGES, COPIES, CHUNK]: slot i's K or V pages), one per
        key of the score tile's rows."""
        COPIES: gl.constexpr = 64 // ROWS
        x = sc_smem.index(i).slice(0, ROWS, dim=1).load(scale_layout(COPIES, ROWS))
        return gl.convert_layout(gl.reshape(x, [64]), key_layout, assert_trivial=True).to(gl.float32)

    @gluon.jit
    def _load_tile(kc_smem, vc_smem, sc_smem, slot, empty, a_layout: gl.constexpr, key_layout: gl.constexpr,
                   D: gl.constexpr, ROWS: gl.constexpr):
        """Tile ``slot``'s operands in registers (K, the two V halves, K's and V's per-key scales as float32);
        then the slot is released to the copy warp."""
        kc = kc_smem.index(slot).load(k_codes_layout(D))
        vc = vc_smem.index(slot).load(v_codes_layout(D))
        k_sc = _load_scales(sc_smem, 2 * slot, key_layout, ROWS)
        v_sc = _load_scales(sc_smem, 2 * slot + 1, key_layout, ROWS)
        partition_barrier()  # every warp's loads are done before the slot is handed back
        mbarrier.arrive(empty.index(slot), count=1)
        k16 = _k_operand(kc, a_layout, D)
        v0, v1 = _v_operands(vc, a_layout, D)
        return k16, v0, v1, k_sc, v_sc

    @gluon.jit
    def _softmax(s, m_i, l_keys, n0, lo, end, k_sc, v_sc, scale_log2e, key_layout: gl.constexpr, BLOCK_N: gl.constexpr,
                 WINDOW: gl.constexpr, SOFTCAP: gl.constexpr):
        """``online_softmax`` with the per-key scales: K's (with ``scale_log2e``) on the score rows, before the cap,
        V's on the P rows."""
        x = log2_scores(s, gl.expand_dims(k_sc * scale_log2e, 1), SOFTCAP)
        p, m_i, l_keys, alpha = online_softmax(x, m_i, l_keys, n0, lo, end, key_layout, BLOCK_N, WINDOW)
        return p * gl.expand_dims(v_sc, 1), m_i, l_keys, alpha

    @gluon.jit
    def _consumer(Q, q_smem, kc_smem, vc_smem, sc_smem, p_smem, ready, empty, O, MID_O, MID_LSE, SINKS, scale_log2e,
                  b, kvh, split, num_splits, start, lo, end, n_tiles, stride_qb, stride_qh, stride_ob, stride_oh,
                  GROUP: gl.constexpr, NPAD: gl.constexpr, D: gl.constexpr, ROWS: gl.constexpr,
                  STAGES: gl.constexpr, BLOCK_N: gl.constexpr, CONVERT_Q: gl.constexpr, DIRECT: gl.constexpr,
                  WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, HAS_SINKS: gl.constexpr):
        """The warpgroup that computes: q into shared memory (dims in ``k_dim_order``), the online softmax over
        the tiles delivered to ``ready`` (keys before ``lo`` masked with a ``WINDOW``, scores capped with a
        ``SOFTCAP``, split 0 counting the ``SINKS``), then the output (``DIRECT``) or the split's partial."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, NPAD, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        head_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

        q_blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = gl.arange(0, NPAD, layout=gl.SliceLayout(1, q_blk))
        cols = k_dim_order(gl.arange(0, D, layout=gl.SliceLayout(0, q_blk)), D)
        x = gl.load(Q + b.to(gl.int64) * stride_qb + gl.expand_dims((kvh * GROUP + rows) * stride_qh, 1)
                    + gl.expand_dims(cols, 0), mask=gl.expand_dims(rows < GROUP, 1), other=0.0)
        if CONVERT_Q:  # bf16 q against float16 codes (values past float16's range saturate, as quant.q_to_f16)
            x = gl.minimum(gl.maximum(x.to(gl.float32), -65504.0), 65504.0)
        q_smem.store(x.to(gl.float16))
        fence_async_shared()
        partition_barrier()
        qt = q_smem.permute((1, 0))

        m_i, sink = decode_max_start(SINKS, kvh, split, head_layout, GROUP, NPAD, HAS_SINKS)
        l_keys = gl.zeros([BLOCK_N, NPAD], gl.float32, s_layout)
        o0 = gl.zeros([64, NPAD], gl.float32, s_layout)
        o1 = gl.zeros([64, NPAD], gl.float32, s_layout)

        # Tile 0: its scores alone (a split's first tile holds at least one key: no column stays -inf).
        mbarrier.wait(ready.index(0), 0)
        k16, v0, v1, k_sc, v_sc = _load_tile(kc_smem, vc_smem, sc_smem, 0, empty, a_layout, key_layout, D, ROWS)
        s = warpgroup_mma(k16, qt, gl.zeros([BLOCK_N, NPAD], gl.float32, s_layout), use_acc=False, is_async=True)
        s, k16 = warpgroup_mma_wait(0, deps=[s, k16])
        p, m_i, l_keys, alpha = _softmax(s, m_i, l_keys, start, lo, end, k_sc, v_sc, scale_log2e, key_layout, BLOCK_N,
                                         WINDOW, SOFTCAP)
        p_smem.index(0).store(gl.permute(p.to(gl.float16), (1, 0)))
        fence_async_shared()
        partition_barrier()
        for j in range(1, n_tiles):
            slot = j % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            k16, w0, w1, k_sc, v_sc = _load_tile(kc_smem, vc_smem, sc_smem, slot, empty, a_layout, key_layout, D,
                                                      ROWS)
            s = warpgroup_mma(k16, qt, gl.zeros([BLOCK_N, NPAD], gl.float32, s_layout), use_acc=False,
                              is_async=True)
            pt = p_smem.index((j - 1) % 2).permute((1, 0))  # Pᵀ of tile j-1: [keys, heads]
            o0 = warpgroup_mma(v0, pt, o0, is_async=True)
            if D == 128:
                o1 = warpgroup_mma(v1, pt, o1, is_async=True)
                s, k16 = warpgroup_mma_wait(2, deps=[s, k16])
            else:
                s, k16 = warpgroup_mma_wait(1, deps=[s, k16])
            p, m_i, l_keys, alpha = _softmax(s, m_i, l_keys, start + j * BLOCK_N, lo, end, k_sc, v_sc, scale_log2e,
                                             key_layout, BLOCK_N, WINDOW, SOFTCAP)
            p_smem.index(j % 2).store(gl.permute(p.to(gl.float16), (1, 0)))  # the other buffer than P·V's
            if D == 128:
                o0, o1, v0, v1 = warpgroup_mma_wait(0, deps=[o0, o1, v0, v1])
            else:
                o0, v0 = warpgroup_mma_wait(0, deps=[o0, v0])
            fence_async_shared()
            partition_barrier()
            a = gl.expand_dims(alpha, 0)
            o0 = o0 * a
            o1 = o1 * a
            v0 = w0
            v1 = w1
        pt = p_smem.index((n_tiles - 1) % 2).permute((1, 0))
        o0 = warpgroup_mma(v0, pt, o0, is_async=True)
        if D == 128:
            o1 = warpgroup_mma(v1, pt, o1, is_async=True)
            o0, o1, v0, v1 = warpgroup_mma_wait(0, deps=[o0, o1, v0, v1])
        else:
            o0, v0 = warpgroup_mma_wait(0, deps=[o0, v0])

        r = gl.expand_dims(gl.arange(0, 64, layout=key_layout), 1)
        write_decode_output(o0, o1, v_dim(r, 0, D), v_dim(r, 1, D), m_i, l_keys, sink, O, MID_O, MID_LSE, b, kvh,
                            split, num_splits, stride_ob, stride_oh, head_layout, GROUP, NPAD, D, D == 128, DIRECT,
                            HAS_SINKS)

    @gluon.jit
    def _producer(kv_desc, vv_desc, ks_desc, vs_desc, kc_smem, vc_smem, sc_smem, ready, empty, bt_row, start, end,
                  n_tiles, kvh, NUM_KV_HEADS: gl.constexpr, D: gl.constexpr, PAGE: gl.constexpr,
                  STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
        """The copy warp: every key tile of the split (each page's K and V codes, whole rows, and its K and V
        scales, each into a 128-byte chunk of its own: a bulk copy's destination must be 128-byte aligned) as soon
        as the consumer frees its slot. A tile starts at a copy (``split_range``), so each copy lies in one page;
        table entries at or past ``end`` are not read: page 0 stands in (masked by position)."""
        ROWS: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N  # keys per copy
        COPIES: gl.constexpr = BLOCK_N // ROWS
        nbytes: gl.constexpr = 2 * BLOCK_N * (D + ks_desc.dtype.primitive_bitwidth // 8)
        for t in range(n_tiles):
            slot = t % STAGES
            # Slot t % STAGES last held tile t - STAGES: wait until it was released.
            mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1, pred=t >= STAGES)
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            n0 = start + t * BLOCK_N
            for c in gl.static_range(COPIES):
                pos = n0 + c * ROWS
                page = gl.load(bt_row + pos // PAGE, mask=pos < end, other=0)
                row = page * PAGE + pos % PAGE
                _tma_load(kv_desc, [row, kvh * D], bar, kc_smem.index(slot).slice(c * ROWS, ROWS))
                _tma_load(vv_desc, [row, kvh * D], bar, vc_smem.index(slot).slice(c * ROWS, ROWS))
                s_row = page * NUM_KV_HEADS + kvh
                ks = sc_smem.index(2 * slot * COPIES + c).slice(0, ROWS, dim=1)
                vs = sc_smem.index((2 * slot + 1) * COPIES + c).slice(0, ROWS, dim=1)
                _tma_load(ks_desc, [s_row, pos % PAGE], bar, ks)
                _tma_load(vs_desc, [s_row, pos % PAGE], bar, vs)

    @gluon.jit(do_not_specialize=["stride_btb", "num_splits"])  # both change from step to step
    def _decode_sm90_8bit_kernel(
        Q, kv_desc, vv_desc, ks_desc, vs_desc, BT, CL, O, MID_O, MID_LSE, scale_log2e,
        stride_qb, stride_qh, stride_btb, stride_ob, stride_oh, num_splits, SINKS,
        GROUP: gl.constexpr, NPAD: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr,
        NUM_KV_HEADS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONVERT_Q: gl.constexpr,
        DIRECT: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr, HAS_SINKS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        ROWS: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N  # keys per copy
        kvh = gl.program_id(0)  # fastest: a sequence's heads start together, in the batch's order
        b = gl.program_id(1)
        split = gl.program_id(2)
        start, end, lo = split_range(CL, b, split, num_splits, BLOCK_N, ROWS, WINDOW)
        if start < end:
            n_tiles = gl.cdiv(end - start, BLOCK_N)
            lay16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
            q_smem = gl.allocate_shared_memory(gl.float16, [NPAD, HEAD_DIM], lay16)
            p_smem = gl.allocate_shared_memory(gl.float16, [2, NPAD, BLOCK_N], lay16)
            kc_smem = gl.allocate_shared_memory(kv_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_desc.layout)
            vc_smem = gl.allocate_shared_memory(kv_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_desc.layout)
            COPIES: gl.constexpr = BLOCK_N // ROWS
            CHUNK: gl.constexpr = max(ROWS, 1024 // ks_desc.dtype.primitive_bitwidth)  # scales per 128-byte chunk
            sc_smem = gl.allocate_shared_memory(ks_desc.dtype, [2 * STAGES * COPIES, 1, CHUNK], ks_desc.layout)
            ready, empty = barrier_ring(STAGES, 1)
            # The consumer reads a slot's K (or V) scales as [COPIES, CHUNK].
            sc_pages = reinterpret(sc_smem, ks_desc.dtype, [2 * STAGES, COPIES, CHUNK],
                                   gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
            gl.warp_specialize([
                (_consumer, (Q, q_smem, kc_smem, vc_smem, sc_pages, p_smem, ready, empty, O, MID_O, MID_LSE, SINKS,
                             scale_log2e, b, kvh, split, num_splits, start, lo, end, n_tiles, stride_qb, stride_qh,
                             stride_ob, stride_oh, GROUP, NPAD, HEAD_DIM, ROWS, STAGES, BLOCK_N, CONVERT_Q,
                             DIRECT, WINDOW, SOFTCAP, HAS_SINKS)),
                (_producer, (kv_desc, vv_desc, ks_desc, vs_desc, kc_smem, vc_smem, sc_smem, ready, empty,
                             BT + b.to(gl.int64) * stride_btb, start, end, n_tiles, kvh, NUM_KV_HEADS, HEAD_DIM,
                             PAGE, STAGES, BLOCK_N)),
            ], [1], [PRODUCER_REGS])
            invalidate_ring(ready, empty, STAGES)
        else:
            write_empty_split(MID_O, MID_LSE, b, kvh, split, num_splits, GROUP, NPAD, HEAD_DIM, num_warps)


def descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor
                ) -> tuple:
    """TMA descriptors of an 8-bit cache: K and V codes as [slots, Hkv * D] with whole-row boxes of one page
    (up to a tile's ``BLOCK_N`` keys), the scales as [num_blocks * Hkv, block_size] with one box per page."""
    num_blocks, page, num_kv_heads, head_dim = k_cache.shape
    rows = min(page, BLOCK_N)
    code_layout = gl.NVMMASharedLayout(swizzle_byte_width=head_dim, element_bitwidth=8, rank=2)
    shape, strides = [num_blocks * page, num_kv_heads * head_dim], [num_kv_heads * head_dim, 1]
    scale_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8 * k_scale.element_size(), rank=2)
    s_shape, s_strides = [num_blocks * num_kv_heads, page], [page, 1]
    return (TensorDescriptor(k_cache, shape, strides, [rows, head_dim], code_layout),
            TensorDescriptor(v_cache, shape, strides, [rows, head_dim], code_layout),
            TensorDescriptor(k_scale, s_shape, s_strides, [1, rows], scale_layout),
            TensorDescriptor(v_scale, s_shape, s_strides, [1, rows], scale_layout))
