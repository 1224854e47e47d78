"""Scheduler step layout: decodes first, longest context first (the decode kernel's load balance), then chunks."""
from __future__ import annotations

from minfer.engine.block_manager import BlockManager
from minfer.engine.scheduler import Scheduler
from minfer.engine.sequence import Sequence
from minfer.sampling_params import SamplingParams


def _finish_step(out) -> None:
    """What the engine does after a step: the scheduled tokens are computed and each sequence that reached
    its end of prompt gets a sampled token."""
    for seq in out.seqs:
        seq.num_computed_tokens += seq.num_scheduled_tokens
        if seq.num_computed_tokens == len(seq.token_ids):
            seq.token_ids.append(7)


def test_decodes_come_first_and_longest_first():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    lens = [3, 9, 5, 7]
    seqs = [Sequence(i, str(i), 0, list(range(100 * i, 100 * i + n)), SamplingParams(), 0, frozenset(), 10_000)
            for i, n in enumerate(lens)]
    for seq in seqs[:3]:
        sched.add_request([seq])
    _finish_step(sched.schedule())  # three prompts, whole
    sched.add_request([seqs[3]])
    out = sched.schedule()  # three decodes and one prompt
    assert out.num_decodes == 3 and out.seqs[3] is seqs[3] and out.seqs[3].num_scheduled_tokens == 7
    assert [len(s.token_ids) for s in out.seqs[:3]] == [10, 6, 4]
