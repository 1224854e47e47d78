"""SamplingParams: how one request samples and when it stops (vLLM's names and defaults)."""
from __future__ import annotations

from dataclasses import dataclass, field

from minfer.structured_outputs import StructuredOutputsParams

MAX_SEED = 2**63 - 1  # seeds travel to the device as int64


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling and stopping rules.

    ``temperature=0`` is greedy. ``top_k=0`` (or -1) and ``top_p=1`` disable those filters.
    ``seed`` makes a request's samples reproducible whatever else shares its batch.
    ``logprobs=k`` returns, per generated token, the log-probabilities (of the model's raw
    distribution, before temperature and filters) of the chosen token and the top ``k``;
    ``prompt_logprobs=k`` does the same for every prompt token after the first (the prompt is then
    computed in full, bypassing the prefix cache).
    ``logit_bias`` ({token id: bias}) is added to those tokens' logits, and ``allowed_token_ids`` sets every other
    token's to -inf, before penalties and draws (vLLM's names and order); logprobs stay the raw distribution's (vLLM's
    default ``logprobs_mode="raw_logprobs"``). Ids past the vocabulary are refused by the engine's ``Processor``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    _stop_strings: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        _int_at_least("n", self.n, 1)
        _number_at_least("temperature", self.temperature, 0.0)
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        _int_at_least("top_k", self.top_k, -1)
        if self.top_k == -1:
            self.top_k = 0
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if self.seed is not None:
            _int_at_least("seed", self.seed, 0)
            if self.seed > MAX_SEED:
                raise ValueError(f"seed must be in [0, 2**63 - 1], got {self.seed!r}")
        if self.max_tokens is not None:
            _int_at_least("max_tokens", self.max_tokens, 1)
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            _int_at_least("logprobs", self.logprobs, 0)
        if self.prompt_logprobs is not None:
            _int_at_least("prompt_logprobs", self.prompt_logprobs, 0)
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self._stop_strings = tuple(stops)
        ids = self.stop_token_ids or []
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                         for t in ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(ids)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        self._check_bias()

    def _check_bias(self) -> None:
        """logit_bias: {token id: finite number}, kept as a fresh dict (None when empty); allowed_token_ids: a
        non-empty list of token ids (an empty one would leave nothing to sample)."""
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id to bias, got {type(bias).__name__}")
            for token, value in bias.items():
                if not _is_token_id(token):
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                if not _is_number(value) or abs(value) == float("inf"):
                    raise ValueError(f"logit_bias values must be finite numbers, got {value!r} for token {token}")
            self.logit_bias = {int(t): float(v) for t, v in bias.items()} or None
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not isinstance(allowed, (list, tuple)) or not allowed or not all(map(_is_token_id, allowed)):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids (integers >= 0), "
                                 f"got {allowed!r}")
            self.allowed_token_ids = [int(t) for t in allowed]

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop_strings

    @property
    def has_bias(self) -> bool:
        """A logit_bias or allowed_token_ids the sampler must apply."""
        return self.logit_bias is not None or self.allowed_token_ids is not None

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number_at_least(name: str, value: object, lo: float) -> None:
    if not _is_number(value) or value < lo:  # type: ignore[operator]
        raise ValueError(f"{name} must be a number >= {lo}, got {value!r}")


def _int_at_least(name: str, value: object, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
