"""Batch-1 decode on a random-weight shape: tokens per second and the decode graph's GPU time per step (GPU).

``minfer bench --batch1`` gives the tokens per second, host included; the replay time of the captured
batch-1 decode graph is the step's device time alone, steadier than a 512-token run's rate and what
the kernels are judged by (README: 811-814 µs on llama-3.2-1b, 72% of the weights/bandwidth bound).
Each repeat builds a fresh engine in this process, so repeats show the run-to-run spread.

    python3 benchmarks/batch1.py [--shape llama-3.2-1b] [--output-len 512] [--repeats 1] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minfer import LLM  # noqa: E402
from minfer.benchmark.offline import run_batch1  # noqa: E402
from minfer.benchmark.shapes import write_random_checkpoint  # noqa: E402


def median_replay_us(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median µs of ``reps`` replays of ``graph``, each timed alone by CUDA events."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[reps // 2]


def graph_step_us(llm: LLM, reps: int = 300) -> float:
    """Median GPU time of one replay of the batch-1 decode graph, as the last step left its inputs."""
    return median_replay_us(llm.llm_engine.runner.graphs.graphs[1], reps)


def measure(model: str, input_len: int, output_len: int) -> dict:
    """``minfer bench --batch1``'s figures plus the graph's replay time, on a fresh engine."""
    llm = LLM(model, skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=8)
    result = run_batch1(llm, input_len, output_len)
    result["graph_step_us"] = round(graph_step_us(llm), 2)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def row(name: str, r: dict) -> str:
    return (f"| {name} | {r['decode_tok_s']:,.1f} tok/s | {100 * r['share_of_bound']:.1f}% of {r['bound_tok_s']:,.0f} "
            f"| graph replay {r['graph_step_us']:.1f} us/step ({1e6 / r['graph_step_us'] / r['bound_tok_s']:.1%} "
            f"of the bound) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--checkpoint-dir", default="/tmp/minfer-checkpoints")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=512, help="512: runs repeat within 0.3%% (128 spread 15%%)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = str(write_random_checkpoint(args.shape, Path(args.checkpoint_dir) / args.shape, device="cuda"))
    results = []
    for _ in range(args.repeats):
        results.append(measure(model, args.input_len, args.output_len))
        print(row("base", results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
