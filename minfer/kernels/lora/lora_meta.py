"""A step's tokens grouped by LoRA slot, the layout of a layer's adapter stacks, and the checks of a call's shapes.

Torch only (the reference and the kernels both read these).

The stacks of one fused linear layer with ``n_shards`` output shards (q, k, v: 3; gate, up: 2; o, down: 1):

- ``a_stack [max_loras, n_shards, max_rank, in_features]``: each shard's A. The shards share the layer's input, so
  one shrink launch computes every shard's ``x · Aᵀ``; their common width is ``in_features``: no padding.
- ``b_stack [max_loras, sum(shard_sizes), max_rank]``: the shards' B matrices with their output rows stacked as the
  fused base weight stacks them, shard s in rows ``[sum(shard_sizes[:s]), ... + shard_sizes[s])``. Stacked rather
  than ``[max_loras, n_shards, max_shard_out, max_rank]`` because shards differ in width: with grouped-query
  attention k and v are 1/4 to 1/8 of q, and padding them to q's width would nearly double the qkv B stack.
  (``minfer/lora/slots.py`` allocates both stacks.)

Ranks are zero-padded to ``max_rank`` (A's padding rows and B's padding columns zero), which keeps the padding exact:
a padding rank contributes ``0 · 0``. The LoRA scaling (``alpha / r``) is folded into B when an adapter is loaded, so
no kernel takes a scale. A slot's tensors are whole adapters' weights; a slot no token uses costs nothing.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REF_DTYPES = SUPPORTED_DTYPES + (torch.float64,)  # the reference also computes the tests' exact float64 results


class LoraMeta(NamedTuple):
    """A step's tokens grouped by adapter slot; built once a step (:func:`build_lora_meta`), read by every layer.

    ``token_slots [T]`` int32: each token's slot, -1 for the base model alone (any value outside
    ``[0, max_loras)`` counts as -1). ``sorted_tokens [T]`` int32: the token indices, slot 0's first, then slot 1's,
    ..., each slot's in token order, the tokens without an adapter last. ``slot_counts [max_loras]`` int32: tokens
    per slot. The kernels find each block's slot and rows from the counts alone, so no per-slot start offsets or
    list of active slots is needed (and none needs the host to read a count)."""

    token_slots: torch.Tensor
    sorted_tokens: torch.Tensor
    slot_counts: torch.Tensor

    @property
    def max_loras(self) -> int:
        return self.slot_counts.numel()

    @property
    def num_tokens(self) -> int:
        return self.token_slots.numel()


def build_lora_meta(token_slots: torch.Tensor, max_loras: int, out: LoraMeta | None = None) -> LoraMeta:
    """Group a step's tokens by slot: a stable sort and a scatter-add count, on the slots' device, no host sync.

    ``out``: a preallocated metadata of the same T and max_loras to refill in place (a CUDA graph's static
    inputs), returned. A count by ``scatter_add_`` rather than ``torch.bincount``, which reads the largest value
    back to the host to size its result."""
    if max_loras < 1:
        raise ValueError(f"max_loras must be at least 1, got {max_loras}")
    if token_slots.dim() != 1:
        raise ValueError(f"token_slots must be one-dimensional [T], got shape {tuple(token_slots.shape)}")
    slots = token_slots.to(torch.int32)
    in_range = (slots >= 0) & (slots < max_loras)
    key = torch.where(in_range, slots, max_loras).long()  # no adapter: the bucket past the last slot
    order = torch.argsort(key, stable=True).to(torch.int32)
    counts = torch.zeros(max_loras + 1, dtype=torch.int32, device=slots.device)
    counts.scatter_add_(0, key, torch.ones_like(slots))
    meta = LoraMeta(slots, order, counts[:max_loras])
    if out is None:
        return meta
    if out.num_tokens != meta.num_tokens or out.max_loras != max_loras:
        raise ValueError(f"out holds {out.num_tokens} tokens and {out.max_loras} slots, "
                         f"the step has {meta.num_tokens} and {max_loras}")
    for dst, src in zip(out, meta):
        dst.copy_(src)
    return out


def valid_slots(meta: LoraMeta) -> torch.Tensor:
    """``[T]`` bool: the tokens with an adapter (the same rule as :func:`build_lora_meta`'s grouping)."""
    return (meta.token_slots >= 0) & (meta.token_slots < meta.max_loras)


Ints = tuple[int, ...]


def shard_layout(shard_sizes: Sequence[int], shard_offsets: Sequence[int] | None = None) -> tuple[Ints, Ints]:
    """(sizes, output columns) of each shard as tuples of ints: a layer's geometry is fixed, and the expand kernel
    takes it as compile-time constants. ``shard_offsets``: each shard's first column in the base layer's output, by
    default the shards side by side from column 0 (a fused layer's own output)."""
    sizes = tuple(int(s) for s in shard_sizes)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"shard_sizes must be one or more positive widths, got {sizes}")
    cols = stacked_rows(sizes) if shard_offsets is None else tuple(int(c) for c in shard_offsets)
    if len(cols) != len(sizes) or min(cols) < 0:
        raise ValueError(f"shard_offsets {cols} must be one non-negative column per shard of sizes {sizes}")
    return sizes, cols


def stacked_rows(sizes: Ints) -> Ints:
    """Each shard's first row when the shards' rows are stacked (in b_stack, and in a fused layer's output)."""
    return tuple(sum(sizes[:i]) for i in range(len(sizes)))


def _check_tensor(name: str, t: torch.Tensor, dims: int) -> None:
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")


def _check_meta(meta: LoraMeta, num_tokens: int, max_loras: int) -> None:
    if meta.num_tokens != num_tokens or meta.sorted_tokens.numel() != num_tokens:
        raise ValueError(f"the LoRA metadata holds {meta.num_tokens} tokens, the input {num_tokens}")
    if meta.max_loras != max_loras:
        raise ValueError(f"the LoRA metadata counts {meta.max_loras} slots, the stack holds {max_loras}")


def check_shrink_args(x: torch.Tensor, a_stack: torch.Tensor, meta: LoraMeta,
                      dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> None:
    """x ``[T, in_features]`` and ``a_stack [max_loras, n_shards, max_rank, in_features]`` of one dtype."""
    _check_tensor("x", x, 2)
    _check_tensor("a_stack", a_stack, 4)
    if x.dtype not in dtypes or a_stack.dtype != x.dtype:
        raise TypeError(f"x and a_stack must share a dtype among {dtypes}; got {x.dtype} "
                        f"and {a_stack.dtype}")
    if a_stack.shape[3] != x.shape[1]:
        raise ValueError(f"a_stack's in_features {a_stack.shape[3]} != x's {x.shape[1]}")
    _check_meta(meta, x.shape[0], a_stack.shape[0])


def check_expand_args(buf: torch.Tensor, b_stack: torch.Tensor, meta: LoraMeta, out: torch.Tensor,
                      sizes: Ints, cols: Ints,
                      dtypes: tuple[torch.dtype, ...] = SUPPORTED_DTYPES) -> None:
    """buf ``[split_k, n_shards, T, max_rank]``, ``b_stack [max_loras, sum(sizes), max_rank]`` and out
    ``[T, >= every shard's last column]`` of b_stack's dtype."""
    buf_dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
    if buf.dim() != 4 or buf.dtype != buf_dtype:
        raise ValueError(f"buf must be {buf_dtype} [split_k, n_shards, T, max_rank], got {buf.dtype} "
                         f"{tuple(buf.shape)}")
    _check_tensor("buf", buf, 4)
    _check_tensor("b_stack", b_stack, 3)
    _check_tensor("out", out, 2)
    if out.dtype not in dtypes or b_stack.dtype != out.dtype:
        raise TypeError(f"out and b_stack must share a dtype among {dtypes}; got {out.dtype} "
                        f"and {b_stack.dtype}")
    _, n_shards, num_tokens, rank = buf.shape
    if n_shards != len(sizes):
        raise ValueError(f"buf holds {n_shards} shards, shard_sizes names {len(sizes)}")
    if b_stack.shape[1] != sum(sizes) or b_stack.shape[2] != rank:
        raise ValueError(f"b_stack must be [max_loras, {sum(sizes)}, {rank}] (the shards' rows stacked, the "
                         f"stack's rank), got {tuple(b_stack.shape)}")
    if out.shape[0] != num_tokens or out.shape[1] < max(c + s for c, s in zip(cols, sizes)):
        raise ValueError(f"out {tuple(out.shape)} must have {num_tokens} rows and every shard's columns "
                         f"(offsets {cols}, sizes {sizes})")
    _check_meta(meta, num_tokens, b_stack.shape[0])
