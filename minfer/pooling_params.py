"""PoolingParams: what one embedding request asks of the pooled vector (vLLM's names).

An engine built with ``runner="pooling"`` runs each prompt once and returns one vector per prompt instead of
sampling tokens; how the hidden states become that vector (last token, mean, CLS; normalised or not) is the
model's (its sentence-transformers config, else last-token normalised: ``engine/pooler_config.py``). A request
may only cut the vector to its first ``dimensions`` (a Matryoshka model's) and switch normalisation.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PoolingParams:
    """``dimensions``: keep the first k entries (only where the model says it was trained for it: a Matryoshka
    model; the engine checks), before normalising. ``normalize``: L2-normalise the vector (None: as the model
    says; True for a model without a sentence-transformers config, as vLLM's embed default)."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {d!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be True, False or None, got {self.normalize!r}")
