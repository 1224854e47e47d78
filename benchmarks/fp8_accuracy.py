"""Held-out perplexity of the built-in model with FP8 weights (online, per channel) against float32.

The whole held-out set (``minfer.train.corpus.heldout_files()``), windows and sums as ``minfer eval-ppl``;
on the CPU the FP8 layers run the reference path (weights dequantized, activations rounded to e4m3 per
token, float32 products): the arithmetic of the GPU kernels up to summation order.

    python3 benchmarks/fp8_accuracy.py [--files N]     # ~8 CPU-minutes per variant on 2 cores
"""
from __future__ import annotations

import argparse
import time

from minfer import LLM
from minfer.eval_ppl import evaluate_perplexity
from minfer.train.corpus import heldout_files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=None, help="only the first N held-out files")
    args = parser.parse_args()
    files = heldout_files()[:args.files] if args.files else heldout_files()
    rows = []
    for quantization in (None, "fp8"):
        started = time.perf_counter()
        llm = LLM(quantization=quantization, skip_tokenizer_init=False)
        result = evaluate_perplexity(llm, files)
        rows.append((quantization or "none (float32)", result, time.perf_counter() - started,
                     llm.get_stats()["weight_bytes"]))
    base = rows[0][1].perplexity
    print(f"built-in model, {len(files)} held-out files, {rows[0][1].num_tokens_scored:,} tokens scored")
    print("| weights | perplexity | vs float32 | weight bytes | seconds |")
    print("|---|---:|---:|---:|---:|")
    for name, result, seconds, nbytes in rows:
        ppl = result.perplexity
        print(f"| {name} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f}% | {nbytes:,} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
