"""``VocabParallelEmbedding``: an embedding table (also the LM head's weight) split by vocabulary rows.

Rank r holds rows ``[r*per, (r+1)*per)`` with ``per = ceil(vocab / size)``, the last rank's tail
zero-padded, so any size splits any vocabulary. A lookup takes the rows this rank holds (zeros elsewhere)
and sums across ranks; ``gather_logits`` joins the ranks' logit columns and drops the padding.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minfer.distributed import SINGLE, TensorParallel


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.vocab, self.tp = vocab, tp
        per = -(-vocab // tp.size)
        self.start = tp.rank * per
        self.held = max(0, min(per, vocab - self.start))  # rows of real vocabulary on this rank
        self.weight = nn.Parameter(torch.zeros(per, hidden, dtype=dtype), requires_grad=False)

    def load_shard(self, name: str, source: Any, shard: int | None) -> None:
        tensor = source[self.start:self.start + self.held]
        if tensor.shape[1:] != self.weight.shape[1:] or tensor.shape[0] != self.held:
            raise ValueError(f"checkpoint tensor shape {tuple(tensor.shape)} != expected ({self.held}, "
                             f"{self.weight.shape[1]})")
        self.weight.data[:self.held].copy_(tensor)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        held = (local >= 0) & (local < self.held)
        x = F.embedding(torch.where(held, local, 0), self.weight) * held.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(x)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """This rank's ``[rows, per]`` logits → the whole vocabulary's ``[rows, vocab]``."""
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last(logits)[:, :self.vocab]
