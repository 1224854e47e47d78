"""What a drafter hands the verifier beside its tokens: each drafted token's draft distribution, kept on the device."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minfer.engine.sequence import Sequence


def ragged_arange(lengths: np.ndarray) -> np.ndarray:
    """``[0, 1, .., lengths[0] - 1, 0, 1, .., lengths[1] - 1, ...]`` without a Python loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total, dtype=np.int64) - starts


@dataclass(slots=True)
class DraftProbs:
    """``probs[rows_of[seq_id][j]]`` is the distribution the draft drew sequence ``seq_id``'s j-th drafted token
    from (rejection sampling accepts it with probability min(1, p/q))."""

    probs: torch.Tensor  # [R, V] float32
    rows_of: dict[int, list[int]]

    def gather(self, seqs: list[Sequence], device: torch.device) -> torch.Tensor:
        """The rows of ``seqs``' drafted tokens, in order ([sum of their drafts, V])."""
        index = [r for s in seqs for r in self.rows_of.get(s.seq_id, ())[:len(s.spec_token_ids)]]
        return self.probs.index_select(0, torch.tensor(index, dtype=torch.int64, device=device))


def collect_drafts(seqs: list[Sequence], steps: list[tuple[np.ndarray, torch.Tensor, torch.Tensor | None]]
                   ) -> DraftProbs | None:
    """Append each draft step's draws to its sequences' ``spec_token_ids``, with one wait for the device (the
    target's step needs them on the host). ``steps``: (the step's sequences as indices into ``seqs``, in its row
    order; their draws on the device; the distributions drawn from, or None where the step drew greedily).
    Returns the distributions, or None when some step drew greedily."""
    host = torch.cat([tokens for _, tokens, _ in steps]).tolist()
    rows_of: dict[int, list[int]] = {}
    base = 0
    for order, _, _ in steps:
        for r, i in enumerate(order.tolist()):
            seqs[i].spec_token_ids.append(host[base + r])
            rows_of.setdefault(seqs[i].seq_id, []).append(base + r)
        base += len(order)
    if any(p is None for _, _, p in steps):
        return None
    return DraftProbs(torch.cat([p for _, _, p in steps]), rows_of)
