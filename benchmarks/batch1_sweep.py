"""Batch-1 decode speed under launch-config variants, in one process (issue 5's batch-1 target).

A kernel's config only shows its worth inside the decode chain: under programmatic dependent launch (PDL) a
matrix-vector kernel streams its first weight tile while the previous kernel still runs, which a kernel timed
alone cannot show. So each variant here patches the config functions, builds a fresh engine (its CUDA graphs
are captured with the patched configs) and runs ``minfer bench --batch1``'s measurement on the same checkpoint.

    python benchmarks/batch1_sweep.py --shape llama-3.2-1b [--variants base,first2k] [--output-len 256]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minfer import LLM  # noqa: E402
from minfer.benchmark.offline import run_batch1  # noqa: E402
from minfer.benchmark.shapes import write_random_checkpoint  # noqa: E402
from minfer.kernels import decode_attention, gemv  # noqa: E402

_BASE_GEMV = gemv.default_config


def _gemv_first(first: int, first_down: int = 0, down_warps: int | None = None) -> Callable:
    """gemv configs whose first (pre-wait) tile is ``first`` columns wide (``first_down`` under SwiGLU)."""
    def config(k: int, silu_prologue: bool = False) -> gemv.GemvConfig:
        base = _BASE_GEMV(k, silu_prologue)
        if silu_prologue:
            return gemv.GemvConfig(base.block_n, base.block_k, down_warps or base.num_warps, first_down or first)
        return gemv.GemvConfig(base.block_n, base.block_k, base.num_warps, first)
    return config


# name -> (gemv default_config, decode MIN_SPLIT_TOKENS)
VARIANTS: dict[str, tuple[Callable, int]] = {
    "base": (_BASE_GEMV, decode_attention.MIN_SPLIT_TOKENS),
    "first2k": (_gemv_first(2048), decode_attention.MIN_SPLIT_TOKENS),
    "first2k_down4k": (_gemv_first(2048, 4096), decode_attention.MIN_SPLIT_TOKENS),
    "first2k_down8k": (_gemv_first(2048, 8192, 8), decode_attention.MIN_SPLIT_TOKENS),
    "splits8": (_BASE_GEMV, 512),
    "splits4": (_BASE_GEMV, 1024),
    "first2k_splits4": (_gemv_first(2048), 1024),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--checkpoint-dir", default="/tmp/minfer-checkpoints")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = str(write_random_checkpoint(args.shape, Path(args.checkpoint_dir) / args.shape, device="cuda"))
    results = {}
    for name in args.variants.split(","):
        gemv_config, min_split = VARIANTS[name]
        gemv.default_config = gemv_config
        decode_attention.MIN_SPLIT_TOKENS = min_split
        llm = LLM(model, skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=8)
        r = run_batch1(llm, args.input_len, args.output_len)
        results[name] = r
        print(f"| {name} | {r['decode_tok_s']:,.1f} tok/s | {100 * r['share_of_bound']:.1f}% of "
              f"{r['bound_tok_s']:,.0f} |", flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
