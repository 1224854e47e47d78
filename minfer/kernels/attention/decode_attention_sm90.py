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
- **8-bit caches** go to ``decode_attention_sm90_8bit.py``, the same frame with the codes converted in the
  consumer's registers (the entry point below chooses).
- **Windows, soft-capping and sinks** (``gluon_sm90``): with a window the splits cut [max(0, ctx - window), ctx)
  instead of the context (``split_range``), so the copy warp never looks up a page the window has left; the cap runs
  on each score tile before the mask; split 0 counts the sinks (``decode_max_start``).

Keys past a split's range are read (page 0 for table entries past the context) and masked by position, so
the cache must hold finite values there, which the engine's zeroed cache does.
"""

from __future__ import annotations

import torch

from .decode_attention import (
    SPLIT_TARGET_PER_SM, check_window_softcap, choose_num_splits, merge_partials, paged_decode_attention,
    split_partials,
)
from . import decode_attention_sm90_8bit as sm90_8bit
from .._utils import num_sms
from .gluon_sm90 import HALF, BuildGuard, build_kind, gluon, score_scale, sm90_available
from ..quant.quant import check_paged_attention

if gluon is not None:
    from .gluon_sm90 import (
        TensorDescriptor, barrier_ring, decode_max_start, fence_async_shared, gl, invalidate_ring, issue_tile,
        log2_scores, mbarrier, online_softmax, partition_barrier, split_range, warpgroup_mma, warpgroup_mma_wait,
        write_decode_output, write_empty_split,
    )

BLOCK_N = 64  # keys per tile: the MMA's 64 rows
STAGES = 3  # K/V ring slots (3 x 32 KB at head_dim 128: two programs fit an SM)
# Slots when the grid has at most one program per SM (long contexts split toward one per SM): a deeper ring keeps
# more bytes in flight for the program alone on its SM (H200, B=1 x 32k, 16 splits: 3 slots 50.3 us, 4 49.4, 5 50.0).
SOLE_STAGES = 4
# Registers per thread at launch (2 warpgroups x 128 threads), so that two programs share an SM; setmaxnreg then
# gives the consumer the copy warp's group's spare ones.
MAX_REGS = 128
# 16-bit caches split toward one program per SM, not two (H200, B=1 x 32k, llama-3.1-8b heads: 16 splits 50.0-50.8 us,
# 33 splits 52.0-52.4); 8-bit ones keep the Triton kernel's two (int8: 33 splits 35.2 us, 16 splits 34.7-35.5).
SPLITS_PER_SM = 1
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
    def _consumer(Q, q_smem, k_smem, v_smem, p_smem, ready, empty, O, MID_O, MID_LSE, SINKS, scale_log2e,
                  b, kvh, split, num_splits, start, lo, end, n_tiles, stride_qb, stride_qh, stride_ob, stride_oh,
                  GROUP: gl.constexpr, NPAD: gl.constexpr, HEAD_DIM: gl.constexpr, HALVES: gl.constexpr,
                  STAGES: gl.constexpr, BLOCK_N: gl.constexpr, DIRECT: gl.constexpr, WINDOW: gl.constexpr,
                  SOFTCAP: gl.constexpr, HAS_SINKS: gl.constexpr):
        """The warpgroup that computes: q into shared memory, the online softmax over the tiles delivered to
        ``ready`` (keys before ``lo`` masked with a ``WINDOW``, scores capped with a ``SOFTCAP``, split 0 counting
        the ``SINKS``), then the output (``DIRECT``) or the split's normalised partial and log2-sum-exp2."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, NPAD, 16])
        key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        head_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        dim_layout: gl.constexpr = gl.SliceLayout(1, s_layout)  # Oᵀ's rows: head dims
        dtype: gl.constexpr = k_smem.dtype

        # q rows: this group's heads, zero past it.
        q_blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = gl.arange(0, NPAD, layout=gl.SliceLayout(1, q_blk))
        cols = gl.arange(0, _HALF, layout=gl.SliceLayout(0, q_blk))
        q_ptr = Q + b.to(gl.int64) * stride_qb + gl.expand_dims((kvh * GROUP + rows) * stride_qh, 1) \
            + gl.expand_dims(cols, 0)
        for hf in gl.static_range(HALVES):
            x = gl.load(q_ptr + hf * _HALF, mask=gl.expand_dims(rows < GROUP, 1), other=0.0)
            q_smem.index(hf).store(x.to(dtype))
        fence_async_shared()
        partition_barrier()

        m_i, sink = decode_max_start(SINKS, kvh, split, head_layout, GROUP, NPAD, HAS_SINKS)
        l_keys = gl.zeros([BLOCK_N, NPAD], gl.float32, s_layout)
        o0 = gl.zeros([_HALF, NPAD], gl.float32, s_layout)
        o1 = gl.zeros([_HALF, NPAD], gl.float32, s_layout)

        # Tile 0: its scores alone (a split's first tile holds at least one key: no column stays -inf).
        mbarrier.wait(ready.index(0), 0)
        s = _scores(k_smem, 0, q_smem, s_layout, HALVES, BLOCK_N, NPAD)
        s = warpgroup_mma_wait(0, deps=[s])
        p, m_i, l_keys, alpha = online_softmax(log2_scores(s, scale_log2e, SOFTCAP), m_i, l_keys, start, lo, end,
                                               key_layout, BLOCK_N, WINDOW)
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
            p, m_i, l_keys, alpha = online_softmax(log2_scores(s, scale_log2e, SOFTCAP), m_i, l_keys,
                                                   start + j * BLOCK_N, lo, end, key_layout, BLOCK_N, WINDOW)
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

        d = gl.expand_dims(gl.arange(0, _HALF, layout=dim_layout), 1)
        write_decode_output(o0, o1, d, d + _HALF, m_i, l_keys, sink, O, MID_O, MID_LSE, b, kvh, split, num_splits,
                            stride_ob, stride_oh, head_layout, GROUP, NPAD, HEAD_DIM, HALVES == 2, DIRECT, HAS_SINKS)

    @gluon.jit
    def _producer(k_desc, v_desc, k_smem, v_smem, ready, empty, bt_row, start, end, n_tiles, kv_col,
                  PAGE: gl.constexpr, HALVES: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
        """The copy warp: every key tile of the split as soon as the consumer frees its slot."""
        for t in range(n_tiles):
            slot = t % STAGES
            # Slot t % STAGES last held tile t - STAGES: wait until it was released.
            mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1, pred=t >= STAGES)
            issue_tile(k_desc, v_desc, k_smem, v_smem, ready.index(slot), bt_row, slot, start + t * BLOCK_N, end,
                       kv_col, PAGE, HALVES, BLOCK_N)

    @gluon.jit(do_not_specialize=["stride_btb", "num_splits"])  # both change from step to step
    def _decode_sm90_kernel(
        Q, k_desc, v_desc, BT, CL, O, MID_O, MID_LSE, scale_log2e,
        stride_qb, stride_qh, stride_btb, stride_ob, stride_oh, num_splits, SINKS,
        GROUP: gl.constexpr, NPAD: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DIRECT: gl.constexpr, WINDOW: gl.constexpr,
        SOFTCAP: gl.constexpr, HAS_SINKS: gl.constexpr, num_warps: gl.constexpr,
    ):
        HALVES: gl.constexpr = HEAD_DIM // _HALF
        ROWS: gl.constexpr = PAGE if PAGE < BLOCK_N else BLOCK_N  # keys per TMA copy
        kvh = gl.program_id(0)  # fastest: a sequence's heads start together, in the batch's order
        b = gl.program_id(1)
        split = gl.program_id(2)
        start, end, lo = split_range(CL, b, split, num_splits, BLOCK_N, ROWS, WINDOW)
        if start < end:
            n_tiles = gl.cdiv(end - start, BLOCK_N)
            dtype: gl.constexpr = k_desc.dtype
            layout16: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
            q_smem = gl.allocate_shared_memory(dtype, [HALVES, NPAD, _HALF], layout16)
            p_smem = gl.allocate_shared_memory(dtype, [2, NPAD, BLOCK_N], layout16)
            k_smem = gl.allocate_shared_memory(dtype, [STAGES * HALVES, BLOCK_N, _HALF], layout16)
            v_smem = gl.allocate_shared_memory(dtype, [STAGES * HALVES, BLOCK_N, _HALF], layout16)
            ready, empty = barrier_ring(STAGES, 1)
            gl.warp_specialize([
                (_consumer, (Q, q_smem, k_smem, v_smem, p_smem, ready, empty, O, MID_O, MID_LSE, SINKS, scale_log2e,
                             b, kvh, split, num_splits, start, lo, end, n_tiles, stride_qb, stride_qh, stride_ob,
                             stride_oh, GROUP, NPAD, HEAD_DIM, HALVES, STAGES, BLOCK_N, DIRECT, WINDOW, SOFTCAP,
                             HAS_SINKS)),
                (_producer, (k_desc, v_desc, k_smem, v_smem, ready, empty, BT + b.to(gl.int64) * stride_btb, start,
                             end, n_tiles, kvh * HEAD_DIM, PAGE, HALVES, STAGES, BLOCK_N)),
            ], [1], [PRODUCER_REGS])
            invalidate_ring(ready, empty, STAGES)
        else:
            write_empty_split(MID_O, MID_LSE, b, kvh, split, num_splits, GROUP, NPAD, HEAD_DIM, num_warps)


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
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``paged_decode_attention`` (same arguments and result) on sm_90 with a 16-bit q over 16-bit or 8-bit
    caches; other inputs go to the Triton kernel. ``window`` (0: none): the query at ``context_lens[b] - 1``
    sees its last ``window`` keys, and only their pages' table entries are read; ``softcap`` (0: none): scores
    s become ``softcap * tanh(s / softcap)``; ``sinks`` ``[Hq]`` (None: none): a logit per head in the softmax's
    denominator, with no value."""
    fmt = check_paged_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables=block_tables,
                                context_lens=context_lens)
    check_window_softcap(window, softcap, sinks, q)
    fallback = lambda: paged_decode_attention(  # noqa: E731
        q, k_cache, v_cache, block_tables, context_lens, scale, out, k_scale=k_scale, v_scale=v_scale,
        num_splits=num_splits, window=window, softcap=softcap, sinks=sinks)
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
        longest = block_tables.shape[1] * page
        if window:  # the keys a split range may cover: the window and the part of its first page before it
            longest = min(longest, window + page)
        num_splits = choose_num_splits(batch, num_kv_heads, longest, q.device,
                                       SPLIT_TARGET_PER_SM if quant else SPLITS_PER_SM)
    mid_o, mid_lse = split_partials(q, out, num_splits)
    direct = num_splits == 1
    common = (block_tables, context_lens, out, mid_o, mid_lse, score_scale(scale, softcap), q.stride(0), q.stride(1),
              block_tables.stride(0), out.stride(0), out.stride(1), num_splits)
    params = dict(GROUP=group, NPAD=8 if group <= 8 else 16, HEAD_DIM=head_dim, PAGE=page, BLOCK_N=BLOCK_N,
                  DIRECT=direct, WINDOW=int(window), SOFTCAP=float(softcap), SINKS=sinks, HAS_SINKS=sinks is not None,
                  num_warps=4)
    if quant:
        kernel = sm90_8bit._decode_sm90_8bit_kernel
        args = (q, *sm90_8bit.descriptors(k_cache, v_cache, k_scale, v_scale), *common)
        params.update(NUM_KV_HEADS=num_kv_heads, STAGES=sm90_8bit.STAGES, CONVERT_Q=q.dtype == torch.bfloat16,
                      maxnreg=sm90_8bit.MAX_REGS)
    else:
        kernel = _decode_sm90_kernel
        layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        shape, strides, box = [num_blocks * page, num_kv_heads * head_dim], [num_kv_heads * head_dim, 1], \
            [min(page, BLOCK_N), HALF]
        args = (q, TensorDescriptor(k_cache, shape, strides, box, layout),
                TensorDescriptor(v_cache, shape, strides, box, layout), *common)
        sole = batch * num_kv_heads * num_splits <= num_sms(q.device)
        params.update(STAGES=SOLE_STAGES if sole else STAGES, maxnreg=MAX_REGS)
    grid = (num_kv_heads, batch, num_splits)
    if not _guard.launch(build_kind(quant, window, softcap, sinks is not None), lambda: kernel[grid](*args, **params)):
        return fallback()
    if not direct:
        merge_partials(mid_o, mid_lse, out)
    return out
