"""The data-parallel balancer's cost per routing decision, on the host (no model, no processes).

    python benchmarks/dp_balancer.py [--replicas 2 4 8] [--decisions 4000] [--prompt-len 1024]

Each decision is what ``DataParallelLLMEngine.add_processed_request`` adds to a request's path: ``Balancer.route``
(the scores, the prompt's prefix keys hashed and looked up, the choice recorded) plus the ``started`` and
``finished`` bookkeeping of its first and last outputs. Prompts are ``--prompt-len`` random token ids, every one
distinct, half of them behind one of 32 shared 512-token prefixes (a system prompt, a conversation's history), with
up to 256 requests in flight. Prints µs per decision (median of 5 runs) and the share that went to an affine replica.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from minfer.engine.dp.balancer import Balancer


def run(replicas: int, decisions: int, prompt_len: int, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    shared = [[rng.randrange(256) for _ in range(512)] for _ in range(32)]  # ids < 256: Python's cached ints
    prompts = []
    for k in range(decisions):  # every prompt distinct: a hit is a shared prefix, never a repeated prompt
        tail = [rng.randrange(256) for _ in range(prompt_len)]
        prompts.append((shared[k % 32] + tail)[:prompt_len] if k % 2 else tail)
    balancer = Balancer(replicas, block_size=16, max_num_seqs=256)
    in_flight: list[tuple[int, bool]] = []
    clock, spent = time.perf_counter, 0.0  # only the balancer's calls are timed, not this loop's own bookkeeping
    for k in range(decisions):
        t0 = clock()
        replica = balancer.route(prompts[k], 1)
        spent += clock() - t0
        in_flight.append((replica, False))
        if len(in_flight) > 128 and rng.random() < 0.5:  # a request in flight produces its first token
            j = rng.randrange(len(in_flight))
            if not in_flight[j][1]:
                t0 = clock()
                balancer.started(in_flight[j][0], 1)
                spent += clock() - t0
                in_flight[j] = (in_flight[j][0], True)
        if len(in_flight) > 256:  # the oldest finishes
            done, started = in_flight.pop(0)
            t0 = clock()
            balancer.finished(done, 1, started)
            spent += clock() - t0
    return spent / decisions * 1e6, balancer.affinity_hits / decisions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--decisions", type=int, default=4000)
    p.add_argument("--prompt-len", type=int, default=1024)
    args = p.parse_args()
    print("| replicas | prompt tokens | µs per decision (median of 5) | affine share |")
    print("|---:|---:|---:|---:|")
    for n in args.replicas:
        runs = [run(n, args.decisions, args.prompt_len, seed) for seed in range(5)]
        us = statistics.median(r[0] for r in runs)
        print(f"| {n} | {args.prompt_len} | {us:.1f} | {statistics.median(r[1] for r in runs):.0%} |")


if __name__ == "__main__":
    main()
