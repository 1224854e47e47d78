"""Prompt logprobs: which rows of a step's hidden states they read, and their entries (the model runner's)."""
from __future__ import annotations

from typing import Any

import torch

from minfer.engine.sampler import Sampler
from minfer.engine.scheduler import SchedulerOutput
from minfer.engine.sequence import Sequence

Chunk = tuple[Sequence, int, int, int]  # (sequence, first position, hidden row range)


def prompt_logprob_chunks(batch: SchedulerOutput) -> list[Chunk]:
    """(sequence, first position, hidden row range) of each slice of prompt rows whose logits
    prompt logprobs need: row at position p predicts token p+1; slices of 1024 bound memory."""
    if all(s.params.prompt_logprobs is None for s in batch.seqs):  # the common step: one pass, nothing to plan
        return []
    chunks = []
    row = 0
    for seq in batch.seqs:
        start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
        if seq.params.prompt_logprobs is not None and seq.index == 0:
            last = min(start + n, seq.num_prompt_tokens - 1)  # positions [start, last) predict prompt tokens
            for lo in range(start, last, 1024):
                hi = min(lo + 1024, last)
                chunks.append((seq, lo, row + lo - start, row + hi - start))
        row += n
    return chunks


def prompt_logprobs(model: Any, sampler: Sampler, chunks: list[Chunk], hidden: torch.Tensor
                    ) -> dict[Sequence, tuple[int, list[dict[int, float]]]]:
    """Logprobs of the prompt tokens that ``chunks`` (``prompt_logprob_chunks``) cover, as (first
    position, entries) per sequence."""
    result: dict[Sequence, tuple[int, list[dict[int, float]]]] = {}
    for seq, lo, row_lo, row_hi in chunks:
        logprobs = model.compute_logits(hidden[row_lo:row_hi]).log_softmax(-1)
        targets = torch.tensor(seq.token_ids[lo + 1:lo + 1 + row_hi - row_lo], device=hidden.device)
        entries = sampler.gather_logprobs(logprobs, targets, [seq.params.prompt_logprobs] * (row_hi - row_lo))
        first, old = result.get(seq, (lo, []))
        result[seq] = (first, old + entries)
    return result
