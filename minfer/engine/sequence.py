"""Sequence: one sample's tokens and its KV-cache accounting, as the scheduler sees it.

What a sequence produces for the caller (text, logprobs, deltas) lives in the output processor, and
what the model runner keeps per row (block-table copies, sampling parameters on the device) lives in
its input batch; a sequence holds only what scheduling and caching need.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from minfer.sampling_params import SamplingParams

PENDING_TOKEN = -1  # stands in token_ids for a sampled token that is still on the device (async scheduling)


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class Sequence:
    """Prompt plus generated tokens of one sample of a request.

    ``num_computed_tokens`` counts tokens whose K/V sit in the cache. A step schedules the next
    ``num_scheduled_tokens`` of ``token_ids`` (a prompt chunk, or the one last token when
    decoding); the sequence samples when that brings it to the end of its known tokens. After a
    preemption it is recomputed from scratch over prompt + output, which the prefix cache
    usually turns into a cheap hit on its own just-freed blocks.

    With async scheduling, a step's sampled token is appended as ``PENDING_TOKEN`` when the step is
    launched (``num_pending`` counts them, at most two, at the end of ``token_ids``) and filled in
    when the step's results come back; meanwhile the next step reads its value on the device. Only
    the three methods below touch pending tokens.

    Each of ``block_tables`` (one per KV group) only ever grows by ``append``; any other change (free,
    fork, copy on write) puts a new list in its place, which lets the runner keep an int32 copy and
    update it by the appended entries alone. The one edit in place: a sliding-window group's entries that
    its window has passed become ``NO_BLOCK``, and the runner's copy keeps the old ids, which no kernel
    reads.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the seed of this sample's random stream (see Sampler)
    eos_token_ids: frozenset[int]
    max_total_tokens: int  # prompt + output may not exceed this (max_model_len / max_tokens)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0
    num_pending: int = 0
    block_tables: list[list[int]] = field(default_factory=list)  # one per KV group (empty: holds no block)
    block_hashes: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    grammar: Any = None  # structured outputs: this sample's xgrammar matcher (see engine/grammar.py)
    # the matcher waits, unconstrained, until the output has written these tokens in a row (the end of reasoning:
    # reasoning.grammar_gate); ``gate_matched`` counts how many of them the output's last tokens match
    grammar_after: tuple[int, ...] | None = None
    gate_matched: int = 0
    # speculative decoding: the tokens drafted for this step, scheduled after the last known token and verified by
    # the step's forward; never in ``token_ids`` (those that the target accepts are appended when the step completes)
    spec_token_ids: list[int] = field(default_factory=list)
    lora_request: Any = None  # the LoRA adapter it runs through (``minfer.lora.LoRARequest``), None: the base model
    lora_id: int = 0  # that adapter's ``lora_int_id`` (0: none), what the scheduler and the prefix cache key on

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    # ---- pending tokens (async scheduling) ------------------------------------------------
    def append_pending(self) -> None:
        """A launched step will sample this sequence's next token."""
        self.token_ids.append(PENDING_TOKEN)
        self.num_pending += 1

    def fill_pending(self, token: int) -> int:
        """The oldest pending token's value arrived; returns its position in ``token_ids``."""
        at = len(self.token_ids) - self.num_pending
        self.token_ids[at] = token
        self.num_pending -= 1
        return at

    def drop_pending(self) -> None:
        """Forget tokens still in flight (the sequence finished before they came back)."""
        if self.num_pending:
            del self.token_ids[-self.num_pending:]
            self.num_pending = 0

    # ---- derived counts -------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values the host has (all but the pending ones)."""
        return len(self.token_ids) - self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens the host knows (pending ones excluded)."""
        return self.token_ids[len(self.prompt_token_ids):self.num_known_tokens]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
