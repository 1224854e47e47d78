"""Paged prefill attention for Hopper (sm_90) in Gluon: a copy warp feeding two consumer warpgroups
through TMA and mbarriers, warpgroup MMA, and each tile's softmax overlapped with the previous
tile's P·V product.

The same computation as ``prefill_attention.py`` (its Triton kernel is this one's reference and the
path everywhere else): a program owns ``BLOCK_M`` query rows of one head of one sequence and walks
the sequence's keys in ``BLOCK_N`` tiles straight from the paged cache. What Triton's compiler does
not do for that loop, this kernel does by hand:

- **Warp specialization.** One warp only copies: Q once, then each key tile by TMA, one bulk copy
  per cache page and 64-column half, into a ring of ``STAGES`` shared-memory slots that complete on
  ``ready`` mbarriers. Two consumer warpgroups (64 query rows each) compute, and release a slot on
  its ``empty`` mbarrier once both have read it. The page lookups and copy issue never stall the
  tensor-core warps.
- **Products.** S = Q·Kᵀ and O += P·V are ``wgmma`` instructions issued asynchronously: in tile j a
  warpgroup issues S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1}, waits for S_j alone, and computes tile
  j's softmax while the tensor cores still run the P·V product; then O is rescaled by the new
  running max.
- **Layouts.** A 128-byte swizzled bf16 row holds 64 columns, so every 128-wide tile lives in
  shared memory as two [rows, 64] halves: Q·Kᵀ is the sum of two half products, O two [M, 64]
  accumulators. P goes to the second product straight from registers.
- **8-bit caches.** The copy warp fills a ring of codes instead; a converter partition (4 warps)
  turns each slot into the float16 values the codes encode, exactly, in the consumers' ring, and
  stages the tile's per-key scales: K's multiply the score columns, V's the P columns, as in the
  Triton kernel. A bf16 q becomes float16 in place once. The converter's throughput sets the pace
  (benchmarks/RESULTS.md has the figures).

- **Windows, soft-capping and sinks** (``gluon_sm90``). A query block's key loop starts at the TMA copy holding its
  first row's window start, not at key 0 (the copy warp never looks up a page every row's window has left, and
  windowed attention costs O(window)); tiles that reach below some row's window are masked per element like the
  diagonal ones, and a row may then see no key of a tile, so the running max starts finite. The cap runs on the
  scaled scores before the mask. The running max starts at the head's sink, whose term joins the denominator last.

Three K/V stages (3 × 64 KB, and 32 KB of Q, at head_dim 128) fill the 227 KB a block may use. Rows past the
chunk (the tile overhangs into the next sequence's rows) compute harmlessly and are masked at the
store. Keys past the context are read (page 0 for table entries past it) and masked by position:
their P is 0, so the cache must hold finite values there, which the engine's zeroed cache does.
"""

from __future__ import annotations

import torch
import triton

from .gluon_sm90 import HALF, BuildGuard, build_kind, gluon, score_scale, sm90_available
from .decode_attention import check_window_softcap
from .prefill_attention import paged_prefill_attention
from ..quant.quant import check_paged_attention

if gluon is not None:
    from .gluon_sm90 import (
        TensorDescriptor, _tma_load, add_sink, barrier_ring, code_ring, converter, fence_async_shared, gl, head_sinks,
        invalidate_ring, issue_tile, mbarrier, partition_barrier, reinterpret, running_max_start, soft_cap,
        warpgroup_mma, warpgroup_mma_wait,
    )

BLOCK_M = 128
BLOCK_N = 128
STAGES = 3  # K/V ring slots of 16-bit caches
QUANT_STAGES = 2  # float16 slots the converter fills, for 8-bit caches
CODE_STAGES = 2  # 8-bit code slots the copy warp fills
CONVERT_ROWS = 128  # rows the converter moves per load: its loop is latency-bound, so the more the better
QUANT_REGS = (224, 24, 56)  # consumer, copy, converter: 2 x 128 x 224 + 32 x 24 + 128 x 56 <= 64K

_guard = BuildGuard("prefill attention")

if gluon is not None:
    _HALF = gl.constexpr(HALF)
    CONSUMER_REGS = gl.constexpr(232)  # 16-bit caches: 2 x 128 x 232 + 32 x 40 registers <= 64K
    PRODUCER_REGS = gl.constexpr(40)

    @gluon.jit
    def _scores(q_smem, q0: gl.constexpr, k_smem, slot, s_layout: gl.constexpr, HALVES: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Issue S = Q·Kᵀ for the tile in ``slot`` (asynchronous: one wgmma group per half)."""
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)  # ignored (use_acc=False)
        s = warpgroup_mma(q_smem.index(q0), k_smem.index(slot * HALVES).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
        for hf in gl.static_range(1, HALVES):
            s = warpgroup_mma(q_smem.index(q0 + hf), k_smem.index(slot * HALVES + hf).permute((1, 0)), s, is_async=True)
        return s

    @gluon.jit
    def _softmax(s, m_i, l_i, n0, q_pos, ctx, needs_mask, scale_log2e, k_sc, v_sc, col_layout: gl.constexpr,
                 p_layout: gl.constexpr, dtype: gl.constexpr, QUANT: gl.constexpr, BLOCK_N: gl.constexpr,
                 WINDOW: gl.constexpr, SOFTCAP: gl.constexpr):
        """Online softmax of one score tile: (P in ``dtype`` as the P·V product's register operand, the new
        running max, the new row sums, the rescale factor). 8-bit caches (``QUANT``): K's per-key scales
        ``k_sc`` (with ``scale_log2e`` folded in) multiply the score columns, V's ``v_sc`` the P columns. A tile
        that ``needs_mask`` hides keys past a row's position or the context, and with a ``WINDOW`` those before
        the row's window; a ``SOFTCAP`` caps the scaled scores first."""
        if QUANT:
            s = s * gl.expand_dims(k_sc, 0)
        elif SOFTCAP > 0:
            s = s * scale_log2e
        if SOFTCAP > 0:
            s = soft_cap(s, SOFTCAP)
        if needs_mask:
            offs = n0 + gl.arange(0, BLOCK_N, layout=col_layout)
            if WINDOW > 0:  # 0 <= q_pos - key < WINDOW in one unsigned comparison
                seen = (gl.expand_dims(q_pos, 1) - gl.expand_dims(offs, 0)).to(gl.uint32, bitcast=True) < WINDOW
                keep = seen & gl.expand_dims(offs < ctx, 0)
            else:
                keep = (gl.expand_dims(offs, 0) <= gl.expand_dims(q_pos, 1)) & gl.expand_dims(offs < ctx, 0)
            s = gl.where(keep, s, float("-inf"))
        if QUANT or SOFTCAP > 0:  # s is in the log2 domain already
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            p = gl.exp2(s - gl.expand_dims(m_new, 1))
        else:  # the scale rides in the exponent's FMA rather than a separate pass over s
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2e)
            p = gl.exp2(s * scale_log2e - gl.expand_dims(m_new, 1))
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        if QUANT:
            p = p * gl.expand_dims(v_sc, 0)
        return gl.convert_layout(p.to(dtype), p_layout), m_new, l_i, alpha

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, bt_row, q_row, q_col, ctx,
                  kv_start, n_tiles, kv_col, PAGE: gl.constexpr, HALVES: gl.constexpr, STAGES: gl.constexpr,
                  SUB_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """The copy warp: Q once, then every key tile from ``kv_start`` on as soon as the consumers free its
        slot."""
        mbarrier.expect(q_bar, 2 * SUB_M * HALVES * _HALF * q_desc.dtype.primitive_bitwidth // 8)
        for wg in gl.static_range(2):
            for hf in gl.static_range(HALVES):
                _tma_load(q_desc, [q_row + wg * SUB_M, q_col + hf * _HALF], q_bar, q_smem.index(wg * HALVES + hf))
        for t in range(n_tiles):
            # Slot t % STAGES last held tile t - STAGES: wait until both consumers released it.
            mbarrier.wait(empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1, pred=t >= STAGES)
            issue_tile(k_desc, v_desc, k_smem, v_smem, ready.index(t % STAGES), bt_row, t % STAGES,
                       kv_start + t * BLOCK_N, ctx, kv_col, PAGE, HALVES, BLOCK_N)

    @gluon.jit
    def _q_to_f16(q_smem, WG: gl.constexpr, HALVES: gl.constexpr, SUB_M: gl.constexpr):
        """Rewrite one warpgroup's bf16 Q rows as float16 in the same shared memory (values past float16's
        range saturate there, as in ``quant.q_to_f16``) and return the float16 view."""
        blk: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])  # [32, 64], 8 a thread
        q_layout: gl.constexpr = q_smem.layout
        q16 = reinterpret(q_smem, gl.float16, [2 * HALVES, SUB_M, _HALF], q_layout)
        for hf in gl.static_range(HALVES):
            for r in gl.static_range(SUB_M // 32):
                x = q_smem.index(WG * HALVES + hf).slice(r * 32, 32).load(blk).to(gl.float32)
                x = gl.minimum(gl.maximum(x, -65504.0), 65504.0)
                q16.index(WG * HALVES + hf).slice(r * 32, 32).store(x.to(gl.float16))
        fence_async_shared()
        partition_barrier()
        return q16

    @gluon.jit
    def _tile_scales(sc_smem, slot, scale_log2e, col_layout: gl.constexpr, QUANT: gl.constexpr):
        """The per-key K and V scales of the tile in ``slot`` (8-bit caches; unused scalars otherwise)."""
        if QUANT:
            k_sc = sc_smem.index(2 * slot).load(col_layout)
            v_sc = sc_smem.index(2 * slot + 1).load(col_layout)
        else:
            k_sc = scale_log2e
            v_sc = scale_log2e
        return k_sc, v_sc

    @gluon.jit
    def _masked(j, low_tiles, full_tiles, WINDOW: gl.constexpr):
        """Whether tile ``j`` needs the per-element mask: past the tiles every row sees whole (the diagonal and the
        context's end), or with a ``WINDOW`` among the first ``low_tiles``, which reach below some row's window."""
        if WINDOW > 0:
            masked = (j < low_tiles) | (j >= full_tiles)
        else:
            masked = j >= full_tiles
        return masked

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, sc_smem, q_bar, ready, empty, O, scale_log2e, row0, q_len, q_pos0, ctx,
                  kv_start, n_tiles, low_tiles, full_tiles, out_row0, out_col, stride_ot,
                  WG: gl.constexpr, HALVES: gl.constexpr, STAGES: gl.constexpr, SUB_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, QUANT: gl.constexpr, CONVERT_Q: gl.constexpr, WINDOW: gl.constexpr,
                  SOFTCAP: gl.constexpr, sink, HAS_SINKS: gl.constexpr):
        """One warpgroup's 64 query rows: the online-softmax loop over the key tiles delivered to ``ready``
        (by the copy warp; for 8-bit caches by the converter, with the scales in ``sc_smem``), tile j holding
        keys ``kv_start + j * BLOCK_N`` on; the head's ``sink`` (log2 domain) with ``HAS_SINKS``."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, _HALF, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = k_smem.dtype

        q_pos = q_pos0 + gl.arange(0, SUB_M, layout=row_layout)
        if WINDOW > 0:  # a row may see no key of the first tiles: exp2(-inf - m) must stay 0, not NaN
            m_i = gl.full([SUB_M], -1.0e30, gl.float32, row_layout)
        else:
            m_i = gl.full([SUB_M], float("-inf"), gl.float32, row_layout)
        m_i = running_max_start(sink, m_i, HAS_SINKS)
        l_i = gl.zeros([SUB_M], gl.float32, row_layout)
        o0 = gl.zeros([SUB_M, _HALF], gl.float32, o_layout)
        o1 = gl.zeros([SUB_M, _HALF], gl.float32, o_layout)

        mbarrier.wait(q_bar, 0)
        if CONVERT_Q:  # bf16 q against float16 codes: this warpgroup's rows become float16 in place
            q_smem = _q_to_f16(q_smem, WG, HALVES, SUB_M)

        # Tile 0: its scores alone (without a window it holds key 0, which every row sees: no row stays -inf).
        mbarrier.wait(ready.index(0), 0)
        s = _scores(q_smem, WG * HALVES, k_smem, 0, s_layout, HALVES, SUB_M, BLOCK_N)
        s = warpgroup_mma_wait(0, deps=[s])
        k_sc, v_sc = _tile_scales(sc_smem, 0, scale_log2e, col_layout, QUANT)
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, kv_start, q_pos, ctx, _masked(0, low_tiles, full_tiles, WINDOW),
                                      scale_log2e, k_sc, v_sc, col_layout, p_layout, dtype, QUANT, BLOCK_N, WINDOW,
                                      SOFTCAP)
        for j in range(1, n_tiles):
            slot = j % STAGES
            prev = (j - 1) % STAGES
            mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
            s = _scores(q_smem, WG * HALVES, k_smem, slot, s_layout, HALVES, SUB_M, BLOCK_N)
            pa = p
            o0 = warpgroup_mma(pa, v_smem.index(prev * HALVES), o0, is_async=True)
            if HALVES == 2:
                o1 = warpgroup_mma(pa, v_smem.index(prev * HALVES + 1), o1, is_async=True)
                s = warpgroup_mma_wait(2, deps=[s])
            else:
                s = warpgroup_mma_wait(1, deps=[s])
            k_sc, v_sc = _tile_scales(sc_smem, slot, scale_log2e, col_layout, QUANT)  # read after the wait: registers
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, kv_start + j * BLOCK_N, q_pos, ctx,
                                          _masked(j, low_tiles, full_tiles, WINDOW), scale_log2e, k_sc, v_sc,
                                          col_layout, p_layout, dtype, QUANT, BLOCK_N, WINDOW, SOFTCAP)
            if HALVES == 2:
                o0, o1, pa = warpgroup_mma_wait(0, deps=[o0, o1, pa])
            else:
                o0, pa = warpgroup_mma_wait(0, deps=[o0, pa])
            mbarrier.arrive(empty.index(prev), count=1)  # tile j-1's K and V are no longer read
            a = gl.expand_dims(gl.convert_layout(alpha, o_row_layout), 1)
            o0 = o0 * a
            o1 = o1 * a
        last = (n_tiles - 1) % STAGES
        pa = p
        o0 = warpgroup_mma(pa, v_smem.index(last * HALVES), o0, is_async=True)
        if HALVES == 2:
            o1 = warpgroup_mma(pa, v_smem.index(last * HALVES + 1), o1, is_async=True)
            o0, o1, pa = warpgroup_mma_wait(0, deps=[o0, o1, pa])
        else:
            o0, pa = warpgroup_mma_wait(0, deps=[o0, pa])

        inv_l = gl.expand_dims(gl.convert_layout(1.0 / add_sink(l_i, m_i, sink, HAS_SINKS), o_row_layout), 1)
        o_rows = row0 + gl.arange(0, SUB_M, layout=o_row_layout)
        cols = gl.arange(0, _HALF, layout=gl.SliceLayout(0, o_layout))
        ptr = (O + gl.expand_dims((out_row0 + o_rows).to(gl.int64) * stride_ot, 1) + out_col
               + gl.expand_dims(cols, 0))
        store_mask = gl.expand_dims(o_rows < q_len, 1)
        gl.store(ptr, (o0 * inv_l).to(O.dtype.element_ty), mask=store_mask)
        if HALVES == 2:
            gl.store(ptr + _HALF, (o1 * inv_l).to(O.dtype.element_ty), mask=store_mask)

    @gluon.jit(do_not_specialize=["stride_btb"])  # the block-table width changes from step to step
    def _prefill_sm90_kernel(
        q_desc, k_desc, v_desc, KS, VS, BT, QSL, CL, O, scale_log2e, stride_btb, stride_ot, stride_oh, SINKS,
        GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, NUM_KV_HEADS: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CODE_STAGES: gl.constexpr,
        QUANT: gl.constexpr, CONVERT_Q: gl.constexpr, CONVERT_ROWS: gl.constexpr, CONSUMER_REGS_Q: gl.constexpr,
        PRODUCER_REGS_Q: gl.constexpr, CONVERTER_REGS_Q: gl.constexpr, WINDOW: gl.constexpr, SOFTCAP: gl.constexpr,
        HAS_SINKS: gl.constexpr, num_warps: gl.constexpr,
    ):
        HALVES: gl.constexpr = HEAD_DIM // _HALF
        SUB_M: gl.constexpr = BLOCK_M // 2  # rows per consumer warpgroup
        ROWS: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N  # keys per TMA copy
        h = gl.program_id(0)
        m_block = gl.num_programs(1) - 1 - gl.program_id(1)  # the longest query blocks start first
        sq = gl.program_id(2)
        q_start = gl.load(QSL + sq)
        q_len = gl.load(QSL + sq + 1) - q_start
        m0 = m_block * BLOCK_M
        if m0 < q_len:
            ctx = gl.load(CL + sq)
            first_pos = ctx - q_len + m0  # position of the block's first query row
            if WINDOW > 0:
                # From the copy holding the first row's window start (later rows' windows start later); the
                # first low_tiles tiles hold keys before the last row's window start.
                kv_start = gl.maximum(first_pos - WINDOW + 1, 0) // ROWS * ROWS
                low_tiles = gl.maximum(gl.cdiv(first_pos + BLOCK_M - WINDOW - kv_start, BLOCK_N), 0)
            else:
                kv_start = 0
                low_tiles = 0
            n_tiles = gl.cdiv(gl.minimum(ctx, first_pos + BLOCK_M) - kv_start, BLOCK_N)
            full_tiles = (first_pos + 1 - kv_start) // BLOCK_N  # tiles every row sees whole up to the diagonal
            bt_row = BT + sq.to(gl.int64) * stride_btb
            kvh = h // GROUP
            sink = head_sinks(SINKS, h, h < GROUP * NUM_KV_HEADS) if HAS_SINKS else scale_log2e  # else: never read

            q_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * HALVES, SUB_M, _HALF], q_desc.layout)
            q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            mbarrier.init(q_bar, count=1)
            # The ring the consumers read: the copies themselves, or (8-bit) the converter's float16 tiles.
            k_smem = gl.allocate_shared_memory(gl.float16 if QUANT else k_desc.dtype, [STAGES * HALVES, BLOCK_N, _HALF],
                                               q_desc.layout if QUANT else k_desc.layout)
            v_smem = gl.allocate_shared_memory(k_smem.dtype, [STAGES * HALVES, BLOCK_N, _HALF], k_smem.layout)
            ready, empty = barrier_ring(STAGES, 2)  # a slot is released by both consumer warpgroups
            if QUANT:
                kc_smem, vc_smem, sc_smem, copied, released = code_ring(k_desc, CODE_STAGES, STAGES, HALVES, BLOCK_N)
                gl.warp_specialize([
                    (_consumer, (q_smem, k_smem, v_smem, sc_smem, q_bar, ready, empty, O, scale_log2e, m0,
                                 q_len, first_pos, ctx, kv_start, n_tiles, low_tiles, full_tiles, q_start,
                                 h * stride_oh, stride_ot, 0, HALVES, STAGES, SUB_M, BLOCK_N, QUANT, CONVERT_Q, WINDOW,
                                 SOFTCAP, sink, HAS_SINKS)),
                    (_consumer, (q_smem, k_smem, v_smem, sc_smem, q_bar, ready, empty, O, scale_log2e,
                                 m0 + SUB_M, q_len, first_pos + SUB_M, ctx, kv_start, n_tiles, low_tiles, full_tiles,
                                 q_start, h * stride_oh, stride_ot, 1, HALVES, STAGES, SUB_M, BLOCK_N, QUANT,
                                 CONVERT_Q, WINDOW, SOFTCAP, sink, HAS_SINKS)),
                    (_producer, (q_desc, k_desc, v_desc, q_smem, kc_smem, vc_smem, q_bar, copied, released,
                                 bt_row, q_start + m0, h * HEAD_DIM, ctx, kv_start, n_tiles, kvh * HEAD_DIM,
                                 PAGE, HALVES, CODE_STAGES, SUB_M, BLOCK_N)),
                    (converter, (kc_smem, vc_smem, k_smem, v_smem, sc_smem, copied, released, ready, empty,
                                 KS, VS, bt_row, kvh * PAGE, NUM_KV_HEADS * PAGE, kv_start, ctx, n_tiles,
                                 scale_log2e, PAGE, HALVES, CODE_STAGES, STAGES, BLOCK_N, CONVERT_ROWS)),
                ], [4, 1, 4], [CONSUMER_REGS_Q, PRODUCER_REGS_Q, CONVERTER_REGS_Q])
                invalidate_ring(copied, released, CODE_STAGES)
            else:
                gl.warp_specialize([
                    (_consumer, (q_smem, k_smem, v_smem, q_smem, q_bar, ready, empty, O, scale_log2e, m0,
                                 q_len, first_pos, ctx, kv_start, n_tiles, low_tiles, full_tiles, q_start,
                                 h * stride_oh, stride_ot, 0, HALVES, STAGES, SUB_M, BLOCK_N, QUANT, CONVERT_Q, WINDOW,
                                 SOFTCAP, sink, HAS_SINKS)),
                    (_consumer, (q_smem, k_smem, v_smem, q_smem, q_bar, ready, empty, O, scale_log2e,
                                 m0 + SUB_M, q_len, first_pos + SUB_M, ctx, kv_start, n_tiles, low_tiles, full_tiles,
                                 q_start, h * stride_oh, stride_ot, 1, HALVES, STAGES, SUB_M, BLOCK_N, QUANT,
                                 CONVERT_Q, WINDOW, SOFTCAP, sink, HAS_SINKS)),
                    (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, bt_row,
                                 q_start + m0, h * HEAD_DIM, ctx, kv_start, n_tiles, kvh * HEAD_DIM,
                                 PAGE, HALVES, STAGES, SUB_M, BLOCK_N)),
                ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
            invalidate_ring(ready, empty, STAGES)
            mbarrier.invalidate(q_bar)


def paged_prefill_attention_sm90(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_prefill_attention`` (same arguments and result) on sm_90 with a 16-bit q over bf16/fp16 or
    8-bit caches; other inputs go to the Triton kernel. ``window`` (0: none): row i of a chunk of q_len rows,
    at position ``context_lens[s] - q_len + i``, sees its last ``window`` keys, and only their pages' table
    entries are read; ``softcap`` (0: none): scores s become ``softcap * tanh(s / softcap)``; ``sinks`` ``[Hq]``
    (None: none): a logit per head in the softmax's denominator, with no value."""
    fmt = check_paged_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables=block_tables,
                                context_lens=context_lens, query_start_loc=query_start_loc)
    check_window_softcap(window, softcap, sinks, q)
    fallback = lambda: paged_prefill_attention(  # noqa: E731
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, max_query_len, scale, out,
        k_scale=k_scale, v_scale=v_scale, window=window, softcap=softcap, sinks=sinks)
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, page, num_kv_heads = k_cache.shape[:3]
    tma_ready = q.stride(1) == head_dim and q.stride(0) % 8 == 0 and q.data_ptr() % 16 == 0  # TMA alignment
    if (q.dtype not in (torch.bfloat16, torch.float16) or not tma_ready
            or not sm90_available(q.device, head_dim, page)):
        return fallback()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    quant = fmt is not None
    layout16 = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # 64 one-byte codes fill a 64-byte swizzled row: 8-bit tiles keep the same 64-column halves.
    kv_layout = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2) if quant else layout16
    # q [T, Hq, D] as a 2-D [T, Hq*D] view with its own row stride (q is a slice of the fused projection).
    q_desc = TensorDescriptor(q, [num_tokens, num_heads * head_dim], [q.stride(0), 1], [BLOCK_M // 2, HALF],
                              layout16)
    kv_shape = [num_blocks * page, num_kv_heads * head_dim]
    kv_strides = [num_kv_heads * head_dim, 1]
    box = [min(page, BLOCK_N), HALF]
    k_desc = TensorDescriptor(k_cache, kv_shape, kv_strides, box, kv_layout)
    v_desc = TensorDescriptor(v_cache, kv_shape, kv_strides, box, kv_layout)
    grid = (num_heads, triton.cdiv(max_query_len, BLOCK_M), num_seqs)
    args = (q_desc, k_desc, v_desc, k_scale if quant else k_cache, v_scale if quant else v_cache, block_tables,
            query_start_loc, context_lens, out, score_scale(scale, softcap), block_tables.stride(0), out.stride(0),
            out.stride(1))
    params = dict(
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE=page, NUM_KV_HEADS=num_kv_heads,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=QUANT_STAGES if quant else STAGES, CODE_STAGES=CODE_STAGES,
        QUANT=quant, CONVERT_Q=quant and q.dtype == torch.bfloat16, CONVERT_ROWS=CONVERT_ROWS,
        CONSUMER_REGS_Q=QUANT_REGS[0], PRODUCER_REGS_Q=QUANT_REGS[1], CONVERTER_REGS_Q=QUANT_REGS[2],
        WINDOW=int(window), SOFTCAP=float(softcap), SINKS=sinks, HAS_SINKS=sinks is not None, num_warps=4,
    )
    kind = build_kind(quant, window, softcap, sinks is not None)
    if _guard.launch(kind, lambda: _prefill_sm90_kernel[grid](*args, **params)):
        return out
    return fallback()
