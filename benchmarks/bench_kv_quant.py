"""Quantized KV cache: capacity per format (any machine) and accuracy of the built-in model (CPU).

    python benchmarks/bench_kv_quant.py capacity [--budget-gib 8]
    python benchmarks/bench_kv_quant.py accuracy [--every 1] [--scale-dtypes float16,float32]

``capacity``: per benchmark shape and format, the bytes of one 16-token block (K and V, all
layers, scales included), how many blocks and how many concurrent sequences a fixed KV budget
holds. Pure arithmetic on ``KVCacheSpec``: what the engine allocates.

``accuracy``: the built-in model in float32 on the CPU (torch attention path), its KV cache stored
in each format. Perplexity over the held-out files (``minfer.train.corpus.heldout_files()``, every
``--every``-th file), cut into windows exactly as ``minfer eval-ppl`` does and scored with the same
formula; teacher-forced next-token agreement with 'auto' (argmax at every scored position); and
greedy agreement with 'auto' on a fixed prompt set (64 new tokens after 64 tokens taken from the
middle of each of the first 40 held-out files). The GPU measurements: benchmarks/bench_kv_quant.sh.
Results: benchmarks/RESULTS.md, "Quantized KV cache".
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minfer.config import KV_CACHE_DTYPES, cdiv  # noqa: E402
from minfer.model.registry import model_config  # noqa: E402
from minfer.engine.kv_cache import KVCacheSpec  # noqa: E402

FORMATS = list(KV_CACHE_DTYPES)
WORKLOAD_A_MEAN_TOKENS = 1081  # (142,827 prompt + 133,966 output) / 256 requests (BENCHMARKS.md)


def capacity(budget_gib: float, block_size: int = 16) -> str:
    """Rows per shape: bf16 ('auto' on a GPU), then the 8-bit formats (same size) with float16 and
    float32 scales, the scale dtype being the one design choice that changes the block size."""
    import minfer.engine.kv_cache as kv_cache
    from minfer.benchmark.shapes import SHAPES

    budget = int(budget_gib * 2**30)
    lines = [f"KV budget {budget_gib:g} GiB, block_size {block_size}; 'auto' = bfloat16 (the shapes' dtype).", "",
             "| shape | format | scales | bytes / block | blocks | tokens | seqs of 4,096 | seqs of 1,081 "
             "(workload A mean) | blocks × bf16 |", "|---|---|---|---|---|---|---|---|---|"]
    chosen = kv_cache.KV_SCALE_DTYPE
    for shape, cfg in SHAPES.items():
        mc = model_config(cfg)
        base = None
        for fmt, sd in [("auto", None), ("int8", torch.float16), ("int8", torch.float32)]:
            kv_cache.KV_SCALE_DTYPE = sd
            spec = KVCacheSpec.for_model(mc, block_size, torch.bfloat16, fmt)
            blocks = budget // spec.block_bytes
            base = base or blocks
            name = "bfloat16" if fmt == "auto" else "int8 / fp8_e4m3 / fp8_e5m2"
            scales = "-" if sd is None else str(sd).removeprefix("torch.") + (" (chosen)" if sd == chosen else "")
            seqs_4k, seqs_a = blocks // cdiv(4096, block_size), blocks // cdiv(WORKLOAD_A_MEAN_TOKENS, block_size)
            lines.append(f"| {shape} | {name} | {scales} | {spec.block_bytes:,} | {blocks:,} | {blocks * block_size:,} "
                         f"| {seqs_4k:,} | {seqs_a:,} | {blocks / base:.3f} |")
    kv_cache.KV_SCALE_DTYPE = chosen
    return "\n".join(lines)


def _greedy_prompts(files: list[Path], tok, n: int = 40, length: int = 64) -> list[list[int]]:
    prompts = []
    for f in files:
        ids = tok.encode(f.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= 4 * length:
            mid = len(ids) // 2
            prompts.append(ids[mid:mid + length])
        if len(prompts) == n:
            break
    return prompts


def _run_format(fmt: str, files: list[Path], prompts: list[list[int]], new_tokens: int) -> dict:
    from minfer import LLM, SamplingParams
    from minfer.eval_ppl import text_windows

    llm = LLM(kv_cache_dtype=fmt, kv_cache_memory_bytes=512 << 20, device="cpu", dtype="float32")
    t0 = time.perf_counter()
    windows = text_windows(llm, files, llm.llm_engine.max_model_len - 1)  # eval-ppl's default window
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0, ignore_eos=True), use_tqdm=False)
    nll, count, top1 = 0.0, 0, []
    for w, out in zip(windows, outs):
        for pos in range(1, len(w)):
            entry = out.prompt_logprobs[pos]
            nll -= entry[w[pos]]  # the same sum as minfer.eval_ppl.evaluate_perplexity
            count += 1
            top1.append(max(entry, key=entry.get))
    gen = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    return dict(ppl=math.exp(nll / count), tokens=count, windows=len(windows), top1=top1,
                greedy=[o.outputs[0].token_ids for o in gen], seconds=time.perf_counter() - t0,
                stats=llm.get_stats())


def _agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float, float]:
    """(share of positions with equal tokens, mean share of tokens before the first difference,
    share of sequences equal throughout)."""
    same = sum(x == y for sa, sb in zip(a, b) for x, y in zip(sa, sb)) / sum(map(len, b))
    prefix = []
    for sa, sb in zip(a, b):
        k = next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), len(sb))
        prefix.append(k / len(sb))
    return same, sum(prefix) / len(prefix), sum(p == 1.0 for p in prefix) / len(prefix)


def accuracy(every: int, scale_dtypes: list[str], cache_dir: Path | None, new_tokens: int = 64) -> str:
    """The table; with ``cache_dir``, each (format, scale dtype, subset) run is kept there as JSON and
    reused, so an interrupted measurement resumes and a second scale dtype reuses 'auto'."""
    import json

    import minfer.engine.kv_cache as kv_cache
    from minfer.train.corpus import heldout_files
    from transformers import AutoTokenizer

    from minfer.llm import builtin_model_path

    torch.set_num_threads(2)
    all_files = heldout_files()
    files = all_files[::every]
    prompts = _greedy_prompts(all_files, AutoTokenizer.from_pretrained(str(builtin_model_path())))
    runs: list[tuple[str, str, dict]] = []
    for sd in scale_dtypes:
        kv_cache.KV_SCALE_DTYPE = getattr(torch, sd)
        for fmt in FORMATS:
            if fmt == "auto" and runs:
                continue
            key = cache_dir / f"{fmt}-{'auto' if fmt == 'auto' else sd}-every{every}.json" if cache_dir else None
            if key is not None and key.is_file():
                r = json.loads(key.read_text())
            else:
                r = _run_format(fmt, files, prompts, new_tokens)
                if key is not None:
                    cache_dir.mkdir(parents=True, exist_ok=True)
                    key.write_text(json.dumps(r))
            runs.append((fmt, "-" if fmt == "auto" else sd, r))
            print(f"  {fmt} scales {sd}: ppl {r['ppl']:.4f} over {r['tokens']} tokens, {r['seconds']:.0f} s",
                  flush=True)
    base = runs[0][2]
    lines = [f"Held-out files: {len(files)} of {len(all_files)} (every {every}th, sorted), {base['tokens']:,} tokens "
             f"scored in {base['windows']} windows of <= 1,023; greedy: {len(prompts)} prompts x {new_tokens} tokens.",
             "", "| kv_cache_dtype | scales | perplexity | vs auto | next-token argmax = auto | greedy tokens = auto "
             "(same position) | greedy prefix before first difference | greedy sequences identical | bytes / block |",
             "|---|---|---|---|---|---|---|---|---|"]
    for fmt, sd, r in runs:
        top1 = sum(x == y for x, y in zip(r["top1"], base["top1"])) / len(base["top1"])
        same, prefix, whole = _agreement(r["greedy"], base["greedy"])
        delta = 100 * (r["ppl"] / base["ppl"] - 1)
        lines.append(f"| {fmt} | {sd} | {r['ppl']:.4f} | {delta:+.2f}% | {100 * top1:.2f}% | {100 * same:.1f}% "
                     f"| {100 * prefix:.1f}% | {100 * whole:.0f}% | {r['stats']['kv_block_bytes']:,} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    cap = sub.add_parser("capacity")
    cap.add_argument("--budget-gib", type=float, default=8.0)
    acc = sub.add_parser("accuracy")
    acc.add_argument("--every", type=int, default=1, help="score every n-th held-out file (1: all)")
    acc.add_argument("--scale-dtypes", default="float16", help="comma list of scale dtypes to compare")
    acc.add_argument("--cache-dir", type=Path, default=None, help="keep / reuse each run's results here")
    args = ap.parse_args()
    if args.cmd == "capacity":
        print(capacity(args.budget_gib))
    else:
        print(accuracy(args.every, args.scale_dtypes.split(","), args.cache_dir))


if __name__ == "__main__":
    main()
