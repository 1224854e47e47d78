"""Attention over the paged KV cache: store this step's K/V, then attend, per backend.

Attention is the only layer that knows about sequences. A step's tokens are laid out as
``num_decodes`` single-token decodes first, then the prompt chunks; the metadata describes both
halves with the same arrays (vLLM's names).

An 8-bit cache (``kv_cache_dtype`` int8 / fp8) comes with per-token-per-head ``k_scale``/``v_scale``;
both backends quantize in the store and dequantize inside attention (the torch path after its
gather of the context, the Triton kernels in registers).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from minfer.model.kv_quant import dequantize_ref, format_of, gather_scales, quantize_ref


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step inputs of attention, all on the model's device.

    ``context_lens[s]`` counts sequence s's tokens in the cache after this step's store (its new
    tokens included). The host ints (``num_decodes``, ``max_prefill_query_len``) size grids and
    padding without a device sync. The prompt chunks' rows (after the decodes) have their own
    tensors, not slices of the whole step's: Triton specialises on 16-byte pointer alignment, and a
    slice at an odd offset compiled a new kernel variant in the middle of a run. They are None
    when the step has no chunk (CUDA-graph decodes).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    num_decodes: int
    block_size: int
    prefill_query_start_loc: torch.Tensor | None = None  # chunk row offsets from 0: [num_chunks + 1] int32
    prefill_block_tables: torch.Tensor | None = None  # block_tables[num_decodes:]
    prefill_context_lens: torch.Tensor | None = None  # context_lens[num_decodes:]
    max_prefill_query_len: int = 0
    context_lens_host: list[int] = field(default_factory=list)
    query_lens_host: list[int] = field(default_factory=list)
    _decode_slots: torch.Tensor | None = None  # torch backend: cache slots of the decodes' context


@dataclass(slots=True)
class RopeInputs:
    """What the fused store kernel needs to finish q and k: positions, the rotary table and, for Qwen3,
    the per-head norms (one launch instead of up to four small ones per layer)."""

    positions: torch.Tensor  # [T] int64
    cos_sin_cache: torch.Tensor  # [max_position, D] float32
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6


class Attention(nn.Module):
    """Stores K/V into this layer's cache, then computes attention for decodes and prompt chunks."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: str = "torch") -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.backend = backend
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale: torch.Tensor | None = None  # [num_blocks, Hkv, block_size] for 8-bit caches
        self.v_scale: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                rope: RopeInputs | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] → [T, Hq, D]. With ``rope`` (Triton backend only) q and k
        arrive before their norms and rotary, which the store kernel applies on the way."""
        if self.backend == "triton":
            return self._forward_triton(q, k, v, meta, rope)
        if rope is not None:
            raise ValueError("the torch attention path takes q and k already rotated")
        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, **scales)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = torch_decode_attention(q[:nd], self.k_cache, self.v_cache, meta, self.scale, **scales)
        if nd < q.shape[0]:
            out[nd:] = torch_prefill_attention(q, self.k_cache, self.v_cache, meta, self.scale, **scales)
        return out

    def _forward_triton(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                        rope: RopeInputs | None) -> torch.Tensor:
        from minfer.kernels import paged_decode_attention, paged_prefill_attention
        from minfer.kernels import store_kv as store_kv_triton
        from minfer.kernels.rope_store import rope_store_kv

        scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        if rope is None:
            store_kv_triton(k, v, self.k_cache, self.v_cache, meta.slot_mapping, **scales)
        else:
            rope_store_kv(q, k, v, rope.positions, rope.cos_sin_cache, self.k_cache, self.v_cache,
                          meta.slot_mapping, q_norm_weight=rope.q_norm_weight, k_norm_weight=rope.k_norm_weight,
                          eps=rope.eps, **scales)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            paged_decode_attention(q[:nd], self.k_cache, self.v_cache, meta.block_tables[:nd],
                                   meta.context_lens[:nd], self.scale, out=out[:nd], **scales)
        if nd < q.shape[0]:
            paged_prefill_attention(q[nd:], self.k_cache, self.v_cache, meta.prefill_block_tables,
                                    meta.prefill_query_start_loc, meta.prefill_context_lens,
                                    meta.max_prefill_query_len, self.scale, out=out[nd:], **scales)
        return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Write each token's K/V into its cache slot; 8-bit caches get codes, and scales beside them."""
    fmt = format_of(k_cache.dtype)
    page = k_cache.shape[1]
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = cache.view(-1, *cache.shape[2:])
        if fmt is not None:
            x, row_scales = quantize_ref(x, fmt, scales.dtype)
            scales[slot_mapping // page, :, slot_mapping % page] = row_scales
            rows, x = rows.view(torch.uint8), x.view(torch.uint8)  # as bytes: float8 lacks some index kernels
        rows[slot_mapping] = x


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
