"""The paged KV cache's layout: bytes per block, and allocating the per-layer cache tensors.

Each attention layer owns a K and a V tensor of shape ``[num_blocks, block_size, kv_heads, head_dim]``;
a token at position p of a sequence lives in slot ``block_table[p // block_size] * block_size +
p % block_size`` of both.

With an 8-bit ``kv_cache_dtype`` (int8, fp8_e4m3, fp8_e5m2) those tensors hold codes, and each
layer also owns ``k_scale``/``v_scale`` ``[num_blocks, kv_heads, block_size]``: one scale per
token per KV head (see ``minfer/kernels/quant/kv_quant.py``). Scales belong to their block like the codes,
so the block manager, prefix caching and preemption handle quantized blocks unchanged.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from minfer.config import ModelConfig
from minfer.kernels.quant.kv_quant import KV_QUANT_FORMATS, KV_SCALE_DTYPE


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # what the K/V tensors hold: the model dtype, or an 8-bit code dtype
    scale_dtype: torch.dtype | None = None  # per-token-per-head scales of an 8-bit cache; None when unscaled
    kv_cache_dtype: str = "auto"

    @classmethod
    def for_layers(cls, layers: list, block_size: int, dtype: torch.dtype,
                   kv_cache_dtype: str = "auto") -> "KVCacheSpec":
        """The cache of a built model's attention layers (``model.attention_layers()``: their count, and
        the KV heads and head size each holds on this rank): what the engine allocates."""
        first = layers[0]
        return cls._make(len(layers), block_size, first.num_kv_heads, first.head_dim, dtype, kv_cache_dtype)

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, dtype: torch.dtype,
                  kv_cache_dtype: str = "auto", num_kv_heads: int | None = None) -> "KVCacheSpec":
        """The cache of a model config before any model is built (size estimates: benchmarks, tests).
        ``dtype`` is the model's compute dtype, stored as is when ``kv_cache_dtype`` is 'auto';
        ``num_kv_heads``: the heads this rank holds under tensor parallelism (default: all)."""
        heads = config.num_key_value_heads if num_kv_heads is None else num_kv_heads
        return cls._make(config.num_hidden_layers, block_size, heads, config.head_dim, dtype, kv_cache_dtype)

    @classmethod
    def _make(cls, layers: int, block_size: int, heads: int, dim: int, dtype: torch.dtype,
              kv_cache_dtype: str) -> "KVCacheSpec":
        if kv_cache_dtype == "auto":
            return cls(layers, block_size, heads, dim, dtype)
        fmt = KV_QUANT_FORMATS.get(kv_cache_dtype)
        if fmt is None:
            raise ValueError(f"kv_cache_dtype must be one of {['auto', *KV_QUANT_FORMATS]}, got {kv_cache_dtype!r}")
        return cls(layers, block_size, heads, dim, fmt.dtype, KV_SCALE_DTYPE, kv_cache_dtype)

    @property
    def quantized(self) -> bool:
        return self.scale_dtype is not None

    @property
    def format_name(self) -> str:
        """'int8', 'fp8_e4m3', 'fp8_e5m2', or the model dtype's name ('bfloat16', ...) for 'auto'."""
        return self.kv_cache_dtype if self.quantized else str(self.dtype).removeprefix("torch.")

    @property
    def token_head_bytes(self) -> int:
        """One token's K (or V) row of one KV head, with its scale."""
        scale = self.scale_dtype.itemsize if self.scale_dtype is not None else 0
        return self.head_dim * self.dtype.itemsize + scale

    @property
    def block_bytes(self) -> int:
        """K and V of one block across all layers, scales included."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.token_head_bytes


def host_available_bytes() -> int:
    """Memory the host can still give (``MemAvailable``: free plus reclaimable caches)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages the OS maps only when first written: an anonymous mapping
    reads as zeros, so a cache sized for the longest run costs resident memory only as it fills
    (``torch.zeros`` writes, and so commits, every page at once)."""
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


def allocate_kv_cache(layers: list, spec: KVCacheSpec, num_blocks: int, device: torch.device,
                      zero: bool = True) -> None:
    """Give every attention layer its K/V cache tensors (and scales, for 8-bit caches). Zeroed by
    default: the torch decode path multiplies masked-out (never written) slots by zero weights, and
    garbage there could be NaN. On the CPU the zeros are lazily mapped pages (``lazy_zeros``)."""
    if not zero:
        make = torch.empty
    elif device.type == "cpu":
        make = lambda shape, dtype, device: lazy_zeros(shape, dtype)  # noqa: E731
    else:
        make = torch.zeros
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    scale_shape = (num_blocks, spec.num_kv_heads, spec.block_size)
    for attn in layers:
        attn.k_cache = make(shape, dtype=spec.dtype, device=device)
        attn.v_cache = make(shape, dtype=spec.dtype, device=device)
        if spec.quantized:
            attn.k_scale = make(scale_shape, dtype=spec.scale_dtype, device=device)
            attn.v_scale = make(scale_shape, dtype=spec.scale_dtype, device=device)
        else:
            attn.k_scale = attn.v_scale = None


def release_kv_cache(layers: list) -> None:
    for attn in layers:
        attn.k_cache = attn.v_cache = torch.empty(0)
        attn.k_scale = attn.v_scale = None
