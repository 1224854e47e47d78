"""Paged prefill attention: a varlen batch of prompt chunks attending causally to paged K/V.

FlashAttention-style: a program owns ``BLOCK_M`` query rows of one head of one sequence and
streams the sequence's keys in ``BLOCK_N`` tiles straight from the paged cache (the block table
translates each key position into a slot; nothing is gathered into a contiguous copy, and a KV
head is never repeated for its query heads). The chunk's own K/V are already in the cache, so a
chunk that starts mid-sequence (chunked prefill, prefix-cache hit) is the same code path: row i of
sequence s sits at position ``context_lens[s] - q_len + i``.

The key loop is cut in two: tiles every row of the block may see in full (no mask, no bounds
check, the bulk of the work), then the few tiles on the diagonal with the causal mask. Programs
for heads that share a KV head are launched next to each other so their K/V tiles hit in L2, and
the query blocks run from the last (longest) to the first so the long programs start first.

8-bit caches are read as codes and scaled in registers, as in decode (``decode_attention.py``):
K's per-token scale multiplies the score column, V's the probability column. With a 16-bit q the
products run in float16 on codes converted exactly by ``codes_to_f16`` (inline PTX on the GPU).

Sliding windows and logit soft-capping are compile-time constants (``WINDOW``, ``SOFTCAP_LOG2``; 0 = none), as in
decode. With a window, row i sees keys ``(pos_i - window, pos_i]``, and a block's keys start at its first row's
window start, the first key any of its rows sees: table entries before that block are never loaded (a hybrid cache
frees those blocks) and a long context costs O(window) per block. The loop gains a third phase in front: the
window's lower edge, the keys some rows no longer see (at most ``BLOCK_M`` of them), masked per element; the tiles
after it are whole for every row up to the diagonal, as without a window (H200, one 16k prompt, llama-3.1-8b heads:
5.8 ms, 2.6 ms with a 4096 window). The soft cap needs the scaled score, so it gives up folding the scale into the
exponent, and its tanh costs an exp2 and a reciprocal per score on the special-function units the softmax's exp2
already keeps busy (exact, as the Hopper kernel's; benchmarks/RESULTS.md has its cost).

Attention sinks (gpt-oss) are a compile-time variant too (``HAS_SINKS``; ``SINKS`` is None without them): a head's
sink logit is a key with no value that every row sees, so the running max starts at it and its term joins the
denominator at the end (at most 1, the max being at least the sink).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._utils import interpreting
from ..quant.quant import check_paged_attention, codes_to_f16, product_mode, q_to_f16
from .attention_ref import paged_prefill_attention_ref  # noqa: F401 (re-exported for this module's importers)
from .decode_attention import check_window_softcap, soft_cap

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters (tuned on an H200; see benchmarks/RESULTS.md)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, K, V, KS, VS, bt_row, kv_base, s_base, s_stride, n0, q_pos, ctx, scale_log2e,
    stride_kb, stride_kt, dims,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    QUANT: tl.constexpr, F16: tl.constexpr, F16_KIND: tl.constexpr, ASM: tl.constexpr,
    WINDOW_EDGE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP_LOG2: tl.constexpr,
):
    """One key tile into the running softmax. MASKED: causal and context-end mask; WINDOW_EDGE (with MASKED):
    also the window's lower bound, where a row may see nothing yet (its max stays -inf, so the exponent's
    shift is taken as 0 there instead of giving -inf - -inf = NaN)."""
    offs = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        valid = offs < ctx
        page = tl.load(bt_row + offs // PAGE, mask=valid, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + offs // PAGE).to(tl.int64)
    tok = kv_base + page * stride_kb + (offs % PAGE) * stride_kt
    if MASKED:
        k = tl.load(K + tok[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(V + tok[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
    else:
        k = tl.load(K + tok[:, None] + dims[None, :])
        v = tl.load(V + tok[:, None] + dims[None, :])
    if QUANT:
        s_off = s_base + page * s_stride + offs % PAGE
        if MASKED:
            k_scale = tl.load(KS + s_off, mask=valid, other=0.0).to(tl.float32)
            v_scale = tl.load(VS + s_off, mask=valid, other=0.0).to(tl.float32)
        else:
            k_scale = tl.load(KS + s_off).to(tl.float32)
            v_scale = tl.load(VS + s_off).to(tl.float32)
        if F16:  # exact float16 codes; V's conversion stays before the MMA's layout change (quant.py)
            k = codes_to_f16(k, F16_KIND, ASM, True)
            v = codes_to_f16(v, F16_KIND, ASM, False)
        else:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        # Per-key scales differ by column, so they cannot ride in the exponent's FMA: one pass here.
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * (k_scale * scale_log2e)[None, :]
    else:
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if SOFTCAP_LOG2 > 0:
            s = s * scale_log2e
    if SOFTCAP_LOG2 > 0:  # on log2(e) * scale * q.k, so the cap comes scaled by log2(e) too
        s = soft_cap(s, SOFTCAP_LOG2)
    if MASKED:
        seen = (offs[None, :] <= q_pos[:, None]) & valid[None, :]
        if WINDOW_EDGE:
            seen = seen & (offs[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(seen, s, float("-inf"))
    if QUANT or SOFTCAP_LOG2 > 0:  # s is scaled already
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
    else:
        # The scale (> 0) is applied inside the exponent's FMA rather than as a separate pass over s:
        # at D=128 the per-score float32 work is as costly as the matmuls, so each pass counts.
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2e)
    if WINDOW_EDGE:
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        shift = m_new
    if QUANT or SOFTCAP_LOG2 > 0:
        p = tl.exp2(s - shift[:, None])
    else:
        p = tl.exp2(s * scale_log2e - shift[:, None])
    alpha = tl.exp2(m_i - shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if QUANT:
        acc = tl.dot((p * v_scale[None, :]).to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["stride_btb"])  # the block-table width changes from step to step
def _prefill_kernel(
    Q, K, V, KS, VS, BT, QSL, CL, O, scale_log2e,
    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    QUANT: tl.constexpr, F16: tl.constexpr, F16_KIND: tl.constexpr, ASM: tl.constexpr,
    WINDOW: tl.constexpr = 0, SOFTCAP_LOG2: tl.constexpr = 0.0, SINKS=None, HAS_SINKS: tl.constexpr = False,
):
    h = tl.program_id(0)
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)
    s = tl.program_id(2)
    q_start = tl.load(QSL + s)
    q_len = tl.load(QSL + s + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= q_len:
        return
    ctx = tl.load(CL + s)
    first_pos = ctx - q_len + m0  # position of this block's first query row

    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    q_pos = ctx - q_len + rows
    dims = tl.arange(0, HEAD_DIM)
    q_ptr = Q + (q_start + rows).to(tl.int64)[:, None] * stride_qt + h * stride_qh + dims[None, :]
    q = tl.load(q_ptr, mask=row_mask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if F16:
        q = q_to_f16(q)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    if HAS_SINKS:  # the head's sink in the log2 domain, where the running max starts
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m_i = tl.maximum(m_i, sink)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = BT + s.to(tl.int64) * stride_btb
    kv_base = (h // GROUP).to(tl.int64) * stride_kh
    s_base = (h // GROUP) * PAGE  # scales [num_blocks, NUM_KV_HEADS, PAGE]
    s_stride = NUM_KV_HEADS * PAGE

    if WINDOW > 0:
        # The window's lower edge [lo, edge_end): from the first row's window start (no table entry before
        # lo // PAGE is read) to the last row's, in tiles counted from lo. Whole tiles follow, up to first_pos.
        lo = tl.maximum(first_pos - WINDOW + 1, 0)
        edge_end = lo + tl.cdiv(tl.maximum(first_pos + BLOCK_M - WINDOW - lo, 0), BLOCK_N) * BLOCK_N
        for n0 in range(lo, tl.minimum(edge_end, tl.minimum(ctx, first_pos + BLOCK_M)), BLOCK_N):
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, K, V, KS, VS, bt_row, kv_base, s_base, s_stride, n0,
                                         q_pos, ctx, scale_log2e, stride_kb, stride_kt, dims, PAGE, BLOCK_N, True,
                                         DOT_PREC, UPCAST, QUANT, F16, F16_KIND, ASM, True, WINDOW, SOFTCAP_LOG2)
        full_end = edge_end + tl.maximum(first_pos + 1 - edge_end, 0) // BLOCK_N * BLOCK_N
    else:
        edge_end = 0
        # Keys 0..first_pos are visible to every row: whole tiles there need no mask.
        full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    for n0 in range(edge_end, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, K, V, KS, VS, bt_row, kv_base, s_base, s_stride, n0, q_pos,
                                     ctx, scale_log2e, stride_kb, stride_kt, dims, PAGE, BLOCK_N, False, DOT_PREC,
                                     UPCAST, QUANT, F16, F16_KIND, ASM, False, WINDOW, SOFTCAP_LOG2)
    diag_end = tl.minimum(ctx, first_pos + BLOCK_M)
    # The diagonal: each row's own key lies at or past the phase's start, or its running max is finite already
    # (no row is all -inf); with a window, no key here is before any row's window start (edge_end is past it).
    for n0 in range(full_end, diag_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, K, V, KS, VS, bt_row, kv_base, s_base, s_stride, n0, q_pos,
                                     ctx, scale_log2e, stride_kb, stride_kt, dims, PAGE, BLOCK_N, True, DOT_PREC,
                                     UPCAST, QUANT, F16, F16_KIND, ASM, False, WINDOW, SOFTCAP_LOG2)

    if HAS_SINKS:  # NaN only for a -inf sink in a row that saw no key, which the window's guard below catches
        l_i += tl.exp2(sink - m_i)
    if WINDOW > 0:  # a padding row past the chunk's end may see no key of its window: 0 / 0, never stored
        l_i = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_i[:, None]
    o_ptr = O + (q_start + rows).to(tl.int64)[:, None] * stride_ot + h * stride_oh + dims[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=row_mask[:, None])


def default_config(device: torch.device, head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """Tiles per device: big tensor-core tiles on the GPU, small ones for the CPU interpreter.

    float32 tiles take twice the shared memory per stage, and head dim 256 twice again, so those
    get smaller tiles to stay inside the 227 KB an H100/H200 block may use.
    """
    if device.type != "cuda" or interpreting():
        return PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return PrefillConfig(block_m=64 if head_dim <= 128 else 32, block_n=32, num_warps=4, num_stages=2)
    if head_dim > 128:
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    return PrefillConfig()


def paged_prefill_attention(
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
    config: PrefillConfig | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a varlen batch of chunks ``q`` ``[T, Hq, D]`` over the paged cache.

    Sequence s owns rows ``query_start_loc[s]:query_start_loc[s+1]``; ``context_lens[s]`` counts its
    tokens including the chunk. ``max_query_len`` (host int) sizes the grid. Returns ``out`` ``[T, Hq, D]``.
    8-bit caches (int8 / fp8) need their ``k_scale``/``v_scale`` ``[num_blocks, Hkv, block_size]``.
    ``window`` > 0: row i sees keys ``(pos_i - window, pos_i]`` (HF's ``sliding_window``); table entries of blocks
    wholly before the first row's window are never read. ``softcap`` > 0: scores become
    ``softcap * tanh(score / softcap)``. ``sinks`` ``[Hq]``: each head's logit joins the softmax's denominator
    (uncapped), with no value.
    """
    fmt = check_paged_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables=block_tables,
                                context_lens=context_lens, query_start_loc=query_start_loc)
    check_window_softcap(window, softcap, sinks, q)
    quant = fmt is not None
    num_tokens, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    num_seqs = query_start_loc.shape[0] - 1
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    cfg = config or default_config(q.device, head_dim, q.dtype)
    k_cache, v_cache, upcast, prec, f16, asm = product_mode(q, k_cache, v_cache, fmt)
    grid = (num_heads, triton.cdiv(max_query_len, cfg.block_m), num_seqs)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache, block_tables,
        query_start_loc, context_lens, out, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE=page, NUM_KV_HEADS=num_kv_heads,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, DOT_PREC=prec, UPCAST=upcast, QUANT=quant, F16=f16,
        F16_KIND=fmt.f16_kind if f16 else -1, ASM=asm, WINDOW=int(window), SOFTCAP_LOG2=float(softcap) * LOG2E,
        SINKS=sinks, HAS_SINKS=sinks is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out

