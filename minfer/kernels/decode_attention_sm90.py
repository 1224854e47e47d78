"""Paged decode attention for Hopper (sm_90) in Gluon: a copy warp streams the context's pages by TMA while
one consumer warpgroup computes on warpgroup MMA, with keys (not query heads) along the MMA's rows.

The same computation as ``decode_attention.py`` (its Triton kernel is this one's reference and the path
everywhere else): a program owns one KV head of one sequence and one split of its context, and every query
head of the GQA group; partial outputs of split programs are merged by that module's merge kernel.

- **Transposed products.** A warpgroup MMA has 64 rows; a GQA group has 1-16 query heads. So the kernel
  computes Sᵀ = K·Qᵀ (keys along the 64 rows, the group padded to 8 or 16 columns) and Oᵀ += Vᵀ·Pᵀ (head
  dimensions along the rows), instead of padding 4 query rows to 16 or 64. K and V tiles go to the tensor
  cores straight from the TMA's swizzled shared memory (V as the transposed A operand); P, computed in
  registers, is stored to shared memory as the second product's B operand. The softmax runs per column
  (head) over the tile's 64 keys; its denominators are kept per (key, head) and summed once at the end.
- **Warp specialization.** The copy warp looks up each page and issues its TMA copies into a ring of
  ``STAGES`` slots completing on mbarriers; the consumer releases a slot once its P·V product has read it.
  In tile j the consumer issues S_j and P_{j-1}·V_{j-1}, waits for S_j alone, and computes tile j's softmax
  while the tensor cores still run the P·V product.
- **8-bit caches.** The copy warp fills a ring of codes; the converter partition shared with the prefill
  kernel (``gluon_sm90.converter``) turns each slot into the exact float16 values of the codes and stages the
  per-key scales, K's multiplying the score rows, V's the P rows. A bf16 q is converted to float16 once.

Keys past a split's range are read (page 0 for table entries past the context) and masked by position, so
the cache must hold finite values there, which the engine's zeroed cache does.
"""

from __future__ import annotations

import torch
import triton

from .decode_attention import (
    SPLIT_TARGET_PER_SM, choose_num_splits, merge_partials, paged_decode_attention, split_partials,
)
from . import decode_attention_sm90_8bit as sm90_8bit
from .gluon_sm90 import HALF, LOG2E, BuildGuard, gluon, sm90_available
from .quant import check_paged_attention

if gluon is not None:
    from .gluon_sm90 import (
        TensorDescriptor, code_ring, converter, fence_async_shared, gl, issue_tile, mbarrier, partition_barrier,
        warpgroup_mma, warpgroup_mma_wait,
    )

BLOCK_N = 64  # keys per tile: the MMA's 64 rows
STAGES = 3  # K/V ring slots of 16-bit caches (3 x 32 KB at head_dim 128: two programs fit an SM)
QUANT_STAGES = 2  # float16 slots the converter fills, for 8-bit caches
CODE_STAGES = 2  # 8-bit code slots the copy warp fills
CONVERTER_REGS = 80  # registers per converter thread
# Registers per thread at launch, so that two programs share an SM (setmaxnreg then gives the consumer the
# copy warp's group's spare ones): 16-bit, 2 warpgroups x 128 threads; 8-bit, 3 (consumer, copy, converter).
MAX_REGS = 128
QUANT_MAX_REGS = 80
# 16-bit caches split toward one program per SM, not two (H200, B=1 x 32k, llama-3.1-8b heads: 16 splits 50.0-50.8 us,
# 33 splits 52.0-52.4); 8-bit ones keep the Triton kernel's two (fp8_e4m3: 33 splits 40.7 us, 16 splits 48.5).
SPLITS_PER_SM = 1
QUANT_VIA_CONVERTER = False  # 8-bit caches: the converter partition (True) or the register operands
MAX_GROUP = 16  # query heads per KV head the kernel serves (the MMA's N, padded to 8 or 16)

_guard = BuildGuard("decode attention")

if gluon is not None:
    _HALF = gl.constexpr(HALF)
    PRODUCER_REGS = gl.constexpr(24)

    @gluon.jit
    def _scores(k_smem, slot, q_smem, s_layout: gl.constexpr, HALVES: gl.constexpr, BLOCK_N: gl.constexpr,
                NPAD: gl.constexpr):
        """Issue Sᵀ = K·Qᵀ for the tile in ``slot`` (asynchronous: one wgmma group per half)."""
        zero = gl.zeros([BLOCK_N, NPAD], gl.float32, s_layout)  # ignored (use_acc=False)
        s = warpgroup_mma(k_smem.index(slot * HALVES), q_smem.index(0).permute((1, 0)), zero, use_acc=False,
                          is_async=True)
        for hf in gl.static_range(1, HALVES):
            s = warpgroup_mma(k_smem.index(slot * HALVES + hf), q_smem.index(hf).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _softmax(s, m_i, l_keys, n0, end, sc_smem, slot, scale_log2e, key_layout: gl.constexpr,
                 QUANT: gl.constexpr, BLOCK_N: gl.constexpr):
        """Online softmax of one Sᵀ tile, per column: (Pᵀ, the new running max per head, the per-(key, head)
        denominators, the rescale factor). 8-bit caches: K's per-key scales (``scale * log2 e`` folded in)
        multiply the score rows, V's the P rows."""
        offs = n0 + gl.arange(0, BLOCK_N, layout=key_layout)
        if QUANT:
            s = s * gl.expand_dims(sc_smem.index(2 * slot).load(key_layout), 1)
        else:
            s = s * scale_log2e
        s = gl.where(gl.expand_dims(offs < end, 1), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        p = gl.exp2(s - gl.expand_dims(m_new, 0))
        alpha = gl.exp2(m_i - m_new)
        l_keys = l_keys * gl.expand_dims(alpha, 0) + p
        if QUANT:
            p = p * gl.expand_dims(sc_smem.index(2 * slot + 1).load(key_layout), 1)
        return p, m_new, l_keys, alpha

    @gluon.jit
    def _consumer(Q, q_smem, k_smem, v_smem, p_smem, sc_smem, ready, empty, O, MID_O, MID_LSE, scale_log2e,
                  b, kvh, split, num_splits, start, end, n_tiles, stride_qb, stride_qh, stride_ob, stride_oh,
                  GROUP: gl.constexpr, NPAD: gl.constexpr, HEAD_DIM: gl.constexpr, HALVES: gl.constexpr,
                  STAGES: gl.constexpr, BLOCK_N: gl.constexpr, QUANT: gl.constexpr, CONVERT_Q: gl.constexpr,
                  DIRECT: gl.constexpr):
        """The warpgroup that computes: q into shared memory, the online softmax over the tiles delivered to
        ``ready``, then the output (``DIRECT``) or the split's normalised partial and log2-sum-exp2."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, NPAD, 16])
        key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        head_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        dim_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # Oᵀ's rows: head dims
        dtype: gl.constexpr = k_smem.dtype

        # q rows: this group's heads, zero past it, in the products' dtype.
        q_blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = gl.arange(0, NPAD, layout=gl.SliceLayout(1, q_blk))
        cols = gl.arange(0, _HALF, layout=gl.SliceLayout(0, q_blk))
        q_ptr = Q + b.to(gl.int64) * stride_qb + gl.expand_dims((kvh * GROUP + rows) * stride_qh, 1) \
            + gl.expand_dims(cols, 0)
        for hf in gl.static_range(HALVES):
            x = gl.load(q_ptr + hf * _HALF, mask=gl.expand_dims(rows < GROUP, 1), other=0.0)
            if CONVERT_Q:  # bf16 q against float16 codes (values past float16's range saturate, as quant.q_to_f16)
                x = gl.minimum(gl.maximum(x.to(gl.float32), -65504.0), 65504.0)
            q_smem.index(hf).store(x.to(dtype))
        fence_async_shared()
        partition_barrier()

        m_i = gl.full([NPAD], float("-inf"), gl.float32, head_layout)
        l_keys = gl.zeros([BLOCK_N, NPAD], gl.float32, s_layout)
        o0 = gl.zeros([_HALF, NPAD], gl.float32, s_layout)
        o1 = gl.zeros([_HALF, NPAD], gl.float32, s_layout)

        # Tile 0: its scores alone (a split's first tile holds at least one key: no column stays -inf).
        mbarrier.wait(ready.index(0), 0)
        s = _scores(k_smem, 0, q_smem, s_layout, HALVES, BLOCK_N, NPAD)
        s = warpgroup_mma_wait(0, deps=[s])
        p, m_i, l_keys, alpha = _softmax(s, m_i, l_keys, start, end, sc_smem, 0, scale_log2e, key_layout, QUANT,
                                         BLOCK_N)
        p_smem.index(0).store(gl.permute(p.to(dtype), (1, 0)))
        fence_async_shared()
        partition_barrier()
        for j in range(1, n_tiles):
            slot = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            s = _scores(k_smem, slot, q_smem, s_layout, HALVES, BLOCK_N, NPAD)
            pt = p_smem.index((j - 1) % 2).permute((1, 0))  # Pᵀ of tile j-1: [keys, heads]
            o0 = warpgroup_mma(v_smem.index(prev * HALVES).permute((1, 0)), pt, o0, is_async=True)
            if HALVES == 2:
                o1 = warpgroup_mma(v_smem.index(prev * HALVES + 1).permute((1, 0)), pt, o1, is_async=True)
            s = warpgroup_mma_wait(HALVES, deps=[s])
            p, m_i, l_keys, alpha = _softmax(s, m_i, l_keys, start + j * BLOCK_N, end, sc_smem, slot, scale_log2e,
                                             key_layout, QUANT, BLOCK_N)
            p_smem.index(j % 2).store(gl.permute(p.to(dtype), (1, 0)))  # the other buffer than P·V's
            if HALVES == 2:
                o0, o1 = warpgroup_mma_wait(0, deps=[o0, o1])
            else:
                o0 = warpgroup_mma_wait(0, deps=[o0])
            mbarrier.arrive(empty.index(prev), count=1)  # tile j-1's K and V are no longer read
            fence_async_shared()
            partition_barrier()
            a = gl.expand_dims(alpha, 0)
            o0 = o0 * a
            o1 = o1 * a
        last = (n_tiles - 1) % STAGES
        pt = p_smem.index((n_tiles - 1) % 2).permute((1, 0))
        o0 = warpgroup_mma(v_smem.index(last * HALVES).permute((1, 0)), pt, o0, is_async=True)
        if HALVES == 2:
            o1 = warpgroup_mma(v_smem.index(last * HALVES + 1).permute((1, 0)), pt, o1, is_async=True)
            o0, o1 = warpgroup_mma_wait(0, deps=[o0, o1])
        else:
            o0 = warpgroup_mma_wait(0, deps=[o0])

        l_i = gl.sum(l_keys, axis=0)  # > 0: every split holds a key
        inv_l = gl.expand_dims(1.0 / l_i, 0)
        n = gl.arange(0, NPAD, layout=head_layout)
        d = gl.expand_dims(gl.arange(0, _HALF, layout=dim_layout), 1)
        heads = kvh * GROUP + n
        keep = gl.expand_dims(n < GROUP, 0)
        if DIRECT:
            ptr = O + b.to(gl.int64) * stride_ob + gl.expand_dims(heads * stride_oh, 0) + d
            gl.store(ptr, (o0 * inv_l).to(O.dtype.element_ty), mask=keep)
            if HALVES == 2:
                gl.store(ptr + _HALF, (o1 * inv_l).to(O.dtype.element_ty), mask=keep)
        else:  # partials [B, Hq, num_splits, D] and [B, Hq, num_splits], as the Triton kernel writes them
            idx = (b * (GROUP * gl.num_programs(0)) + heads).to(gl.int64) * num_splits + split
            ptr = MID_O + gl.expand_dims(idx * HEAD_DIM, 0) + d
            gl.store(ptr, o0 * inv_l, mask=keep)
            if HALVES == 2:
                gl.store(ptr + _HALF, o1 * inv_l, mask=keep)
            gl.store(MID_LSE + idx, m_i + gl.log2(l_i), mask=n < GROUP)

    @gluon.jit
    def _producer(k_desc, v_desc, k_smem, v_smem, ready, empty, bt_row, start, end, n_tiles, kv_col,
                  PAGE: gl.constexpr, HALVES: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
        """The copy warp: every key tile of the split as soon as the consumer (or converter) frees its slot."""
        for t in range(n_tiles):
            slot = t % STAGES
            # Slot t % STAGES last held tile t - STAGES: wait until it was released.
            mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1, pred=t >= STAGES)
            issue_tile(k_desc, v_desc, k_smem, v_smem, ready.index(slot), bt_row, slot, start + t * BLOCK_N, end,
                       kv_col, PAGE, HALVES, BLOCK_N)

    @gluon.jit(do_not_specialize=["stride_btb", "num_splits"])  # both change from step to step
    def _decode_sm90_kernel(
        Q, k_desc, v_desc, KS, VS, BT, CL, O, MID_O, MID_LSE, scale_log2e,
        stride_qb, stride_qh, stride_btb, stride_ob, stride_oh, num_splits,
        GROUP: gl.constexpr, NPAD: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr,
        NUM_KV_HEADS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CODE_STAGES: gl.constexpr,
        QUANT: gl.constexpr, CONVERT_Q: gl.constexpr, DIRECT: gl.constexpr, CONVERTER_REGS_Q: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        HALVES: gl.constexpr = HEAD_DIM // _HALF
        kvh = gl.program_id(0)  # fastest: a sequence's heads start together, in the batch's order
        b = gl.program_id(1)
        split = gl.program_id(2)
        ctx = gl.load(CL + b)
        # Equal ranges of this sequence's own context, rounded up to whole tiles (as the Triton kernel cuts them).
        per_split = gl.cdiv(gl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = gl.minimum(start + per_split, ctx)
        if start < end:
            n_tiles = gl.cdiv(end - start, BLOCK_N)
            bt_row = BT + b.to(gl.int64) * stride_btb
            dtype: gl.constexpr = gl.float16 if QUANT else k_desc.dtype
            layout16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
            q_smem = gl.allocate_shared_memory(dtype, [HALVES, NPAD, _HALF], layout16)
            p_smem = gl.allocate_shared_memory(dtype, [2, NPAD, BLOCK_N], layout16)
            # The ring the consumer reads: the copies themselves, or (8-bit) the converter's float16 tiles.
            k_smem = gl.allocate_shared_memory(dtype, [STAGES * HALVES, BLOCK_N, _HALF], layout16)
            v_smem = gl.allocate_shared_memory(dtype, [STAGES * HALVES, BLOCK_N, _HALF], layout16)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(ready.index(i), count=1)
                mbarrier.init(empty.index(i), count=1)
            if QUANT:
                kc_smem, vc_smem, sc_smem, copied, released = code_ring(k_desc, CODE_STAGES, STAGES, HALVES, BLOCK_N)
                gl.warp_specialize([
                    (_consumer, (Q, q_smem, k_smem, v_smem, p_smem, sc_smem, ready, empty, O, MID_O, MID_LSE,
                                 scale_log2e, b, kvh, split, num_splits, start, end, n_tiles, stride_qb, stride_qh,
                                 stride_ob, stride_oh, GROUP, NPAD, HEAD_DIM, HALVES, STAGES, BLOCK_N, QUANT,
                                 CONVERT_Q, DIRECT)),
                    (_producer, (k_desc, v_desc, kc_smem, vc_smem, copied, released, bt_row, start, end, n_tiles,
                                 kvh * HEAD_DIM, PAGE, HALVES, CODE_STAGES, BLOCK_N)),
                    (converter, (kc_smem, vc_smem, k_smem, v_smem, sc_smem, copied, released, ready, empty,
                                 KS, VS, bt_row, kvh * PAGE, NUM_KV_HEADS * PAGE, start, end, n_tiles, scale_log2e,
                                 PAGE, HALVES, CODE_STAGES, STAGES, BLOCK_N, BLOCK_N)),
                ], [1, 4], [PRODUCER_REGS, CONVERTER_REGS_Q])
                for i in gl.static_range(CODE_STAGES):
                    mbarrier.invalidate(copied.index(i))
                    mbarrier.invalidate(released.index(i))
            else:
                gl.warp_specialize([
                    (_consumer, (Q, q_smem, k_smem, v_smem, p_smem, q_smem, ready, empty, O, MID_O, MID_LSE,
                                 scale_log2e, b, kvh, split, num_splits, start, end, n_tiles, stride_qb, stride_qh,
                                 stride_ob, stride_oh, GROUP, NPAD, HEAD_DIM, HALVES, STAGES, BLOCK_N, QUANT,
                                 CONVERT_Q, DIRECT)),
                    (_producer, (k_desc, v_desc, k_smem, v_smem, ready, empty, bt_row, start, end, n_tiles,
                                 kvh * HEAD_DIM, PAGE, HALVES, STAGES, BLOCK_N)),
                ], [1], [PRODUCER_REGS])
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(i))
                mbarrier.invalidate(empty.index(i))
        else:  # an empty split (a sequence shorter than the splits): a zero partial whose -inf lse the merge ignores
            blk: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, num_warps], [1, 0])
            n = gl.arange(0, NPAD, layout=gl.SliceLayout(1, blk))
            d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blk))
            idx = (b * (GROUP * gl.num_programs(0)) + kvh * GROUP + n).to(gl.int64) * num_splits + split
            gl.store(MID_O + gl.expand_dims(idx * HEAD_DIM, 1) + gl.expand_dims(d, 0),
                     gl.zeros([NPAD, HEAD_DIM], gl.float32, blk), mask=gl.expand_dims(n < GROUP, 1))
            gl.store(MID_LSE + idx, gl.full([NPAD], float("-inf"), gl.float32, gl.SliceLayout(1, blk)),
                     mask=n < GROUP)


def sm90_decode_applies(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this kernel takes the call: a 16-bit q on a Hopper GPU (``sm90_available``), a GQA group of at
    most ``MAX_GROUP`` heads."""
    head_dim, num_heads, num_kv_heads = q.shape[2], q.shape[1], k_cache.shape[2]
    return (q.dtype in (torch.bfloat16, torch.float16) and num_heads // num_kv_heads <= MAX_GROUP
            and sm90_available(q.device, head_dim, k_cache.shape[1]))


def paged_decode_attention_sm90(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``paged_decode_attention`` (same arguments and result) on sm_90 with a 16-bit q over 16-bit or 8-bit
    caches; other inputs go to the Triton kernel."""
    fmt = check_paged_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables=block_tables,
                                context_lens=context_lens)
    fallback = lambda: paged_decode_attention(  # noqa: E731
        q, k_cache, v_cache, block_tables, context_lens, scale, out, k_scale=k_scale, v_scale=v_scale,
        num_splits=num_splits)
    if not sm90_decode_applies(q, k_cache):
        return fallback()
    batch, num_heads, head_dim = q.shape
    num_blocks, page, num_kv_heads = k_cache.shape[:3]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    quant = fmt is not None
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1] * page, q.device,
                                       SPLIT_TARGET_PER_SM if quant else SPLITS_PER_SM)
    mid_o, mid_lse = split_partials(q, out, num_splits)
    direct = num_splits == 1
    common = (block_tables, context_lens, out, mid_o, mid_lse, scale * LOG2E, q.stride(0), q.stride(1),
              block_tables.stride(0), out.stride(0), out.stride(1), num_splits)
    params = dict(GROUP=group, NPAD=8 if group <= 8 else 16, HEAD_DIM=head_dim, PAGE=page,
                  NUM_KV_HEADS=num_kv_heads, BLOCK_N=BLOCK_N, CONVERT_Q=quant and q.dtype == torch.bfloat16,
                  DIRECT=direct, num_warps=4)
    if quant and not QUANT_VIA_CONVERTER:
        kernel = sm90_8bit._decode_sm90_8bit_kernel
        args = (q, *sm90_8bit.descriptors(k_cache, v_cache, k_scale, v_scale), *common)
        params.update(STAGES=sm90_8bit.STAGES, maxnreg=sm90_8bit.MAX_REGS)
    else:
        kernel = _decode_sm90_kernel
        kv_layout = (gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2) if quant
                     else gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
        kv_shape = [num_blocks * page, num_kv_heads * head_dim]
        kv_strides = [num_kv_heads * head_dim, 1]
        box = [min(page, BLOCK_N), HALF]
        k_desc = TensorDescriptor(k_cache, kv_shape, kv_strides, box, kv_layout)
        v_desc = TensorDescriptor(v_cache, kv_shape, kv_strides, box, kv_layout)
        args = (q, k_desc, v_desc, k_scale if quant else k_cache, v_scale if quant else v_cache, *common)
        params.update(STAGES=QUANT_STAGES if quant else STAGES, CODE_STAGES=CODE_STAGES, QUANT=quant,
                      CONVERTER_REGS_Q=CONVERTER_REGS, maxnreg=QUANT_MAX_REGS if quant else MAX_REGS)
    grid = (num_kv_heads, batch, num_splits)
    if not _guard.launch(quant, lambda: kernel[grid](*args, **params)):
        return fallback()
    if not direct:
        merge_partials(mid_o, mid_lse, out)
    return out
