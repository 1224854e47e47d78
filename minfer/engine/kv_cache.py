"""The paged KV cache's layout: bytes per block, and allocating the per-layer cache tensors.

Each attention layer owns a K and a V tensor of shape ``[num_blocks, block_size, kv_heads, head_dim]``;
a token at position p of a sequence lives in slot ``block_table[p // block_size] * block_size +
p % block_size`` of both.

With an 8-bit ``kv_cache_dtype`` (int8, fp8_e4m3, fp8_e5m2) those tensors hold codes, and each
layer also owns ``k_scale``/``v_scale`` ``[num_blocks, kv_heads, block_size]``: one scale per
token per KV head (see ``minfer/kernels/quant/kv_quant.py``). Scales belong to their block like the codes,
so the block manager, prefix caching and preemption handle quantized blocks unchanged.

KV groups (``engine/kv_groups.py``): layers of different windows get block tables of their own and share
G cache tensors (a block is one page of each); every layer then has the same page shape. Layers whose
shapes differ (Gemma 4's global layers, another head size) keep one tensor each, in one group.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch

from minfer.config import ModelConfig
from minfer.engine.kv_groups import KVGroup, plan_groups
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
    groups: tuple[KVGroup, ...] | None = None  # None: one full-attention group of every layer
    layer_shapes: tuple[tuple[int, int], ...] | None = None  # (KV heads, head size) per layer, when they differ

    @classmethod
    def for_layers(cls, layers: list, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                   max_model_len: int = 0, hybrid: bool = True) -> "KVCacheSpec":
        """The cache of a built model's attention layers (``model.attention_layers()``: their count, the
        KV heads and head size each holds on this rank, their windows): what the engine allocates, for
        sequences of up to ``max_model_len`` tokens. ``hybrid=False`` keeps one block table for every layer
        (vLLM's ``disable_hybrid_kv_cache_manager``)."""
        shapes = tuple((layer.num_kv_heads, layer.head_dim) for layer in layers)
        windows = [layer.window for layer in layers]
        first = layers[0]
        if len(set(shapes)) > 1:
            return cls._make(len(layers), block_size, first.num_kv_heads, first.head_dim, dtype, kv_cache_dtype,
                             layer_shapes=shapes)
        groups = plan_groups(windows, block_size, max_model_len or 1 << 62)
        if not hybrid and len(groups) > 1:
            groups = (KVGroup(0, tuple(range(len(layers)))),)
        return cls._make(len(layers), block_size, first.num_kv_heads, first.head_dim, dtype, kv_cache_dtype,
                         groups=groups)

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, dtype: torch.dtype,
                  kv_cache_dtype: str = "auto", num_kv_heads: int | None = None,
                  max_model_len: int = 0) -> "KVCacheSpec":
        """The cache of a model config before any model is built (size estimates: benchmarks, tests).
        ``dtype`` is the model's compute dtype, stored as is when ``kv_cache_dtype`` is 'auto';
        ``num_kv_heads``: the heads this rank holds under tensor parallelism (default: all). With
        ``max_model_len``, the layers' windows make KV groups as the engine would (``for_layers``)."""
        heads = config.num_key_value_heads if num_kv_heads is None else num_kv_heads
        groups = None
        if max_model_len:
            windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
            groups = plan_groups(windows, block_size, max_model_len)
        return cls._make(config.num_hidden_layers, block_size, heads, config.head_dim, dtype, kv_cache_dtype,
                         groups=groups)

    @classmethod
    def _make(cls, layers: int, block_size: int, heads: int, dim: int, dtype: torch.dtype,
              kv_cache_dtype: str, **layout: object) -> "KVCacheSpec":
        if kv_cache_dtype == "auto":
            return cls(layers, block_size, heads, dim, dtype, **layout)
        fmt = KV_QUANT_FORMATS.get(kv_cache_dtype)
        if fmt is None:
            raise ValueError(f"kv_cache_dtype must be one of {['auto', *KV_QUANT_FORMATS]}, got {kv_cache_dtype!r}")
        return cls(layers, block_size, heads, dim, fmt.dtype, KV_SCALE_DTYPE, kv_cache_dtype, **layout)

    @property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        return self.groups or (KVGroup(0, tuple(range(self.num_layers))),)

    @property
    def windows(self) -> tuple[int, ...]:
        """Each KV group's window (0: full attention): what the block manager frees by."""
        return tuple(g.window for g in self.kv_groups)

    @property
    def pages_per_block(self) -> int:
        """Cache tensors a block spans: the (padded) group size."""
        return max(len(g.layers) for g in self.kv_groups)

    @property
    def quantized(self) -> bool:
        return self.scale_dtype is not None

    @property
    def format_name(self) -> str:
        """'int8', 'fp8_e4m3', 'fp8_e5m2', or the model dtype's name ('bfloat16', ...) for 'auto'."""
        return self.kv_cache_dtype if self.quantized else str(self.dtype).removeprefix("torch.")

    def _row_bytes(self, heads: int, dim: int) -> int:
        """One token's K (or V) rows of ``heads`` KV heads of size ``dim``, with their scales."""
        scale = self.scale_dtype.itemsize if self.scale_dtype is not None else 0
        return heads * (dim * self.dtype.itemsize + scale)

    @property
    def token_head_bytes(self) -> int:
        """One token's K (or V) row of one KV head, with its scale."""
        return self._row_bytes(1, self.head_dim)

    @property
    def token_bytes(self) -> int:
        """K and V of one token across every layer, scales included (what a full-length cache holds per token)."""
        if self.layer_shapes is not None:
            return 2 * sum(self._row_bytes(h, d) for h, d in self.layer_shapes)
        return 2 * self.num_layers * self._row_bytes(self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """K and V of one block of the pool, scales included: a page in every layer's tensor (or in each of
        the group size's shared tensors)."""
        if self.layer_shapes is not None:
            return 2 * self.block_size * sum(self._row_bytes(h, d) for h, d in self.layer_shapes)
        return 2 * self.pages_per_block * self.block_size * self._row_bytes(self.num_kv_heads, self.head_dim)


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
    """Give every attention layer its K/V cache tensors (and scales, for 8-bit caches) and its KV group.
    Zeroed by default: the torch decode path multiplies masked-out (never written) slots by zero weights,
    and garbage there could be NaN. On the CPU the zeros are lazily mapped pages (``lazy_zeros``)."""
    if not zero:
        make = torch.empty
    elif device.type == "cpu":
        make = lambda shape, dtype, device: lazy_zeros(shape, dtype)  # noqa: E731
    else:
        make = torch.zeros

    def tensors(heads: int, dim: int) -> tuple[torch.Tensor, ...]:
        shape, scale_shape = (num_blocks, spec.block_size, heads, dim), (num_blocks, heads, spec.block_size)
        kv = (make(shape, dtype=spec.dtype, device=device), make(shape, dtype=spec.dtype, device=device))
        if not spec.quantized:
            return kv + (None, None)
        return kv + tuple(make(scale_shape, dtype=spec.scale_dtype, device=device) for _ in range(2))

    if spec.layer_shapes is not None:  # shapes differ: a tensor each, one group
        for attn, (heads, dim) in zip(layers, spec.layer_shapes):
            attn.k_cache, attn.v_cache, attn.k_scale, attn.v_scale = tensors(heads, dim)
            attn.kv_group = 0
        return
    shared = [tensors(spec.num_kv_heads, spec.head_dim) for _ in range(spec.pages_per_block)]
    for g, group in enumerate(spec.kv_groups):
        for j, index in enumerate(group.layers):  # a group's j-th layer uses tensor j
            attn = layers[index]
            attn.k_cache, attn.v_cache, attn.k_scale, attn.v_scale = shared[j]
            attn.kv_group = g


def release_kv_cache(layers: list) -> None:
    for attn in layers:
        attn.k_cache = attn.v_cache = torch.empty(0)
        attn.k_scale = attn.v_scale = None
