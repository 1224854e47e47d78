"""LoRA inside the batch-1 matrix-vector kernel (``gemv.py``): the token's adapter at one extra launch a projection.

At batch 1 the batched LoRA kernels (``kernels/lora``) cost two launches per projection, eight a layer, each a few
microseconds of launch and ramp-up for a few KB of work: about a quarter of an 8B decode step. Here a projection
with an adapter takes one launch more than without:

- the **shrink** ``xa = prologue(x) · A[slot]ᵀ`` is the matrix-vector kernel itself over the slot's A rows
  (``[shards × max_rank, K]``, a view of the stack), with the projection's own prologue (the residual add and RMS
  norm before qkv and gate_up, SwiGLU before down), so it reads the same input vector the base product reads. Its
  few rows are split over K too (up to 4 parts: ``gemv_config.lora_shrink_config``): the shrink sits on the step's
  critical path between two projections, and programs streaming whole 14336-wide rows alone made it slow. The
  parts stay float32 partial sums;
- the **expand** is the base launch's epilogue: each program sums the parts and adds
  ``Σ_r xa[shard, r] · B[slot, row, r]`` to its rows' float32 sums before their one rounding (B's rows lie as the
  fused weight's, so a row's shard follows from its index: ``shard_end0/1``). Its operands load before the weight
  stream (``lora_load_rows``).

The slot is read on the device (a CUDA graph's static input); a slot outside ``[0, n_loras)`` is the base model
alone: the shrink's programs exit after their PDL wait and the epilogue adds nothing. The delta is linear in
``xa``, so a row-parallel layer under tensor parallelism adds each rank's partial ``xa`` times the whole B before the
sum over ranks, which then sums to the full product.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._utils import next_pow2


class GemvLora(NamedTuple):
    """A projection's adapters for one token (stack layouts: ``kernels/lora/lora_meta.py``): ``slot`` ``[>= 1]``
    int32 on the device (its first entry is the token's slot), ``a_stack [L, shards, max_rank, K]`` and
    ``b_stack [L, N, max_rank]`` contiguous, in the model dtype (B holds the scale), ``shard_sizes`` summing to N."""

    slot: torch.Tensor
    a_stack: torch.Tensor
    b_stack: torch.Tensor
    shard_sizes: tuple[int, ...]

    def check(self, n: int, k: int, dtype: torch.dtype) -> None:
        """A bad stack fails here, naming what is wrong, not as a wild read in the kernel."""
        a, b = self.a_stack, self.b_stack
        if a.dim() != 4 or a.shape[3] != k or a.shape[1] != len(self.shard_sizes) or not a.is_contiguous():
            raise ValueError(f"lora a_stack must be a contiguous [L, {len(self.shard_sizes)}, R, {k}], got "
                             f"{tuple(a.shape)}")
        if b.shape != (a.shape[0], n, a.shape[2]) or not b.is_contiguous() or sum(self.shard_sizes) != n:
            raise ValueError(f"lora b_stack must be a contiguous [{a.shape[0]}, {n}, {a.shape[2]}] over shards "
                             f"summing to {n}, got {tuple(b.shape)} and {self.shard_sizes}")
        if a.dtype != dtype or b.dtype != dtype or self.slot.dtype != torch.int32 or self.slot.numel() < 1:
            raise ValueError(f"lora stacks must be {dtype} and the slot an int32 tensor, got {a.dtype}, {b.dtype}, "
                             f"{self.slot.dtype}")
        if len(self.shard_sizes) > 3:
            raise ValueError(f"at most 3 shards (q, k, v), got {len(self.shard_sizes)}")

    def shrink_weight(self) -> torch.Tensor:
        """A as the shrink's weight: ``[L × shards × max_rank, K]``; the kernel offsets its rows by the slot."""
        return self.a_stack.view(-1, self.a_stack.shape[3])

    def expand_args(self, xa: torch.Tensor) -> dict:
        """The base launch's epilogue arguments; ``xa [parts, shards × max_rank]``: the shrink's partial sums."""
        sizes, n = self.shard_sizes, sum(self.shard_sizes)
        ends = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)] + [n, n]
        rank = self.a_stack.shape[2]
        return dict(LORA_SLOT=self.slot, n_loras=self.a_stack.shape[0], XA=xa, stride_xa=xa.stride(0),
                    LB=self.b_stack, stride_lb=self.b_stack.stride(0), shard_end0=ends[0], shard_end1=ends[1],
                    LORA_RANK=rank, LORA_RP=next_pow2(rank), LORA_SPLIT=xa.shape[0],
                    LORA_SPLIT_P=next_pow2(xa.shape[0]))


@triton.jit
def lora_load_rows(rows, N, SLOT, n_loras, XA, stride_xa, LB, stride_lb, shard_end0, shard_end1, RANK: tl.constexpr,
                   RP: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P: tl.constexpr):
    """The expand's operands for ``rows``: the shrink's partial sums ``[SPLIT_P, BLOCK_N, RP]`` and B's rows
    ``[BLOCK_N, RP]`` (zeros without an adapter: masked loads, no branch). Loaded before the weight stream and used
    after it (:func:`lora_delta`), so their latency hides behind it: used where they load, they added a round trip
    to every program's tail, a few µs a projection in waves of thousands of programs."""
    slot = tl.load(SLOT)
    active = (slot >= 0) & (slot < n_loras)
    rr = tl.arange(0, RP)
    parts = tl.arange(0, SPLIT_P)
    shard = (rows >= shard_end0).to(tl.int32) + (rows >= shard_end1).to(tl.int32)
    ok = (rows < tl.where(active, N, 0))[:, None] & (rr < RANK)[None, :]  # nothing without an adapter
    xa = tl.load(XA + parts[:, None, None] * stride_xa + (shard[:, None] * RANK + rr[None, :])[None, :, :],
                 mask=(parts < SPLIT)[:, None, None] & ok[None, :, :], other=0.0)
    b = tl.load(LB + slot.to(tl.int64) * stride_lb + rows.to(tl.int64)[:, None] * RANK + rr[None, :], mask=ok,
                other=0.0)
    return xa, b


@triton.jit
def lora_delta(xa, b):
    """``[BLOCK_N]`` float32: each row's ``Σ_r (Σ_parts xa) · B`` (the parts added in order of their index)."""
    return tl.sum(tl.sum(xa, axis=0) * b.to(tl.float32), axis=1)
