"""``add_lora``: the one call a LoRA-wrapped linear layer makes after its base product.

Kernels or reference by a switch the caller sets once (the ops choose it with the backend), and the reference
imported eagerly, the kernels lazily: a torch-only caller never loads Triton.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .lora_meta import LoraMeta
from .lora_ref import lora_expand_ref, lora_shrink_ref


def add_lora(out: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor, meta: LoraMeta,
             shard_sizes: Sequence[int], shard_offsets: Sequence[int] | None = None, *,
             use_triton: bool = True) -> None:
    """``out[t, shard s] += (x[t] · A[slot_t, s]ᵀ) · B[slot_t, shard s rows]ᵀ`` in place: a fused layer's output
    with each token's adapter added, the base output of tokens without one (slot -1) untouched.

    out ``[T, N_out]`` (the base layer's output), x ``[T, in_features]`` (its input),
    ``a_stack [max_loras, n_shards, max_rank, in_features]``, ``b_stack [max_loras, sum(shard_sizes), max_rank]``
    (layouts: ``lora_meta.py``), all one dtype; ``meta``: the step's :func:`~.lora_meta.build_lora_meta`.
    A row-parallel layer under tensor parallelism (o, down: A split along in_features) cannot take this call
    whole: it sums the shrink's partials over the ranks before the expand, with the two halves called apart."""
    if use_triton:
        from .lora import lora_expand, lora_shrink
        lora_expand(lora_shrink(x, a_stack, meta), b_stack, meta, out, shard_sizes, shard_offsets)
    else:
        lora_expand_ref(lora_shrink_ref(x, a_stack, meta), b_stack, meta, out, shard_sizes, shard_offsets)
