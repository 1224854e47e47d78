"""The multi-LoRA shrink and expand in torch: the yardstick of ``lora.py``'s kernels, and the path on a machine
without Triton (torch only).

Every slot's product is computed for every token, and each token keeps its own slot's: for the shrink one matmul
of x against all slots' A rows at once, for the expand one matmul of the intermediate, placed in its token's slot
block of a ``[T, max_loras * max_rank]`` matrix (zero elsewhere), against all slots' B. No loop over slots, no
gather of a weight per token (``[T, N, max_rank]`` at prefill), no data-dependent shape: nothing reads a count
back to the host, and the extra arithmetic (max_loras times the adapters' own, small beside the base layer's at
the usual eight to sixteen slots) buys a path that is the same code for every batch.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .lora_meta import (REF_DTYPES, LoraMeta, check_expand_args, check_shrink_args, shard_layout, stacked_rows,
                        valid_slots)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs (the tests' exact results; buf is then float64 too)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _onehot(meta: LoraMeta, dtype: torch.dtype) -> torch.Tensor:
    """``[T, max_loras]``: 1 at each token's slot, a zero row for a token without an adapter."""
    slots = torch.where(valid_slots(meta), meta.token_slots, meta.max_loras).long()
    return torch.nn.functional.one_hot(slots, meta.max_loras + 1)[:, :meta.max_loras].to(dtype)


def lora_shrink_ref(x: torch.Tensor, a_stack: torch.Tensor, meta: LoraMeta) -> torch.Tensor:
    """``buf [1, n_shards, T, max_rank]`` float32: ``x[t] · A[slot_t, s]ᵀ``, zero for tokens without an adapter
    (the kernel leaves those rows unwritten: nothing reads them). The leading 1 is the kernel's split-K axis."""
    check_shrink_args(x, a_stack, meta, REF_DTYPES)
    acc = _acc_dtype(x)
    num_tokens = x.shape[0]
    max_loras, n_shards, rank, in_features = a_stack.shape
    every = x.to(acc) @ a_stack.reshape(max_loras, n_shards * rank, in_features).to(acc).transpose(1, 2)
    # every [max_loras, T, n_shards * rank] -> each token's own slot
    own = (every * _onehot(meta, acc).t()[:, :, None]).sum(0)
    return own.view(num_tokens, n_shards, rank).transpose(0, 1).unsqueeze(0).contiguous()


def lora_expand_ref(buf: torch.Tensor, b_stack: torch.Tensor, meta: LoraMeta, out: torch.Tensor,
                    shard_sizes: Sequence[int], shard_offsets: Sequence[int] | None = None) -> None:
    """``out[t, shard s columns] = round(out + sum(buf[:, s, t]) · B[slot_t, shard s rows]ᵀ)``, in place, the
    sum in float32 and one rounding: tokens without an adapter keep their output bit for bit."""
    sizes, cols = shard_layout(shard_sizes, shard_offsets)
    check_expand_args(buf, b_stack, meta, out, sizes, cols, REF_DTYPES)
    acc = _acc_dtype(buf)
    lhs = buf.sum(0)  # [n_shards, T, rank]
    num_tokens, rank = lhs.shape[1], lhs.shape[2]
    onehot = _onehot(meta, acc)
    for s, (size, col, row) in enumerate(zip(sizes, cols, stacked_rows(sizes))):
        placed = (onehot[:, :, None] * lhs[s][:, None, :]).reshape(num_tokens, meta.max_loras * rank)
        w = b_stack[:, row:row + size].to(acc).transpose(1, 2).reshape(meta.max_loras * rank, size)
        view = out[:, col:col + size]
        view.copy_((view.to(acc) + placed @ w).to(out.dtype))
