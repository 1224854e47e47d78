"""Torch references of the paged attention kernels (the tests' oracle), torch only.

Both gather the context through the block table, dequantize 8-bit codes after the gather, and run a masked
softmax in float32 (float64 for a float64 q). The optional ``window`` (sliding-window attention: a query at
position p sees keys k with ``p - window < k <= p``), ``softcap`` (Gemma 2's logit soft-capping,
``softcap * tanh(s / softcap)`` on the scaled score before masking) and ``sinks`` (gpt-oss: a logit per query
head ``[Hq]`` joined to each row's scores as one more column, uncapped, that the softmax counts and the product
with V drops) follow HF transformers' definitions.
"""

from __future__ import annotations

import torch

from ..quant.kv_quant import dequantize_ref, gather_scales
from ..quant.quant import check_cache_scales


def window_start(pos: torch.Tensor | int, window: int) -> torch.Tensor | int:
    """First key position a query at ``pos`` sees (0 without a window)."""
    if isinstance(pos, torch.Tensor):
        return (pos - window + 1).clamp_min(0) if window else torch.zeros_like(pos)
    return max(0, pos - window + 1) if window else 0


def _cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return softcap * torch.tanh(scores / softcap) if softcap else scores


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """``softmax(scores, -1)``, or with ``sinks`` (broadcast against ``scores[..., :1]``) the softmax of
    ``[scores | sink]`` without its last column: the probabilities of the keys, summing to less than one."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


def paged_decode_attention_ref(
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
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of ``q`` ``[B, Hq, D]`` (the token at ``context_lens[b] - 1``) over a padded gather.

    The gather width is ``block_tables.shape[1] * block_size``; positions past each context or before its
    window are masked, and their block ids (arbitrary, stale or -1) are replaced by 0 before the gather so
    nothing out of bounds is read.
    """
    batch, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    width = block_tables.shape[1] * page
    pos = torch.arange(width, device=q.device)
    ctx = context_lens[:, None].long()
    valid = (pos[None, :] < ctx) & (pos[None, :] >= window_start(ctx - 1, window))  # [B, W]
    blocks = block_tables.long().gather(1, (pos // page).expand(batch, -1))
    blocks = blocks.masked_fill(~valid, 0).clamp_(0, k_cache.shape[0] - 1)
    slots = blocks * page + pos % page  # [B, W]
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    k = k_cache.view(-1, num_kv_heads, head_dim)[slots]  # [B, W, Hkv, D]
    v = v_cache.view(-1, num_kv_heads, head_dim)[slots]
    if check_cache_scales(k_cache, v_cache, k_scale, v_scale) is not None:
        k = dequantize_ref(k, gather_scales(k_scale, slots), compute)
        v = dequantize_ref(v, gather_scales(v_scale, slots), compute)
    k, v = k.to(compute), v.to(compute)
    qg = q.to(compute).view(batch, num_kv_heads, group, head_dim)
    scores = _cap(torch.einsum("bhgd,bwhd->bhgw", qg, k) * scale, softcap)
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(num_kv_heads, group, 1))
    res = torch.einsum("bhgw,bwhd->bhgd", probs, v).reshape(batch, num_heads, head_dim)
    if out is None:
        return res.to(q.dtype)
    out.copy_(res)
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
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a varlen batch of chunks ``q`` ``[T, Hq, D]``: per sequence, gather the keys from
    its first query's window start to its context end (so block ids before it are never read) and run a
    masked softmax. A Python loop over sequences (not tokens); it reads the two index tensors on the host once.
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
        q_pos = ctx - (q1 - q0) + torch.arange(q1 - q0, device=q.device)
        pos = torch.arange(window_start(ctx - (q1 - q0), window), ctx, device=q.device)
        slots = block_tables[s].long()[pos // page] * page + pos % page
        k, v = k_flat[slots], v_flat[slots]  # [keys, Hkv, D]
        if quant:
            k = dequantize_ref(k, gather_scales(k_scale, slots), compute)
            v = dequantize_ref(v, gather_scales(v_scale, slots), compute)
        k = k.to(compute).repeat_interleave(group, dim=1)  # [keys, Hq, D]
        v = v.to(compute).repeat_interleave(group, dim=1)
        scores = _cap(torch.einsum("qhd,khd->hqk", q[q0:q1].to(compute), k) * scale, softcap)
        hidden = (pos[None, :] > q_pos[:, None]) | (pos[None, :] < window_start(q_pos, window)[:, None])
        scores = scores.masked_fill(hidden[None], float("-inf"))
        probs = softmax_with_sinks(scores, None if sinks is None else sinks.view(num_heads, 1, 1))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, v).to(out.dtype)
    return out
