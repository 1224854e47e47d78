"""Where a whole workload-A run's GPU time goes, and how much of the wall the GPU sits idle (GPU).

``profile_steps.py`` looks at a few steady-state steps; this traces every kernel of one complete
timed run (CUDA activity only, so the host side runs at nearly its normal speed) and prints: wall
time, the sum of kernel time (GPU busy), the idle remainder, and kernel time grouped by kind
(decode attention, prefill attention, GEMMs, norms, ...). The idle share is what host work,
launch gaps and synchronisation cost; the grouped times show which kernels a target depends on.

Usage: python3 dev/run_profile.py --shape qwen3-0.6b [--out run_profile.txt]
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from minfer import LLM, SamplingParams
from minfer.benchmark.shapes import write_random_checkpoint
from minfer.benchmark.workload import workload_a

GROUPS = [("decode attention", ("_decode_split", "_decode_merge")), ("prefill attention", ("_prefill",)),
          ("GEMM (cuBLAS)", ("nvjet", "gemm", "cutlass", "sm90_xmma")), ("gemv", ("_gemv",)),
          ("rms norm", ("_rms_norm",)), ("rope + KV store", ("_rope_store", "_rotary", "_store_kv")),
          ("silu", ("_silu",)), ("sampling", ("_argmax", "reduce_kernel"))]


def group_of(name: str) -> str:
    return next((g for g, keys in GROUPS if any(k in name for k in keys)), "other")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--out", default="run_profile.txt")
    args = ap.parse_args()
    path = write_random_checkpoint(args.shape, Path("/tmp/minfer-shapes") / args.shape)
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=4096)
    prompts, params = workload_a()
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    by_group: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        if e.self_device_time_total > 0:
            by_group[group_of(e.key)] += e.self_device_time_total / 1e6
            by_name[e.key[:70]] += e.self_device_time_total / 1e6
    busy = sum(by_group.values())
    lines = [f"{args.shape}: workload A, {tokens} output tokens in {wall:.2f} s under the CUDA tracer "
             f"({tokens / wall:,.0f} tok/s)",
             f"GPU busy {busy:.2f} s ({busy / wall:.1%} of wall), idle {wall - busy:.2f} s", "",
             "| kernels | seconds | share of wall |", "|---|---|---|"]
    lines += [f"| {g} | {t:.3f} | {t / wall:.1%} |" for g, t in sorted(by_group.items(), key=lambda kv: -kv[1])]
    lines += ["", "top kernels:"]
    lines += [f"  {t:8.3f} s  {n}" for n, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:15]]
    text = "\n".join(lines)
    Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
