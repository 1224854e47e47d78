"""LogitBias: the sampling rows' ``logit_bias`` and ``allowed_token_ids`` as flat index tensors on the device.

Built once with the rows' other facts (``input_batch.RowFacts``: again only when the rows or their order change),
so a step applies them with three indexed kernels and no host work: a dense [rows, vocab] bias would be 128 MB
at 256 rows of a 128k vocabulary, while a request biases a handful of tokens. Indices are flat
(``row * vocab + token``) and unique per row (a dict's keys; an allow-list is deduplicated), so the adds and copies
are exact and deterministic. Nothing here waits for the device: the index arrays go up through pinned memory.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from minfer.sampling_params import SamplingParams


@dataclass(slots=True)
class LogitBias:
    """``apply(logits)``: allow-lists first (every other token of such a row to -inf), then the biases added,
    vLLM's order (both before penalties)."""

    bias_rows: torch.Tensor  # [B] int64: the row of each biased (row, token) pair
    bias_ids: torch.Tensor  # [B] int64
    bias_values: torch.Tensor  # [B] float32
    allowed_rows: torch.Tensor  # [A] int64: the rows with an allow-list
    keep_rows: torch.Tensor  # [K] int64: the row of each allowed (row, token) pair
    keep_ids: torch.Tensor  # [K] int64

    @classmethod
    def build(cls, params: list[SamplingParams], upload: Callable[[np.ndarray], torch.Tensor]) -> LogitBias | None:
        """The rows' biases, or None when no row has one (the sampler then does nothing for them). ``upload``: a
        host array to the device (``input_batch.to_device``)."""
        bias = [(r, p.logit_bias) for r, p in enumerate(params) if p.logit_bias]
        allowed = [(r, sorted(set(p.allowed_token_ids))) for r, p in enumerate(params) if p.allowed_token_ids]
        if not bias and not allowed:
            return None
        ints = [np.repeat(np.array([r for r, _ in bias], dtype=np.int64), [len(b) for _, b in bias]),
                np.fromiter((t for _, b in bias for t in b), dtype=np.int64),
                np.array([r for r, _ in allowed], dtype=np.int64),
                np.repeat(np.array([r for r, _ in allowed], dtype=np.int64), [len(a) for _, a in allowed]),
                np.fromiter((t for _, a in allowed for t in a), dtype=np.int64)]
        values = np.fromiter((v for _, b in bias for v in b.values()), dtype=np.float32)
        packed = upload(np.concatenate(ints))  # one copy up for the five index arrays
        bias_rows, bias_ids, allowed_rows, keep_rows, keep_ids = packed.split([len(a) for a in ints])
        return cls(bias_rows, bias_ids, upload(values), allowed_rows, keep_rows, keep_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A new [R, vocab] float tensor: ``logits`` (left untouched) with the allow-lists and biases applied."""
        vocab = logits.shape[-1]
        out = logits.clone()
        flat = out.view(-1)
        if len(self.allowed_rows):
            keep = self.keep_rows * vocab + self.keep_ids
            kept = flat.index_select(0, keep)
            out.index_fill_(0, self.allowed_rows, float("-inf"))
            flat.index_copy_(0, keep, kept)
        if len(self.bias_rows):
            flat.index_add_(0, self.bias_rows * vocab + self.bias_ids, self.bias_values)
        return out

