"""One rank's view of its tensor-parallel group: which slice of each sharded dimension it holds,
and the two collectives the sharded model needs (a sum across ranks, a gather along the last dim).

At size 1 (``SINGLE``) both collectives return their input untouched and no process group exists,
so a one-GPU engine runs exactly the code it ran before tensor parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the compute process group (NCCL on GPUs, gloo on the CPU); None at size 1

    def split(self, n: int) -> tuple[int, int]:
        """(start, length) of this rank's share of a dimension of ``n`` that ``size`` divides."""
        if n % self.size:
            raise ValueError(f"{n} does not split over {self.size} ranks")
        share = n // self.size
        return self.rank * share, share

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first head, count) of the KV heads this rank holds: a share of them when ``size`` divides
        their number, else one head replicated across ``size / num_kv_heads`` consecutive ranks (the
        ranks whose query heads read it: query head h reads KV head h // group)."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads)
        return self.rank * num_kv_heads // self.size, 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (in place)."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, n]`` per rank → ``[rows, size * n]``, rank r's columns at ``[r*n, (r+1)*n)``."""
        if self.size == 1:
            return x
        rows, n = x.shape
        gathered = torch.empty(self.size * rows, n, dtype=x.dtype, device=x.device)
        dist = torch.distributed  # torch 2.13 renamed all_gather_into_tensor (deprecated there) all_gather_single
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(gathered, x.contiguous(), group=self.group)
        return gathered.view(self.size, rows, n).permute(1, 0, 2).reshape(rows, self.size * n)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (in place)."""
        if self.size > 1:
            torch.distributed.broadcast(x, 0, group=self.group)
        return x


SINGLE = TensorParallel()
