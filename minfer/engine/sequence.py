"""Sequence: one stream of tokens being generated, and the state the scheduler keeps for it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

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
    when the step's results come back; meanwhile the next step reads its value on the device from
    row ``sample_row`` of the previous step's sampled ids.

    ``block_table`` only ever grows by ``append``; any other change (free, fork, copy on write)
    puts a new list in its place. So ``table_rows``, the model runner's int32 copy of it, is
    valid while it was made from this very list object and has its length.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    sample_seed: int  # the seed of this sample's random stream (see Sampler)
    eos_token_ids: frozenset[int]
    max_total_tokens: int  # prompt + output may not exceed this (max_model_len / max_tokens)
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0
    num_pending: int = 0
    sample_row: int = -1  # this sequence's row in the last launched step's sampled ids
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    table_rows: tuple[list[int], np.ndarray] | None = None  # (block_table it copies, int32 copy)
    status: SequenceStatus = SequenceStatus.WAITING
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=lambda: [None])
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    detokenizer: object | None = None
    num_reported_tokens: int = 0  # output tokens already sent in delta outputs (LLMEngine.delta_outputs)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

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

    @property
    def samples_this_step(self) -> bool:
        return self.num_computed_tokens + self.num_scheduled_tokens == self.num_tokens
