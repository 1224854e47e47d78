"""``SpeculativeConfig``: vLLM's ``speculative_config`` dictionary, checked once, every error naming its field.

Two ways to draft (``method``): ``ngram`` looks the sequence's last tokens up earlier in its own prompt and output
and proposes what followed them (prompt lookup: free, and strong wherever the output copies its input: code edits,
summaries, RAG); ``draft_model`` runs a smaller registered model with the target's vocabulary; ``eagle3`` runs an
EAGLE-3 head, one layer over the target's own hidden states. The target verifies every drafted token in one
forward, so the output is the target's (token for token under greedy decoding, the same distribution when
sampling).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

SPEC_METHODS = ("ngram", "draft_model", "eagle3")
MAX_SPECULATIVE_TOKENS = 16  # past this the verify forward costs more than any acceptance rate repays
# Speculation pays while a step is bound by reading the weights; a large batch already reads them for many tokens,
# and the verify tokens then cost more than the accepted ones save (benchmarks/RESULTS.md, speculative decoding).
DEFAULT_DISABLE_BY_BATCH_SIZE = 32


def config_fields(value: Any, option: str, cls: type) -> dict[str, Any]:
    """A JSON-valued engine option (``--speculative-config '<json>'``, ``--kv-events-config '<json>'``, or the dict
    ``LLM`` takes) as a new dict of ``cls``'s dataclass fields; each error names ``option``."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{option} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a dict (or its JSON), got {type(value).__name__}")
    names = sorted(f.name for f in fields(cls))
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"{option} has unknown field(s) {unknown}; allowed: {names}")
    return dict(value)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """What drafts the tokens and how many. ``disable_by_batch_size``: no speculation in a step that runs this many
    sequences or more (0: always speculate)."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # the draft model or EAGLE-3 head (a local folder or hub id)
    prompt_lookup_min: int | None = None  # ngram: the shortest suffix looked up
    prompt_lookup_max: int | None = None  # ngram: the longest (tried first)
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    draft_tensor_parallel_size: int | None = None  # a draft model is split as the target is: None or the same size

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """From ``LLM(speculative_config=...)`` or ``--speculative-config '<json>'``; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        kwargs = config_fields(value, "speculative_config", cls)
        if "method" not in kwargs:
            kwargs["method"] = _infer_method(kwargs.get("model"))
        if "num_speculative_tokens" not in kwargs:
            raise ValueError("speculative_config.num_speculative_tokens is required (drafted tokens a step, "
                             f"1 to {MAX_SPECULATIVE_TOKENS})")
        return cls(**kwargs)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(SPEC_METHODS)}, got {self.method!r}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        _check_int("disable_by_batch_size", self.disable_by_batch_size, 0)
        if self.method == "ngram":
            if self.model is not None:
                raise ValueError("speculative_config.model must be absent for method 'ngram' (it drafts from the "
                                 "sequence's own tokens)")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max  # vLLM's defaults: one given sets both
            if lo is None and hi is None:
                lo = hi = 5
            lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
            _check_int("prompt_lookup_min", lo, 1)
            _check_int("prompt_lookup_max", hi, 1)
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
            return
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"speculative_config.model is required for method {self.method!r} (a local folder "
                             "or hub id)")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(f"speculative_config.{name} applies to method 'ngram' only")
        if self.draft_tensor_parallel_size is not None:
            _check_int("draft_tensor_parallel_size", self.draft_tensor_parallel_size, 1)


def _infer_method(model: Any) -> str:
    """vLLM's rule when ``method`` is absent: ``[ngram]`` names n-gram drafting, an EAGLE-3 head's name says so, any
    other model drafts."""
    if model is None or model == "[ngram]":
        raise ValueError(f"speculative_config.method is required, one of {list(SPEC_METHODS)}")
    return "eagle3" if "eagle3" in str(model).lower() else "draft_model"


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"speculative_config.{name} must be an integer {allowed}, got {value!r}")
