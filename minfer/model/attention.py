"""Attention over the paged KV cache: store this step's K/V, then attend, per backend.

Attention is the only layer that knows about sequences. A step's tokens are laid out as
``num_decodes`` single-token decodes first, then the prompt chunks; the metadata describes both
halves with the same arrays (vLLM's names).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step inputs of attention, all on the model's device.

    ``context_lens[s]`` counts sequence s's tokens in the cache after this step's store (its new
    tokens included); ``query_start_loc`` holds the flat row offsets of each sequence's queries.
    The host ints (``num_decodes``, ``max_*``) size grids and padding without a device sync.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    num_decodes: int
    max_query_len: int
    max_context_len: int
    block_size: int
    prefill_query_start_loc: torch.Tensor | None = None  # query_start_loc[num_decodes:] - num_decodes
    max_prefill_query_len: int = 0
    context_lens_host: list[int] = field(default_factory=list)
    query_lens_host: list[int] = field(default_factory=list)
    _decode_slots: torch.Tensor | None = None  # torch backend: cache slots of the decodes' context

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes


class Attention(nn.Module):
    """Stores K/V into this layer's cache, then computes attention for decodes and prompt chunks."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: str = "torch") -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.backend = backend
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] → [T, Hq, D]."""
        if self.backend == "triton":
            return self._forward_triton(q, k, v, meta)
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = torch_decode_attention(q[:nd], self.k_cache, self.v_cache, meta, self.scale)
        if nd < q.shape[0]:
            out[nd:] = torch_prefill_attention(q, self.k_cache, self.v_cache, meta, self.scale)
        return out

    def _forward_triton(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        from minfer.kernels import paged_decode_attention, paged_prefill_attention
        from minfer.kernels import store_kv as store_kv_triton

        store_kv_triton(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            paged_decode_attention(q[:nd], self.k_cache, self.v_cache, meta.block_tables[:nd],
                                   meta.context_lens[:nd], self.scale, out=out[:nd])
        if nd < q.shape[0]:
            paged_prefill_attention(q[nd:], self.k_cache, self.v_cache, meta.block_tables[nd:],
                                    meta.prefill_query_start_loc, meta.context_lens[nd:],
                                    meta.max_prefill_query_len, self.scale, out=out[nd:])
        return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each token's K/V into its cache slot."""
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v


def torch_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float) -> torch.Tensor:
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
    k = k_cache.view(-1, hkv, d)[slots]  # [B, L, Hkv, D]
    v = v_cache.view(-1, hkv, d)[slots]
    qg = q.view(nd, hkv, -1, d)  # [B, Hkv, G, D]
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k).float() * scale
    valid = torch.arange(slots.shape[1], device=q.device)[None, :] < meta.context_lens[:nd, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.einsum("bkgl,blkd->bkgd", probs, v).reshape(nd, -1, d)


def torch_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Each prompt chunk attends causally to its own tokens and its sequence's cached context."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    bs = meta.block_size
    outs = []
    start = meta.num_decodes  # decodes come first, one row each
    for s in range(meta.num_decodes, len(meta.context_lens_host)):
        ctx, qlen = meta.context_lens_host[s], meta.query_lens_host[s]
        pos = torch.arange(ctx, device=q.device)
        slots = meta.block_tables[s, pos // bs].long() * bs + pos % bs
        k = k_cache.view(-1, hkv, d)[slots].transpose(0, 1)  # [Hkv, L, D]
        v = v_cache.view(-1, hkv, d)[slots].transpose(0, 1)
        qs = q[start:start + qlen].transpose(0, 1)  # [Hq, Q, D]
        causal = pos[None, :] <= (ctx - qlen + torch.arange(qlen, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=causal, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))
        start += qlen
    return torch.cat(outs)
