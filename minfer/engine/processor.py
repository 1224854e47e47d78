"""Processor: a prompt and its SamplingParams in, a checked EngineRequest out.

Every check a request must pass before it may reach the scheduler lives here, so the offline
``LLM`` and the HTTP server reject the same requests with the same messages. It reads only fixed
facts (the tokenizer, the vocabulary, ``max_model_len``, the cache's size), so the server runs its
own copy on the event loop's side and answers a bad request with a 400 before queueing it.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from numbers import Integral
from typing import Any

from minfer.engine.block_manager import blocks_needed
from minfer.pooling_params import PoolingParams
from minfer.sampling_params import SamplingParams
from minfer.structured_limits import DEFAULT_LIMITS, StructuredOutputsLimits

PromptType = str | dict[str, Any] | list[int]


class PromptError(ValueError):
    """A request the engine can never serve; ``field`` names what to change: 'prompt', 'max_tokens', or the
    request field that set an output constraint (``StructuredOutputsParams.source``)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(slots=True)
class EngineRequest:
    """A request that passed every check: what the engine core schedules (vLLM's EngineCoreRequest)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # PoolingParams: an embedding (runner='pooling': engine/pooling.py)
    max_total_tokens: int  # prompt + output never exceed this
    arrival_time: float
    # structured outputs apply only after these tokens (a reasoning model's end of thinking: reasoning.grammar_gate)
    grammar_after: tuple[int, ...] | None = None
    lora_request: Any = None  # the LoRA adapter it runs through (``minfer.lora.LoRARequest``), None: the base model


class Processor:
    """Tokenizes prompts and checks requests against the engine's fixed limits.

    ``num_kv_blocks`` x ``block_size`` is the whole cache: a request that could not fit in it even
    alone is refused here rather than preempted forever (``kv_windows``: the KV groups' windows, and
    ``max_chunk`` the largest prompt chunk, say how many blocks a sequence holds at most). ``clamp_max_tokens``: a ``max_tokens`` past
    the context is cut to fit (the offline ``LLM``, whose batches mix prompt lengths under one
    SamplingParams) or refused naming the context, the prompt and the request (the server, as vLLM's).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, num_kv_blocks: int,
                 block_size: int, sampling_defaults: dict[str, Any] | None = None,
                 structured_outputs_limits: StructuredOutputsLimits = DEFAULT_LIMITS,
                 kv_windows: tuple[int, ...] = (0,), max_chunk: int = 0) -> None:
        self.tokenizer = tokenizer
        self.structured_outputs_limits = structured_outputs_limits
        self.sampling_defaults = dict(sampling_defaults or {})  # the model's (generation_config.json)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.kv_windows, self.max_chunk = kv_windows, max_chunk
        self.clamp_max_tokens = True  # the server's copy sets False
        self._max_token_chars: int | None = None

    @property
    def max_prompt_chars(self) -> int:
        """A text longer than this cannot fit in the context, whatever it says: no token of the vocabulary is
        longer than ``max_token_chars`` characters. Checked before tokenizing, which takes seconds for a
        megabyte-long text."""
        return self.max_model_len * self.max_token_chars

    @property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry in characters (a byte-level entry spells each byte as one character,
        so this bounds the decoded text too); computed once."""
        if self._max_token_chars is None:
            vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
            self._max_token_chars = max(max(map(len, vocab), default=1), 16)
        return self._max_token_chars

    def clone(self) -> "Processor":
        """A processor for another thread. The tokenizer is deep-copied: a Rust ``tokenizers`` object
        used from two threads at once (one encoding, the other decoding) can fail with 'Already borrowed'."""
        other = copy.copy(self)
        other.tokenizer = copy.deepcopy(self.tokenizer) if self.tokenizer is not None else None
        return other

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams' defaults with the model's recommended settings on top."""
        return SamplingParams(**self.sampling_defaults)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt: a str, a token-id list, or {'prompt' | 'prompt_token_ids': ...}."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("skip_tokenizer_init=True: pass prompts as {'prompt_token_ids': [...]}")
            self.check_text_length(len(prompt))
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.tokenize(prompt["prompt"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams | None = None,
                arrival_time: float | None = None, lora_request: Any = None) -> EngineRequest:
        """Tokenize and check; raises ``PromptError`` (or another ValueError/TypeError) naming the field.
        ``lora_request``: a ``minfer.lora.LoRARequest`` (whether the engine serves it, the engine checks)."""
        from minfer.lora.request import LoRARequest

        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
        params = params or self.default_sampling_params()
        text, ids = self.tokenize(prompt)
        if isinstance(params, PoolingParams):  # an embedding: the prompt alone, no output token
            return EngineRequest(request_id, text, ids, params, self.check_prompt(ids, 0, pooling=True),
                                 arrival_time or time.time(), lora_request=lora_request)
        max_total = self.check_prompt(ids, params.max_tokens)
        self.check_params(params)
        return EngineRequest(request_id, text, ids, params, max_total, arrival_time or time.time(),
                             lora_request=lora_request)

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: limits that depend on the model."""
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.vocab_size:  # top-k over the vocabulary
                raise ValueError(f"{name} must be at most the vocabulary size ({self.vocab_size}), got {k}")
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids)):
            if ids and max(ids) >= self.vocab_size:  # SamplingParams refused negative ids
                raise ValueError(f"{name} has token id {max(ids)}, outside the vocabulary [0, {self.vocab_size})")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, but skip_tokenizer_init=True")
        constraint = params.structured_outputs
        if constraint is not None:  # the engine's limits (construction checked against the defaults)
            try:
                constraint.check(self.structured_outputs_limits)
            except ValueError as exc:
                if not constraint.source:
                    raise
                why = str(exc).split(": ", 1)[-1]
                raise PromptError(f"{constraint.source}: {why}", constraint.source) from None

    def check_text_length(self, num_chars: int, field: str = "prompt") -> None:
        """``PromptError`` for a text that is longer than any prompt the context can hold (see ``max_prompt_chars``)."""
        if num_chars > self.max_prompt_chars:
            raise PromptError(f"the text has {num_chars} characters: more than the {self.max_model_len}-token context "
                              f"can hold (at most {self.max_token_chars} characters a token)", field)

    def check_prompt(self, ids: list[int], max_tokens: int | None, pooling: bool = False) -> int:
        """Reject prompts the engine can never serve (``PromptError``); return the request's longest total
        length. ``max_tokens`` None means up to the context; past it, see ``clamp_max_tokens``. ``pooling``: an
        embedding's prompt (``max_tokens`` 0), which may fill the context."""
        if not ids:
            raise PromptError("the prompt is empty: it must contain at least one token", "prompt")
        if len(ids) >= self.max_model_len + pooling:  # first: the other checks cost a pass over the ids
            room = "at most that long" if pooling else "shorter to leave room for at least one output token"
            raise PromptError(f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                              f"it must be {room}", "prompt")
        vocab = self.vocab_size
        if not all(type(t) is int for t in ids):  # the fast check; numpy integers pass the slow one
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, Integral)]
            if bad:  # a float 1.5 would silently become token 1
                raise PromptError(f"prompt token ids must be integers, got {bad[0]!r} ({type(bad[0]).__name__})",
                                  "prompt")
        if min(ids) < 0 or max(ids) >= vocab:
            raise PromptError(f"prompt token ids must be in [0, {vocab}), got min {min(ids)}, max {max(ids)}", "prompt")
        if max_tokens is not None and len(ids) + max_tokens > self.max_model_len and not self.clamp_max_tokens:
            raise PromptError(f"max_tokens is too large: {max_tokens}. This model's maximum context length is "
                              f"{self.max_model_len} tokens and your request has {len(ids)} input tokens "
                              f"({max_tokens} > {self.max_model_len} - {len(ids)})", "max_tokens")
        total = self.max_model_len if max_tokens is None else min(len(ids) + max_tokens, self.max_model_len)
        need = blocks_needed(total, self.block_size, self.kv_windows, self.max_chunk)
        if need > self.num_kv_blocks:
            raise PromptError(f"this request needs up to {need} KV blocks ({total} tokens) but the whole cache has "
                              f"{self.num_kv_blocks}; lower max_tokens or give the cache more memory", "max_tokens")
        return total
