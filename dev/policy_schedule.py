"""Workload A's schedule under each scheduling policy, the model stubbed, its GPU time from a cost model (CPU).

Which prompts a step admits changes the steps' shapes (decode rows, prompt tokens, the context their attention
reads), not the total work: every prompt token is prefilled once and every output token reads its context once,
whatever the order. What can differ is how many steps there are and how long the tail of nearly empty steps runs.
This runs the real scheduler over workload A with the forward stubbed (``host_overhead.stub_model``), records each
step's shape and prices it with a rough qwen3-0.6b-on-H200 model: a fixed 1.2 ms a step (weights, LM head,
launches), the decode rows' KV bytes at 90% of 4.22 TB/s, prompt tokens at 304k tok/s (RESULTS.md, the issue-42
timeline). It says whether a policy moves the offline benchmark before a GPU run does.

Usage: python dev/policy_schedule.py [--policies fcfs prefill-first kv-predict]
"""
from __future__ import annotations

import argparse
import dataclasses

from host_overhead import stub_config, stub_model

from minfer.benchmark.workload import workload_a
from minfer.engine.llm_engine import LLMEngine
from minfer.outputs import RequestOutputKind

KV_BYTES = 28 * 8 * 128 * 2 * 2  # qwen3-0.6b: layers x KV heads x head dim x (K, V) x bf16, per context token
STEP_S, KV_BW, PREFILL_TOK_S = 1.2e-3, 0.9 * 4.22e12, 304e3


def schedule(policy: str) -> list[tuple[int, int, int]]:
    """(decode rows, prompt tokens, context tokens the decodes read) of every step of workload A under ``policy``."""
    config = dataclasses.replace(stub_config(256, async_scheduling=True), scheduling_policy=policy,
                                 max_model_len=4096, num_kv_blocks=256 * 2048 // 16 + 64)
    engine = LLMEngine(config, RequestOutputKind.FINAL_ONLY)
    stub_model(engine, 64)
    prompts, params = workload_a(vocab_size=512)
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, sp)
    steps: list[tuple[int, int, int]] = []
    scheduler = engine.scheduler
    plan = scheduler.schedule

    def recorded(*args, **kwargs):  # noqa: ANN202
        out = plan(*args, **kwargs)
        context = sum(seq.num_computed_tokens for seq in out.seqs[:out.num_decodes])
        steps.append((out.num_decodes, out.num_tokens - out.num_decodes, context))
        return out

    scheduler.schedule = recorded
    while engine.has_unfinished_requests():
        engine.step()
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", nargs="+", default=["fcfs", "prefill-first", "kv-predict"])
    args = ap.parse_args()
    output_tokens = sum(sp.max_tokens for sp in workload_a(vocab_size=512)[1])
    for policy in args.policies:
        steps = schedule(policy)
        seconds = sum(STEP_S + context * KV_BYTES / KV_BW + prompt / PREFILL_TOK_S for _, prompt, context in steps)
        with_prompt = sum(1 for _, prompt, _ in steps if prompt)
        tail = sum(1 for rows, _, _ in steps if 0 < rows < 32)
        print(f"{policy}: {len(steps)} steps ({with_prompt} with prompt tokens, {tail} with 1-31 decodes); "
              f"modelled {seconds:.2f} s, {output_tokens / seconds:,.0f} output tok/s")


if __name__ == "__main__":
    main()
