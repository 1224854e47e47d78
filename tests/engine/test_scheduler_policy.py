"""Scheduling policies (engine/sched_policy.py) on constructed queues, stepped without a model, and on the engine."""
from __future__ import annotations

import argparse
import random
import statistics

import pytest

from minfer.config import EngineConfig
from minfer.engine.block_manager import BlockManager
from minfer.engine.sched_policy import KVPredict, PrefillFirst
from minfer.engine.scheduler import Scheduler
from minfer.engine.sequence import Sequence, SequenceStatus
from minfer.engine_args import EngineArgs, add_engine_args
from minfer.sampling_params import SamplingParams

_ids = iter(range(1_000_000))


def _seq(prompt_len: int, max_tokens: int) -> Sequence:
    i = next(_ids)
    prompt = [(i * 7919 + j) % 30_000 for j in range(prompt_len)]  # unique: no prefix-cache hits between them
    params = SamplingParams(max_tokens=max_tokens)
    return Sequence(i, str(i), 0, prompt, params, 0, frozenset(), prompt_len + max_tokens)


def _step(sched: Scheduler) -> list[Sequence]:
    """One synchronous engine step without a model: the scheduled tokens are computed, a sequence at the end of its
    tokens samples one, and one at its length limit finishes. Returns the sequences that sampled a first token."""
    out = sched.schedule()
    first = []
    for seq in out.seqs:
        seq.num_computed_tokens += seq.num_scheduled_tokens
        seq.num_scheduled_tokens = 0
        sched.block_manager.cache_full_blocks(seq)
        if seq.num_computed_tokens == len(seq.token_ids):
            if len(seq.token_ids) == len(seq.prompt_token_ids):
                first.append(seq)
            seq.token_ids.append(7)
            if len(seq.token_ids) >= seq.max_total_tokens:
                sched.finish(seq, "length")
    return first


def _first_token_steps(policy: str, seqs: list[Sequence], blocks: int = 4096, budget: int = 4096) -> list[int]:
    sched = Scheduler(BlockManager(blocks, 16), max_num_seqs=256, max_num_batched_tokens=budget, policy=policy)
    for seq in seqs:
        sched.add_request([seq])
    steps: dict[int, int] = {}
    for step in range(1, 1000):
        steps.update((s.seq_id, step) for s in _step(sched))
        if len(steps) == len(seqs):
            break
    return [steps[s.seq_id] for s in seqs]


def test_bad_policy_name_fails_at_construction():
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \['fcfs', 'prefill-first', 'kv-predict'\]"):
        EngineConfig(scheduling_policy="sjf")
    with pytest.raises(ValueError, match="scheduling_policy"):
        Scheduler(BlockManager(8, 4), 4, 64, policy="lifo")


def test_cli_flag_reaches_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["--scheduling-policy", "kv-predict"]))
    assert args.create_engine_config().scheduling_policy == "kv-predict"
    assert EngineArgs.from_cli_args(parser.parse_args([])).scheduling_policy == "prefill-first"


def test_prefill_first_burst_serves_short_prompts_sooner_but_drains_no_faster():
    """A 64-prompt burst of workload A's lengths: shortest first lowers the median step of a first token, while the
    last first token comes in the same step (the burst's prefill work is fixed, so is its tail)."""
    rng = random.Random(0)
    lens = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(64)]
    fcfs = _first_token_steps("fcfs", [_seq(p, o) for p, o in lens])
    pf = _first_token_steps("prefill-first", [_seq(p, o) for p, o in lens])
    assert statistics.median(pf) < statistics.median(fcfs) - 1
    assert statistics.mean(pf) < statistics.mean(fcfs)
    assert abs(max(pf) - max(fcfs)) <= 1


def test_prefill_first_ages_out_of_shortest_first():
    """Short prompts arriving every step fill the budget: shortest first alone would starve the long one; it is
    admitted once it has waited AGE_STEPS steps, and not before (so the short ones did go first)."""
    sched = Scheduler(BlockManager(4096, 16), max_num_seqs=64, max_num_batched_tokens=256, policy="prefill-first")
    long = _seq(200, 1)
    sched.add_request([long])
    admitted_at = None
    for step in range(1, 3 * PrefillFirst.AGE_STEPS):
        for _ in range(4):
            sched.add_request([_seq(64, 1)])  # 4 x 64 tokens: the whole budget, finished in the step
        _step(sched)
        if long.status is not SequenceStatus.WAITING and admitted_at is None:
            admitted_at = step
    assert admitted_at is not None and PrefillFirst.AGE_STEPS <= admitted_at <= PrefillFirst.AGE_STEPS + 1


def test_prefill_first_holds_lone_arrivals_while_the_decode_batch_is_large():
    """With the running rows past HOLD_SHARE of max_num_seqs, one arrival waits HOLD_STEPS steps (fcfs:
    none); HOLD_BATCH arrivals are admitted at once."""
    def admitted_after(policy: str, arrivals: int) -> int:
        sched = Scheduler(BlockManager(4096, 16), max_num_seqs=32, max_num_batched_tokens=2048, policy=policy)
        for _ in range(20):
            sched.add_request([_seq(16, 500)])
        for _ in range(3):
            _step(sched)
        new = [_seq(64, 8) for _ in range(arrivals)]
        for seq in new:
            sched.add_request([seq])
        for step in range(1, 50):
            _step(sched)
            if all(s.num_computed_tokens for s in new):
                return step
        raise AssertionError("never admitted")

    assert admitted_after("fcfs", 1) == 1
    assert admitted_after("prefill-first", 1) == PrefillFirst.HOLD_STEPS + 1
    assert admitted_after("prefill-first", PrefillFirst.HOLD_BATCH) == 1


def _run_to_end(policy: str, seqs: list[Sequence], blocks: int) -> tuple[Scheduler, int]:
    sched = Scheduler(BlockManager(blocks, 4), max_num_seqs=16, max_num_batched_tokens=512, policy=policy)
    for seq in seqs:
        sched.add_request([seq])
    _step(sched)
    first_running = len(sched.running)
    for _ in range(500):
        if not sched.has_unfinished():
            break
        _step(sched)
    assert not sched.has_unfinished() and all(len(s.token_ids) == s.max_total_tokens for s in seqs)
    return sched, first_running


def test_kv_predict_admits_fewer_and_never_preempts_where_fcfs_does():
    """8 prompts of 40 tokens, 8 new tokens each, 64 blocks of 4: fcfs admits 6 (10 blocks each) and preempts as they
    grow to 12; kv-predict counts 40 + 0.7 x 8 tokens (12 blocks) for each and admits 5, which all fit."""
    fcfs, fcfs_first = _run_to_end("fcfs", [_seq(40, 8) for _ in range(8)], blocks=64)
    kvp, kvp_first = _run_to_end("kv-predict", [_seq(40, 8) for _ in range(8)], blocks=64)
    assert fcfs.num_preemptions > 0 and kvp.num_preemptions == 0
    assert kvp_first == 5 < fcfs_first == 6


def test_kv_predict_ratio_decays_per_step_and_resets_on_preemption():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=16, max_num_batched_tokens=512, policy="kv-predict")
    policy = sched.policy
    assert isinstance(policy, KVPredict)
    for _ in range(1000):
        sched.schedule()
    assert policy.ratio == KVPredict.MIN_RATIO
    sched.num_preemptions += 1
    sched.schedule()
    assert policy.ratio == KVPredict.INIT_RATIO


def test_every_policy_admits_with_nothing_running():
    """A prompt predicted past the whole cache still runs when nothing else does (no deadlock: fcfs's behaviour)."""
    for policy in ("kv-predict", "prefill-first"):
        sched, _ = _run_to_end(policy, [_seq(40, 200)], blocks=64)
        assert sched.num_preemptions == 0


@pytest.mark.parametrize("policy", ["prefill-first", "kv-predict"])
def test_engine_greedy_outputs_match_fcfs(policy: str):
    """The built-in model end to end: a policy changes when a sequence runs, never what it computes."""
    from minfer import LLM

    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randint(5, 200) for _ in range(rng.randint(3, 60))]} for _ in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for name in ("fcfs", policy):
        with LLM(num_kv_blocks=24, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                 scheduling_policy=name) as llm:
            outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[policy] == outs["fcfs"]


def test_prefill_first_orders_only_the_window_at_the_head(monkeypatch):
    """Shortest first among the queue's first WINDOW sequences; those behind keep their arrival order (a bounded
    sort per step, whatever the size of an offline batch)."""
    monkeypatch.setattr(PrefillFirst, "WINDOW", 4)
    sched = Scheduler(BlockManager(4096, 16), max_num_seqs=256, max_num_batched_tokens=4096, policy="prefill-first")
    seqs = [_seq(n, 4) for n in (90, 70, 50, 30, 80, 60, 40, 20)]
    for seq in seqs:
        sched.add_request([seq])
    assert sched.policy.prepare(sched, 0)
    assert [len(s.prompt_token_ids) for s in sched.waiting] == [30, 50, 70, 90, 80, 60, 40, 20]
