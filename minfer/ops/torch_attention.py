"""Attention in plain torch with HF's rounding: rotary, and paged attention over decodes and chunks.

The engine's CPU path and the reference the Triton path is held to on whole models. An 8-bit cache
is dequantized right after the gather of the context (``minfer/kernels/quant/kv_quant.py``), where the
Triton kernels dequantize in registers.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minfer.kernels.quant.kv_quant import dequantize_ref, gather_scales
from minfer.ops.metadata import AttentionMetadata


def rotate_hf(positions: torch.Tensor, cos_sin_cache: torch.Tensor, q: torch.Tensor,
              k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D] rotated "rotate half" style with HF's rounding (the table cast to
    the model dtype, products in it); the Triton store kernel rotates in float32, rounding once."""
    cos, sin = cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def _gather_kv(cache: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """Cache rows at ``slots`` ``[...]`` → ``[..., Hkv, D]`` in ``dtype``, dequantized if 8-bit."""
    rows = cache.view(-1, *cache.shape[2:])[slots]
    return rows if scales is None else dequantize_ref(rows, gather_scales(scales, slots), dtype)


def torch_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence against its whole context, padded to the longest context in the batch.

    Heads of one KV group share the gathered K/V (no repeat across heads); matmuls in the model
    dtype and softmax in float32, as HF's eager attention does.
    """
    nd = meta.num_decodes
    if meta._decode_slots is None:
        max_ctx = max(meta.context_lens_host[:nd])
        pos = torch.arange(max_ctx, device=q.device)
        blocks = meta.block_tables[:nd, pos // meta.block_size].long()
        meta._decode_slots = blocks * meta.block_size + pos % meta.block_size
    slots = meta._decode_slots
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k = _gather_kv(k_cache, k_scale, slots, q.dtype)  # [B, L, Hkv, D]
    v = _gather_kv(v_cache, v_scale, slots, q.dtype)
    qg = q.view(nd, hkv, -1, d)  # [B, Hkv, G, D]
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k).float() * scale
    valid = torch.arange(slots.shape[1], device=q.device)[None, :] < meta.context_lens[:nd, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.einsum("bkgl,blkd->bkgd", probs, v).reshape(nd, -1, d)


def torch_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Each prompt chunk attends causally to its own tokens and its sequence's cached context."""
    bs = meta.block_size
    outs = []
    start = meta.num_decodes  # decodes come first, one row each
    for s in range(meta.num_decodes, len(meta.context_lens_host)):
        ctx, qlen = meta.context_lens_host[s], meta.query_lens_host[s]
        pos = torch.arange(ctx, device=q.device)
        slots = meta.block_tables[s, pos // bs].long() * bs + pos % bs
        k = _gather_kv(k_cache, k_scale, slots, q.dtype).transpose(0, 1)  # [Hkv, L, D]
        v = _gather_kv(v_cache, v_scale, slots, q.dtype).transpose(0, 1)
        qs = q[start:start + qlen].transpose(0, 1)  # [Hq, Q, D]
        causal = pos[None, :] <= (ctx - qlen + torch.arange(qlen, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=causal, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))
        start += qlen
    return torch.cat(outs)
