"""Attention over the paged KV cache: this layer's cache, and the two ops that use it.

Attention is the only layer that knows about sequences (``AttentionMetadata``). An 8-bit cache
(an 8-bit ``kv_cache_dtype``) comes with per-token-per-head ``k_scale``/``v_scale``; the ops
quantize in the store and dequantize inside attention.

How the layer attends is its own: ``scale`` (head_dim^-0.5 unless the family says otherwise), ``window``
(sliding-window attention over the last ``window`` positions; 0: the whole context), ``softcap``
(Gemma 2's tanh cap on the scores; 0: none) and ``sinks`` (gpt-oss: a learned logit per query head that joins
the softmax's denominator and carries no value). ``kv_group`` is set with the cache: which of the step's
block tables and slot mappings address it (``engine/kv_cache.py``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minfer.distributed import SINGLE, TensorParallel
from minfer.ops import AttentionMetadata, Ops, RopeInputs


class Attention(nn.Module):
    """Finishes q and k (norms, rotary), stores K/V into this layer's cache, then attends for the
    decodes and the prompt chunks. The engine allocates the cache tensors (``engine/kv_cache.py``).

    ``num_heads`` / ``num_kv_heads`` are this rank's. With ``sinks`` the layer owns ``self.sinks`` ``[num_heads]``
    in ``dtype`` (the model dtype, as HF holds it), filled from the checkpoint's ``self_attn.sinks`` ``[total heads]``
    by ``load_shard``: under tensor parallelism (``tp``) the query heads are split evenly, so this rank's slice
    starts at head ``tp.rank * num_heads``."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, ops: Ops, scale: float | None = None,
                 window: int = 0, softcap: float = 0.0, sinks: bool = False, dtype: torch.dtype | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.window, self.softcap = window, softcap
        if sinks and dtype is None:
            raise ValueError("an attention layer with sinks needs the model dtype (dtype=) to hold them in")
        self.sinks = nn.Parameter(torch.empty(num_heads, dtype=dtype), requires_grad=False) if sinks else None
        self.first_head = tp.rank * num_heads
        self.kv_group = 0
        self.ops = ops
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale: torch.Tensor | None = None  # [num_blocks, Hkv, block_size] for 8-bit caches
        self.v_scale: torch.Tensor | None = None

    def load_shard(self, name: str, source: Any, shard: Any) -> None:
        """This rank's heads of the checkpoint's sinks ``[total heads]`` (``source``: a safetensors slice, read
        lazily, or a tensor), rounded to the model dtype as HF loads them."""
        if name != "sinks" or self.sinks is None:
            raise ValueError(f"the attention layer has no checkpoint tensor {name!r}")
        tensor = source[self.first_head:self.first_head + self.num_heads]
        if tuple(tensor.shape) != tuple(self.sinks.shape):
            raise ValueError(f"checkpoint sinks hold {tuple(tensor.shape)} heads from head {self.first_head}, "
                             f"expected {tuple(self.sinks.shape)}")
        self.sinks.data.copy_(tensor)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeInputs,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D], before their norms and rotary → [T, Hq, D]."""
        q = self.ops.rope_store_kv(q, k, v, rope, self, meta.slot_mapping[self.kv_group])
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention alone, for q already rotated and the step's K/V already in the cache (the one-token forward's
        qkv launch does both: ``ops/one_token.py``)."""
        return self.ops.paged_attention(q, self, meta, self.scale)
