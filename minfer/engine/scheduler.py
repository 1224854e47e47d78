"""Scheduler: continuous batching with chunked prefill and preemption by recomputation.

Each step takes every running sequence (decodes: one token; unfinished prompts: a chunk), then
admits waiting sequences first come, first served, all under one token budget
(``max_num_batched_tokens``) and a cap on running sequences (``max_num_seqs``). When the KV cache
cannot hold a running sequence's next tokens, the most recently admitted running sequence is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
later (often mostly from the prefix cache). No step ever fails for lack of memory.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from minfer.engine.block_manager import BlockManager
from minfer.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    """The sequences of one step, decodes (one query token) first, then prompt chunks."""

    seqs: list[Sequence]
    num_decodes: int
    num_tokens: int
    scheduled_at: float = 0.0  # time.time()


def _context_len(seq: Sequence) -> int:
    return len(seq.token_ids)


class Scheduler:
    # Decodes go longest context first: the decode kernel's programs start in row order, so the long ones
    # start first and the short ones fill the gaps at the end (the longest-processing-time rule).
    longest_decodes_first = True

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queue ``seq``; ``front`` for work that was already admitted once (forked samples)."""
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        preempted = False
        i = 0
        running, allocate_slots = self.running, self.block_manager.allocate_slots
        while i < len(running) and budget > 0:  # plain attributes, no properties: runs for every sequence
            seq = running[i]
            num_tokens = len(seq.token_ids)
            if seq.num_pending and num_tokens >= seq.max_total_tokens:
                i += 1  # its last token is on the device and ends it ("length"): nothing left to compute
                continue
            num_new = min(num_tokens - seq.num_computed_tokens, budget)
            while not allocate_slots(seq, num_new):
                preempted = True
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing after it remains
            seq.num_scheduled_tokens = num_new
            scheduled.append(seq)
            budget -= num_new
            i += 1
        # Admit new work only when the running set fits: after a preemption, memory is short.
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:
                break  # preempted while its last sampled token was in flight: recompute once it is known
            if seq.params.prompt_logprobs is None and not seq.block_table:  # forked samples hold blocks
                self.block_manager.match_prefix(seq)  # (prompt logprobs need every position computed)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.allocate_slots(seq, num_new):
                self.block_manager.free(seq)  # hand back any prefix-cache blocks it took
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_scheduled_tokens = num_new
            self.running.append(seq)
            scheduled.append(seq)
            budget -= num_new
        decodes = [s for s in scheduled if s.num_scheduled_tokens == 1]
        if self.longest_decodes_first:
            decodes.sort(key=_context_len, reverse=True)
        chunks = [s for s in scheduled if s.num_scheduled_tokens > 1]
        return SchedulerOutput(decodes + chunks, len(decodes), self.max_num_batched_tokens - budget, time.time())

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Retire ``seq`` (from either queue) and free its blocks; tokens still in flight are dropped."""
        if seq.num_pending:
            del seq.token_ids[-seq.num_pending:]
            seq.num_pending = 0
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
