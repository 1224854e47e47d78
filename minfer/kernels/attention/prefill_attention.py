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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._utils import interpreting
from ..quant.kv_quant import dequantize_ref, gather_scales
from ..quant.quant import check_cache_scales, check_paged_attention, codes_to_f16, product_mode, q_to_f16

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
):
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
        if MASKED:
            s = tl.where((offs[None, :] <= q_pos[:, None]) & valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
    else:
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if MASKED:
            s = tl.where((offs[None, :] <= q_pos[:, None]) & valid[None, :], s, float("-inf"))
        # The scale (> 0) is applied inside the exponent's FMA rather than as a separate pass over s:
        # at D=128 the per-score float32 work is as costly as the matmuls, so each pass counts.
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2e)
        p = tl.exp2(s * scale_log2e - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
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
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = BT + s.to(tl.int64) * stride_btb
    kv_base = (h // GROUP).to(tl.int64) * stride_kh
    s_base = (h // GROUP) * PAGE  # scales [num_blocks, NUM_KV_HEADS, PAGE]
    s_stride = NUM_KV_HEADS * PAGE

    # Keys 0..first_pos are visible to every row: whole tiles there need no mask.
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, K, V, KS, VS, bt_row, kv_base, s_base, s_stride, n0, q_pos,
                                     ctx, scale_log2e, stride_kb, stride_kt, dims, PAGE, BLOCK_N, False, DOT_PREC,
                                     UPCAST, QUANT, F16, F16_KIND, ASM)
    # The diagonal: tile 0 of this phase always contains key 0 or a finite running max, so no row is all -inf.
    diag_end = tl.minimum(ctx, first_pos + BLOCK_M)
    for n0 in range(full_end, diag_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, K, V, KS, VS, bt_row, kv_base, s_base, s_stride, n0, q_pos,
                                     ctx, scale_log2e, stride_kb, stride_kt, dims, PAGE, BLOCK_N, True, DOT_PREC,
                                     UPCAST, QUANT, F16, F16_KIND, ASM)

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
) -> torch.Tensor:
    """Causal attention of a varlen batch of chunks ``q`` ``[T, Hq, D]`` over the paged cache.

    Sequence s owns rows ``query_start_loc[s]:query_start_loc[s+1]``; ``context_lens[s]`` counts its
    tokens including the chunk. ``max_query_len`` (host int) sizes the grid. Returns ``out`` ``[T, Hq, D]``.
    8-bit caches (int8 / fp8) need their ``k_scale``/``v_scale`` ``[num_blocks, Hkv, block_size]``.
    """
    fmt = check_paged_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables=block_tables,
                                context_lens=context_lens, query_start_loc=query_start_loc)
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
        F16_KIND=fmt.f16_kind if f16 else -1, ASM=asm, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def paged_prefill_attention_ref(
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
) -> torch.Tensor:
    """Torch reference (the tests' oracle): per sequence, gather its context and run masked softmax in fp32.

    A Python loop over sequences (not tokens); it reads the two index tensors on the host once.
    8-bit caches are dequantized after the gather, in the compute dtype.
    """
    quant = check_cache_scales(k_cache, v_cache, k_scale, v_scale) is not None
    num_heads, head_dim = q.shape[1], q.shape[2]
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    for s, ctx in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        if q1 == q0:
            continue
        pos = torch.arange(ctx, device=q.device)
        slots = block_tables[s].long()[pos // page] * page + pos % page
        k, v = k_flat[slots], v_flat[slots]  # [ctx, Hkv, D]
        if quant:
            k = dequantize_ref(k, gather_scales(k_scale, slots), compute)
            v = dequantize_ref(v, gather_scales(v_scale, slots), compute)
        k = k.to(compute).repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = v.to(compute).repeat_interleave(group, dim=1)
        qs = q[q0:q1].to(compute)
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        q_pos = ctx - (q1 - q0) + torch.arange(q1 - q0, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v).to(out.dtype)
    return out
