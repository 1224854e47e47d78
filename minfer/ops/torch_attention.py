"""Attention in plain torch with HF's rounding: rotary, and paged attention over decodes and chunks.

The engine's CPU path and the reference the Triton path is held to on whole models. An 8-bit cache
is dequantized right after the gather of the context (``minfer/kernels/quant/kv_quant.py``), where the
Triton kernels dequantize in registers.

A layer's ``window`` (sliding-window attention: a query at position p sees keys in (p - window, p]),
``softcap`` (Gemma 2: scores s become softcap·tanh(s / softcap)) and ``sinks`` (gpt-oss: each head's learned
logit joins the softmax as one more column, which the product with V drops) apply as HF applies them; the
softmax stays in float32 with a sink too (HF's gpt-oss takes it in the model dtype). Only the blocks a window
can reach are gathered: a hybrid KV cache may already have freed the others, and their block-table entries are
then stale.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minfer.kernels.quant.kv_quant import dequantize_ref, gather_scales
from minfer.ops.metadata import AttentionMetadata


def rotate_hf(positions: torch.Tensor, cos_sin_cache: torch.Tensor, q: torch.Tensor,
              k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D] rotated "rotate half" style with HF's rounding (the table cast to
    the model dtype, products in it); the Triton store kernel rotates in float32, rounding once. A table
    narrower than the head (``[max_pos, R]``: Qwen3.5's partial rotary) rotates the first R dims, pairing within
    them, and passes the rest, as HF's ``apply_rotary_pos_emb`` does with a short cos."""
    width = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        if width == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        rot = x[..., :width]
        return torch.cat([rot * cos + _rotate_half(rot) * sin, x[..., width:]], dim=-1)

    return rotate(q), rotate(k)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _gather_kv(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """Cache rows at ``slots`` ``[...]`` → ``[..., Hkv, D]`` in ``dtype``, dequantized if 8-bit."""
    rows = cache.view(-1, *cache.shape[2:])[slots]
    return rows if scales is None else dequantize_ref(rows, gather_scales(scales, slots), dtype)


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return scores if not softcap else torch.tanh(scores / softcap) * softcap


def _softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Float32 ``scores`` → probabilities over the last dim; with ``sinks`` (shaped to broadcast against
    ``scores[..., :1]``) the softmax of ``[scores | sink]`` (HF's ``cat`` of the sink column), its last column
    dropped."""
    if sinks is None:
        return scores.softmax(dim=-1)
    column = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]


def _decode_slots(meta: AttentionMetadata, table: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decodes' cache slots ``[B, L]`` and key positions ``[B, L]`` (-1: padding): each row's whole
    context, or its last ``window`` positions. Shared by the layers of one KV group and window."""
    key = (table.data_ptr(), window)
    if key not in meta._decode_slots:
        nd, bs = meta.num_decodes, meta.block_size
        lens = torch.tensor(meta.context_lens_host[:nd], device=table.device)
        span = max(meta.context_lens_host[:nd]) if not window else min(window, max(meta.context_lens_host[:nd]))
        first = (lens - span).clamp(min=0) if window else torch.zeros_like(lens)
        pos = first[:, None] + torch.arange(span, device=table.device)[None, :]
        pos = torch.where(pos < lens[:, None], pos, -1)
        safe = pos.clamp(min=0)
        slots = table[:nd].long().gather(1, safe // bs) * bs + safe % bs
        meta._decode_slots[key] = (torch.where(pos >= 0, slots, 0), pos)
    return meta._decode_slots[key]


def torch_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None, block_tables: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """One query per sequence against its context (its last ``window`` tokens with a window), padded to
    the longest in the batch; ``block_tables``: the layer's KV group's (default: the first group's).

    Heads of one KV group share the gathered K/V (no repeat across heads); matmuls in the model
    dtype and softmax in float32, as HF's eager attention does.
    """
    nd = meta.num_decodes
    slots, pos = _decode_slots(meta, meta.block_tables[0] if block_tables is None else block_tables, window)
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k = _gather_kv(k_cache, k_scale, slots, q.dtype)  # [B, L, Hkv, D]
    v = _gather_kv(v_cache, v_scale, slots, q.dtype)
    qg = q.view(nd, hkv, -1, d)  # [B, Hkv, G, D]
    scores = _capped(torch.einsum("bkgd,blkd->bkgl", qg, k).float() * scale, softcap)
    valid = pos >= 0
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = _softmax(scores, None if sinks is None else sinks.view(hkv, -1, 1)).to(q.dtype)
    return torch.einsum("bkgl,blkd->bkgd", probs, v).reshape(nd, -1, d)


def torch_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None, block_tables: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """Each prompt chunk attends causally to its own tokens and its sequence's cached context (within
    ``window`` of each query when set). ``q`` holds the whole step's rows (decodes first). SDPA has neither
    a cap nor a sink: with either, the eager softmax."""
    bs = meta.block_size
    tables = meta.block_tables[0] if block_tables is None else block_tables
    outs = []
    start = meta.num_decodes  # decodes come first, one row each
    for s in range(meta.num_decodes, len(meta.context_lens_host)):
        ctx, qlen = meta.context_lens_host[s], meta.query_lens_host[s]
        first = max(0, ctx - qlen - window + 1) if window else 0  # the first key any of the chunk's queries sees
        pos = torch.arange(first, ctx, device=q.device)
        slots = tables[s, pos // bs].long() * bs + pos % bs
        k = _gather_kv(k_cache, k_scale, slots, q.dtype).transpose(0, 1)  # [Hkv, L, D]
        v = _gather_kv(v_cache, v_scale, slots, q.dtype).transpose(0, 1)
        qs = q[start:start + qlen].transpose(0, 1)  # [Hq, Q, D]
        q_pos = (ctx - qlen + torch.arange(qlen, device=q.device))[:, None]
        visible = pos[None, :] <= q_pos
        if window:
            visible &= pos[None, :] > q_pos - window
        if softcap or sinks is not None:
            o = _eager_attention(qs, k, v, visible, scale, softcap, sinks)
        else:
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=visible, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))
        start += qlen
    return torch.cat(outs)


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float,
                     softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """Eager attention with capped scores and/or sinks: q [Hq, Q, D], k/v [Hkv, L, D] → [Hq, Q, D]."""
    hq, hkv = q.shape[0], k.shape[0]
    qg = q.view(hkv, hq // hkv, *q.shape[1:])  # [Hkv, G, Q, D]
    scores = _capped(torch.einsum("kgqd,kld->kgql", qg, k).float() * scale, softcap)
    column = None if sinks is None else sinks.view(hkv, hq // hkv, 1, 1)
    probs = _softmax(scores.masked_fill(~visible, float("-inf")), column).to(q.dtype)
    return torch.einsum("kgql,kld->kgqd", probs, v).reshape(q.shape)
