"""What a request returns: RequestOutput holding one CompletionOutput per sample (vLLM's shapes)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """What ``LLMEngine.step`` returns (vLLM's names): ``FINAL_ONLY`` finished requests only (``LLM``),
    ``CUMULATIVE`` every request that got a token, whole, ``DELTA`` only what is new (the server)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence. ``logprobs`` is a list (one per token) of {token_id: logprob}.

    ``token_offset`` is the position in the whole output of ``token_ids[0]`` (and ``logprobs[0]``).
    It is 0 except in the delta outputs of an engine built with ``RequestOutputKind.DELTA`` (the
    server's), where it counts the tokens that earlier outputs of this sequence already carried, so each step copies
    only its new tokens instead of the whole output so far. ``text`` and ``cumulative_logprob``
    are always whole: a str is shared, not copied.

    ``reasoning_content`` is set only by ``LLM.chat(..., reasoning_parser=...)``: the model's ``<think>`` text
    (None when it did not think), with ``text`` then the answer alone (vLLM's reasoning parsers' split).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    token_offset: int = 0  # output tokens before token_ids[0]; nonzero only in delta outputs
    reasoning_content: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    # None for the first prompt token. In delta outputs, only a request's first output carries them.
    prompt_logprobs: list[dict[int, float] | None] | None = None
