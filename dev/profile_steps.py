"""Where a decode step's time goes: torch.profiler over steady-state decode steps of workload A.

Prints the GPU-busy share of wall time, the top kernels by device time, and host time per phase
of ``engine.step()``: schedule, launch (input building and kernel launches; with async scheduling
nothing here waits for the GPU), complete (waiting for the draws, then stops and outputs).
Usage (GPU): python3 dev/profile_steps.py --shape qwen3-0.6b [--no-async] [--batch1] --out profile.txt
``--batch1``: one greedy request (128-token prompt) instead of workload A, for the batch-1 latency split.
``--prompt-steps``: profile workload A's first steps instead (each carries prompt chunks, eagerly: no
CUDA graph covers them), to split their wall time into GPU work and host launch cost.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from minfer import LLM, SamplingParams
from minfer.benchmark.shapes import shape_checkpoint
from minfer.benchmark.workload import fixed_workload, workload_a

from host_overhead import time_phases  # this folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--no-async", action="store_true", help="async_scheduling=False")
    ap.add_argument("--batch1", action="store_true", help="one greedy request instead of workload A")
    ap.add_argument("--prompt-steps", action="store_true", help="profile the first, prompt-carrying steps")
    ap.add_argument("--cprofile", action="store_true", help="Python's cProfile over the steps instead (host hot spots)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: random weights drawn on the GPU (no checkpoint written: large shapes)")
    ap.add_argument("--quantization", default=None, help="as minfer bench's (fp8: online per-channel FP8 weights)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--out", default="profile.txt")
    args = ap.parse_args()
    path = shape_checkpoint(args.shape, Path("/tmp/minfer-shapes") / args.shape, args.load_format)
    llm = LLM(str(path), load_format=args.load_format, skip_tokenizer_init=True, max_model_len=4096,
              attention_backend=args.attention_backend, async_scheduling=not args.no_async,
              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.llm_engine
    if args.batch1:
        prompts, _ = fixed_workload(1, 128, 4096, vocab_size=engine.model_config.vocab_size)
        params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=4096)]
    else:
        prompts, params = workload_a()
    if args.prompt_steps:  # one warm-up request first: the kernels' first compiles stay out of the trace
        engine.add_request("warm", prompts[0], SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    while not args.prompt_steps and (engine.scheduler.waiting or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running)):
        engine.step()  # until every prompt is prefilled: steady-state decode from here
    torch.cuda.synchronize()
    phases = time_phases(engine)
    batch_size = len(engine.scheduler.running)
    if args.cprofile:
        host = cProfile.Profile()
        host.enable()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        host.disable()
        stats = io.StringIO()
        pstats.Stats(host, stream=stats).sort_stats("tottime").print_stats(30)
        Path(args.out).write_text(stats.getvalue())
        print(stats.getvalue())
        return
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    kind = "prompt-carrying" if args.prompt_steps else "decode"
    lines = [f"shape {args.shape}, backend {engine.runner.ops.name}, async_scheduling {engine.config.async_scheduling}, "
             f"{batch_size} running sequences, {args.steps} {kind} steps in {wall * 1e3:.1f} ms = "
             f"{wall / args.steps * 1e3:.2f} ms/step ({batch_size * args.steps / wall:.0f} tok/s)",
             f"GPU busy (sum of kernel time / wall): {device_us / 1e6 / wall:.1%}",
             "host time per step: " + ", ".join(f"{k} {v / args.steps * 1e3:.2f} ms" for k, v in phases.items()),
             "", events.table(sort_by="self_cuda_time_total", row_limit=25)]
    text = "\n".join(lines)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
