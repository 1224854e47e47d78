"""Scheduling policies: which waiting sequences a step admits, beside the running ones (``scheduling_policy``).

The scheduler always runs every running sequence first under ``max_num_batched_tokens`` (the budget the runner's
memory profile is sized for, so no policy steps past it); a policy only decides the admissions. ``fcfs`` has no
object here (``Scheduler.policy`` is None): its path has no extra work per step or per sequence.

- ``prefill-first``: a burst's p99 TTFT is its total prefill compute over the GPU's rate, whatever the order
  (``minfer/benchmark/ttft_floor.py``); what a policy can move is who waits. Shortest remaining prompt
  first lowers the median and p90 of a burst; a sequence that has waited ``AGE_STEPS`` steps goes ahead of every
  younger one (first come first among those), so none starves. Only the queue's first ``WINDOW`` sequences are
  ordered (those behind stay in arrival order), so a step's host cost stays bounded under an offline batch of any
  size. While the decode batch is large and only a few young prompts wait, admission is held for up to
  ``HOLD_STEPS`` steps so arrivals join in one mixed step: a step with prompt tokens runs eagerly, a pure decode
  step replays a CUDA graph, and at 256 clients about every other step would otherwise carry one arrival's prompt.
  Served on the 8B shape it gave more output tok/s than fcfs at 64 and 256 clients with lower TTFT p50 and p90, at
  the cost of a higher ITL p99 at 256 (benchmarks/RESULTS.md, "Performance round"): the default.
- ``kv-predict``: admit a sequence only if the blocks of its prompt plus a predicted share of its output fit
  beside the running sequences' predicted growth, SGLang's "new token ratio": the share starts at 0.7, falls by
  ``DECAY`` per step to 0.1 and goes back to 0.7 on a preemption. Admitting what will not fit costs a preemption
  later: the victim's recompute and a stall of its stream.
"""
from __future__ import annotations

from collections import deque
from typing import Protocol

from minfer.config import SCHEDULING_POLICIES, cdiv
from minfer.engine.block_manager import BlockManager
from minfer.engine.sequence import Sequence


class Scheduler(Protocol):
    """What a policy reads of ``engine.scheduler.Scheduler`` (which imports this module)."""

    waiting: deque[Sequence]
    running: list[Sequence]
    max_num_seqs: int
    num_preemptions: int
    block_manager: BlockManager


class SchedulingPolicy:
    """The hooks ``Scheduler.schedule`` calls: ``prepare`` once per step after the running sequences are
    scheduled (False: admit nothing this step), ``admit`` for each waiting sequence it is about to admit."""

    def prepare(self, sched: Scheduler, num_running_rows: int) -> bool:
        return True

    def admit(self, sched: Scheduler, seq: Sequence) -> bool:
        return True


def _resumed(seq: Sequence) -> bool:
    """Admitted before (preempted, with output or a sampled token in flight, or a forked sample holding its
    parent's blocks): it goes back first, as under fcfs."""
    return len(seq.token_ids) > len(seq.prompt_token_ids) or bool(seq.block_tables) or seq.num_pending > 0


class PrefillFirst(SchedulingPolicy):
    AGE_STEPS = 32  # a prompt waiting this many steps goes ahead of every younger one
    HOLD_STEPS = 4  # the longest admission is held to gather arrivals (a few decode steps of TTFT)
    HOLD_BATCH = 8  # arrivals that open admission at once
    HOLD_SHARE = 0.5  # hold only while the running rows fill this share of max_num_seqs
    WINDOW = 512  # the queue's head that is ordered and aged

    def __init__(self) -> None:
        self.step = 0
        self.arrival: dict[int, int] = {}  # seq_id -> the step it was first seen waiting

    def prepare(self, sched: Scheduler, num_running_rows: int) -> bool:
        self.step += 1
        waiting = sched.waiting
        if not waiting:
            self.arrival.clear()
            return True
        step, seen = self.step, self.arrival
        head = [waiting.popleft() for _ in range(min(len(waiting), self.WINDOW))]
        self.arrival = arrival = {s.seq_id: seen.get(s.seq_id, step) for s in head}  # admitted ones leave

        def key(seq: Sequence) -> tuple[int, int, int]:
            came = arrival[seq.seq_id]
            if _resumed(seq) or step - came >= self.AGE_STEPS:
                return 0, came, 0
            return 1, len(seq.token_ids) - seq.num_computed_tokens, came
        waiting.extendleft(reversed(sorted(head, key=key)))
        free_rows = sched.max_num_seqs - len(sched.running)
        if (num_running_rows >= self.HOLD_SHARE * sched.max_num_seqs and len(waiting) < min(self.HOLD_BATCH, free_rows)
                and not _resumed(waiting[0]) and step - min(arrival.values()) < self.HOLD_STEPS):
            return False
        return True


class KVPredict(SchedulingPolicy):
    INIT_RATIO = 0.7
    MIN_RATIO = 0.1
    DECAY = 0.0015  # per step: from 0.7 to 0.1 in 400 steps without a preemption

    def __init__(self) -> None:
        self.ratio = self.INIT_RATIO
        self.preemptions_seen = 0
        self.headroom = 0  # free blocks left after the predicted growth of those running and admitted

    def _predicted_blocks(self, seq: Sequence, block_size: int) -> int:
        """Blocks ``seq`` will hold with ``ratio`` of its remaining output written, beyond those it holds."""
        n = len(seq.token_ids)
        held = len(seq.block_tables[0]) if seq.block_tables else 0
        return max(0, cdiv(n + int(self.ratio * (seq.max_total_tokens - n)), block_size) - held)

    def prepare(self, sched: Scheduler, num_running_rows: int) -> bool:
        if sched.num_preemptions != self.preemptions_seen:
            self.preemptions_seen, self.ratio = sched.num_preemptions, self.INIT_RATIO
        else:
            self.ratio = max(self.MIN_RATIO, self.ratio - self.DECAY)
        if sched.waiting:
            bm = sched.block_manager
            groups, bs = len(bm.windows), bm.block_size
            self.headroom = bm.num_free_blocks - groups * sum(self._predicted_blocks(s, bs) for s in sched.running)
        return True

    def admit(self, sched: Scheduler, seq: Sequence) -> bool:
        bm = sched.block_manager
        need = len(bm.windows) * self._predicted_blocks(seq, bm.block_size)
        if need > self.headroom and sched.running:  # (with nothing running, admitting is the only way forward)
            return False
        self.headroom -= need
        return True


def make_policy(name: str) -> SchedulingPolicy | None:
    """The policy object of ``name``; None for fcfs, the scheduler's own path."""
    if name == "fcfs":
        return None
    if name == "prefill-first":
        return PrefillFirst()
    if name == "kv-predict":
        return KVPredict()
    raise ValueError(f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, got {name!r}")
