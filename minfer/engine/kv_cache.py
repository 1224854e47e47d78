"""The paged KV cache's layout: bytes per block, and allocating the per-layer cache tensors.

Each attention layer owns a K and a V tensor of shape ``[num_blocks, block_size, kv_heads, head_dim]``;
a token at position p of a sequence lives in slot ``block_table[p // block_size] * block_size +
p % block_size`` of both.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minfer.config import ModelConfig


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> "KVCacheSpec":
        return cls(config.num_hidden_layers, block_size, config.num_key_value_heads, config.head_dim, dtype)

    @property
    def block_bytes(self) -> int:
        """K and V of one block across all layers."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize


def allocate_kv_cache(layers: list, spec: KVCacheSpec, num_blocks: int, device: torch.device,
                      zero: bool = True) -> None:
    """Give every attention layer its K/V cache tensors. Zeroed by default: the torch decode path
    multiplies masked-out (never written) slots by zero weights, and garbage there could be NaN."""
    make = torch.zeros if zero else torch.empty
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    for attn in layers:
        attn.k_cache = make(shape, dtype=spec.dtype, device=device)
        attn.v_cache = make(shape, dtype=spec.dtype, device=device)


def release_kv_cache(layers: list) -> None:
    for attn in layers:
        attn.k_cache = attn.v_cache = torch.empty(0)
