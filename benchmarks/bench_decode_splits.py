"""Decode attention over workload A's real context mixes, per split count (issue 5's tuning of the split heuristic).

The kernel table (``bench_kernels.py``) times equal context lengths. Workload A's decode steps are not like that:
at step t the live sequences are those with more than t output tokens, each at its own prompt length + t, so
between 32 and 200 sequences one (sequence, KV head) program may stream 3x the tokens of another. This script
rebuilds those mixes from the workload's own random draws (``workload_a``), takes snapshots at several live-batch
sizes and times one layer's decode attention (also with the batch sorted longest first, the order the
hardware then starts the programs in, and with every context at the mean length, which has the same bytes) (CUDA-graph replay, cold L2) for every split count, reporting
achieved bandwidth against BENCHMARKS.md's 4.22 TB/s and the heuristic's pick.

    python benchmarks/bench_decode_splits.py                 # qwen3-0.6b heads (16/8, D=128)
    python benchmarks/bench_decode_splits.py --heads 32/8/64 # llama-3.2-1b heads
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_kernels import DEV, DT, PEAK_BW, bench_graph, kv_bytes, paged_cache, quantized_cache  # noqa: E402
from minfer.benchmark.workload import workload_a  # noqa: E402
from minfer.kernels.attention.decode_attention import (  # noqa: E402
    DecodeConfig, choose_num_splits, paged_decode_attention, paged_decode_attention_ref,
)

PAGE = 16


def snapshots(batches: list[int], max_model_len: int = 4096) -> list[tuple[int, list[int]]]:
    """(decode step, context lengths of the live sequences) at the first step with at most each batch size."""
    prompts, params = workload_a()
    plen = [len(p["prompt_token_ids"]) for p in prompts]
    olen = [p.max_tokens for p in params]
    out = []
    for want in batches:
        for t in range(max(olen)):
            live = [i for i in range(len(plen)) if olen[i] > t]
            if len(live) <= want:
                out.append((t, [min(plen[i] + t + 1, max_model_len) for i in live]))
                break
    return out


def parse_config(text: str) -> DecodeConfig:
    """``BLOCK_N/WARPS/STAGES[/COLUMN_SUMS]`` → DecodeConfig (column sums: 0 or 1)."""
    parts = [int(v) for v in text.split("/")]
    return DecodeConfig(*parts[:3], column_sums=bool(parts[3]) if len(parts) > 3 else False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="16/8/128", help="Hq/Hkv/D")
    ap.add_argument("--batches", default="256,192,128,96,64,48,32,16")
    ap.add_argument("--splits", default="1,2,3,4,6,8")
    ap.add_argument("--mixes", default="as-is", help="comma list of as-is (the batch's order), longest-first "
                    "(sorted by length, descending), equal (every context at the mean length)")
    ap.add_argument("--configs", default="default",
                    help="comma list of default or BLOCK_N/WARPS/STAGES[/COLUMN_SUMS 0|1]")
    ap.add_argument("--kv-dtype", default="auto", help="auto (bf16) or an 8-bit format: int8, fp8_e4m3, fp8_e5m2")
    ap.add_argument("--equal", default="", help="B x ctx, e.g. 64x4096: equal contexts instead of workload A's")
    args = ap.parse_args()
    configs = [None if c == "default" else parse_config(c) for c in args.configs.split(",")]
    hq, hkv, d = (int(v) for v in args.heads.split("/"))
    width = 4096 // PAGE  # the engine's block table width at max_model_len 4096 (what the heuristic sees)
    heads = [f"{c}, {s} split{'s' * (s > 1)}" for c in args.configs.split(",") for s in map(int, args.splits.split(","))]
    print("| live seqs | step | context min / mean / max | heuristic | " + " | ".join(heads) + " |")
    print("|---" * (4 + len(heads)) + "|")
    cases = snapshots([int(b) for b in args.batches.split(",")])
    if args.equal:
        b, c = (int(v) for v in args.equal.split("x"))
        cases = [(0, [c] * b)]
    for step, live in cases:
        for mix in args.mixes.split(","):
            lens = {"as-is": live, "longest-first": sorted(live, reverse=True),
                    "equal": [sum(live) // len(live)] * len(live)}[mix]
            cells = [time_splits(lens, hq, hkv, d, width, s, cfg, args.kv_dtype) for cfg in configs
                     for s in map(int, args.splits.split(","))]
            pick = choose_num_splits(len(lens), hkv, width * PAGE, torch.device(DEV))
            print(f"| {len(lens)} | {step} | {mix}: {min(lens)} / {sum(lens) // len(lens)} / {max(lens)} | {pick} | "
                  + " | ".join(cells) + " |", flush=True)


def time_splits(lens: list[int], hq: int, hkv: int, d: int, width: int, splits: int,
                config: DecodeConfig | None, kv_dtype: str = "auto") -> str:
    """One layer's decode attention over contexts ``lens`` with ``splits`` splits: time and share of bandwidth."""
    kc, vc, table, ctx = paged_cache(lens, hkv, d, PAGE)
    table = torch.nn.functional.pad(table, (0, max(0, width - table.shape[1])))
    q = torch.randn(len(lens), hq, d, device=DEV, dtype=DT)
    out = torch.empty_like(q)
    ref = paged_decode_attention_ref(q, kc, vc, table, ctx, d ** -0.5)
    scales = {}
    if kv_dtype != "auto":
        kc, vc, ks, vs = quantized_cache(kc, vc, kv_dtype)
        scales = {"k_scale": ks, "v_scale": vs}
    fn = lambda: paged_decode_attention(q, kc, vc, table, ctx, d ** -0.5, out, num_splits=splits, config=config,
                                        **scales)
    fn()
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    ms = bench_graph(fn, rep=100)
    share = kv_bytes(sum(lens), hkv, d, kv_dtype) / (ms * 1e-3) / PEAK_BW
    return f"{ms * 1e3:.1f} us, {100 * share:.0f}%" + (" FAIL" if err > (1e-2 if kv_dtype == "auto" else 6e-2) else "")

if __name__ == "__main__":
    main()
