"""A speculative step's sampling inputs: 1 + k rows per sequence of k drafted tokens."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minfer.engine.input_batch import InputBatch, SamplingMetadata
from minfer.engine.sequence import Sequence
from minfer.engine.spec.draft_probs import DraftProbs, ragged_arange


@dataclass(slots=True)
class SpecInputs:
    """What a speculative step's verification reads beside the logits: drafted tokens per sampling sequence,
    the drafts (flat, on the device) and their draft distributions (None: n-gram drafts or greedy rows only)."""

    spec_lens: np.ndarray
    draft_ids: torch.Tensor
    draft_probs: torch.Tensor | None


def verify_inputs(input_batch: InputBatch, logits: torch.Tensor, sampled: list[Sequence], sample_rows: np.ndarray,
                  counts: np.ndarray, k: np.ndarray, draft_ids: torch.Tensor, draft_probs: DraftProbs | None
                  ) -> tuple[torch.Tensor, SamplingMetadata, SpecInputs]:
    """Row j of a sequence is its next position after j drafted tokens: its output count j further on than before
    the drafts (``counts`` include them), and for penalties, its history holding them."""
    counts = counts - k
    meta = input_batch.sampling_metadata(np.repeat(sample_rows, k + 1),
                                         np.repeat(counts, k + 1) + ragged_arange(k + 1), sampled)
    if meta.token_ids is not None:
        meta.token_ids = [hist + s.spec_token_ids[:j] for s, hist in zip(sampled, meta.token_ids)
                          for j in range(len(s.spec_token_ids) + 1)]
    probs = None
    if draft_probs is not None and not all(meta.rows.greedy):
        probs = draft_probs.gather(sampled, logits.device)
    return logits, meta, SpecInputs(k, draft_ids, probs)
