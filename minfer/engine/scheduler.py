"""Scheduler: continuous batching with chunked prefill and preemption by recomputation.

Each step takes every running sequence (decodes: one token; unfinished prompts: a chunk), then
admits waiting sequences first come, first served (or as ``scheduling_policy`` orders and gates them:
``engine/sched_policy.py``), all under one token budget
(``max_num_batched_tokens``) and a cap on running sequences (``max_num_seqs``). When the KV cache
cannot hold a running sequence's next tokens, the most recently admitted running sequence is
preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
later (often mostly from the prefix cache). No step ever fails for lack of memory.

A request of ``n`` samples enters as ``n`` sequences: sample 0 computes the prompt, and once its
prompt is in the cache the others fork from it (sharing its blocks, copy on write) and recompute only
the last prompt token for their own first draw.

With speculative decoding, ``schedule(num_spec=k)`` reserves up to k more tokens of budget and KV slots for each
decoding sequence; the speculator then drafts them (``Sequence.spec_token_ids``) and gives back what it did not
draft (``SchedulerOutput.settle_drafts``). Such a step's sequences count only their last known token as computed when
it launches; the accepted drafts join when it completes (``engine/spec/complete.py``).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from minfer.engine.block_manager import BlockManager
from minfer.engine.sched_policy import make_policy
from minfer.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerOutput:
    """The sequences of one step, decodes (one query token) first, then prompt chunks."""

    seqs: list[Sequence]
    num_decodes: int
    num_tokens: int
    scheduled_at: float = 0.0  # time.time()
    freed_seq_ids: list[int] = field(default_factory=list)  # finished or preempted since the last step
    speculative: bool = False  # decoding sequences may carry drafted tokens; the step completes before the next

    def order(self) -> None:
        """Decodes first, longest context first: the decode kernel's programs start in row order, so the long ones
        start first and the short ones fill the gaps at the end (the longest-processing-time rule)."""
        decodes = [s for s in self.seqs if s.num_scheduled_tokens == 1]
        decodes.sort(key=_context_len, reverse=True)
        self.seqs = decodes + [s for s in self.seqs if s.num_scheduled_tokens > 1]
        self.num_decodes = len(decodes)

    def settle_drafts(self) -> None:
        """After drafting: each sequence keeps the reserved tokens it has drafts for (the budget it leaves unused
        stays so for this step; its KV slots serve its next steps), and the step is ordered again."""
        for seq in self.seqs:
            if seq.num_computed_tokens + seq.num_scheduled_tokens > len(seq.token_ids):
                seq.num_scheduled_tokens = len(seq.token_ids) - seq.num_computed_tokens + len(seq.spec_token_ids)
        self.num_tokens = sum(s.num_scheduled_tokens for s in self.seqs)
        self.order()


def _context_len(seq: Sequence) -> int:
    return len(seq.token_ids)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 fork_samples: bool = True, max_loras: int = 0, policy: str = "fcfs") -> None:
        """``fork_samples``: a request's samples fork from sample 0's prompt (off for models with recurrent
        state, where each sample computes its own: ``engine/state_cache.py``). ``max_loras``: the most LoRA
        adapters the running sequences may use (0: LoRA off); a waiting sequence of another adapter waits while
        they are all in use, and those behind it of adapters in use (or none) go ahead of it. ``policy``: which
        waiting sequences a step admits (``engine/sched_policy.py``; fcfs: in order, as many as fit)."""
        self.policy = make_policy(policy)  # None for fcfs: no hook is called
        self.max_loras = max_loras
        self.block_manager = block_manager
        self.fork_samples = fork_samples
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.unforked: dict[int, list[Sequence]] = {}  # sample 0's seq_id -> samples 1..n-1 not yet forked
        self._freed: list[int] = []

    def add_request(self, seqs: list[Sequence]) -> None:
        """Queue a request's samples: sample 0 now, the others once it has computed the prompt (or all of
        them now, without forking)."""
        if not self.fork_samples:
            self.waiting.extend(seqs)
            return
        self.waiting.append(seqs[0])
        if len(seqs) > 1:
            self.unforked[seqs[0].seq_id] = seqs[1:]

    def abort_request(self, seqs: list[Sequence]) -> None:
        """Finish every unfinished sample of a request with reason 'abort' and free its blocks."""
        self.finish_unqueued(self.unforked.pop(seqs[0].seq_id, ()))
        for seq in seqs:
            if not seq.is_finished:
                self.finish(seq, "abort")

    @staticmethod
    def finish_unqueued(seqs: Iterable[Sequence], reason: str = "abort") -> None:
        """Finish samples that were never queued (a request still compiling its grammar, samples not yet
        forked): they hold no blocks and sit in no queue, so there is nothing to free."""
        for seq in seqs:
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def on_launched(self, batch: SchedulerOutput, sampled: list[Sequence]) -> None:
        """Advance the step's sequences as if it had run: computed tokens move forward, full blocks
        enter the prefix cache, each sampling sequence gets a pending token, and a finished prompt
        releases its request's other samples. A speculative step's tokens arrive when it completes
        (drafted tokens are not computed until verified): no pending token."""
        cache_full_blocks, unforked = self.block_manager.cache_full_blocks, self.unforked
        for seq in batch.seqs:  # plain attributes, no properties: this loop runs for every sequence
            start = seq.num_computed_tokens
            end = start + seq.num_scheduled_tokens - len(seq.spec_token_ids)
            seq.num_computed_tokens, seq.num_scheduled_tokens = end, 0
            cache_full_blocks(seq)
            if unforked and start < len(seq.prompt_token_ids) <= end and seq.seq_id in unforked:
                self._fork_samples(seq)
        if not batch.speculative:
            for seq in sampled:
                seq.append_pending()

    def _fork_samples(self, seq: Sequence) -> None:
        for child in self.unforked.pop(seq.seq_id):
            self.block_manager.fork(seq, child)
            child.num_computed_tokens = seq.num_prompt_tokens - 1
            self.waiting.appendleft(child)  # already admitted once: ahead of new work

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, num_spec: int = 0) -> SchedulerOutput:
        """The next step; ``num_spec`` > 0: reserve that many drafted tokens for each decoding sequence (fewer near
        its length limit or the end of the budget; none while a grammar waits for its gate)."""
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
            if num_spec and num_new == 1 and not seq.num_pending and seq.grammar_after is None:
                num_new += max(0, min(num_spec, seq.max_total_tokens - num_tokens - 1, budget - 1))
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
        adapters = {s.lora_id for s in self.running if s.lora_id} if self.max_loras and self.waiting else set()
        skipped: list[Sequence] = []  # of an adapter that would be one too many: they keep their place in line
        policy = self.policy
        admitting = policy is None or policy.prepare(self, len(scheduled))
        while admitting and self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:
                break  # preempted while its last sampled token was in flight: recompute once it is known
            if seq.lora_id and seq.lora_id not in adapters and len(adapters) >= self.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            if seq.params.prompt_logprobs is None and not seq.block_tables:  # forked samples hold blocks
                self.block_manager.match_prefix(seq)  # (prompt logprobs need every position computed)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if (policy is not None and not policy.admit(self, seq)) or not allocate_slots(seq, num_new):
                self.block_manager.free(seq)  # hand back any prefix-cache blocks it took
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_scheduled_tokens = num_new
            self.running.append(seq)
            scheduled.append(seq)
            budget -= num_new
            if seq.lora_id:
                adapters.add(seq.lora_id)
        self.waiting.extendleft(reversed(skipped))
        # Decodes go longest context first: the decode kernel's programs start in row order, so the long
        # ones start first and the short ones fill the gaps at the end (the longest-processing-time rule).
        freed, self._freed = self._freed, []
        batch = SchedulerOutput(scheduled, 0, self.max_num_batched_tokens - budget, time.time(), freed,
                                speculative=num_spec > 0)
        batch.order()
        return batch

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.spec_token_ids = []
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        self._freed.append(seq.seq_id)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """Retire ``seq`` (from either queue) and free its blocks; tokens still in flight are dropped."""
        seq.drop_pending()
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self._freed.append(seq.seq_id)
