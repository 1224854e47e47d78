"""Batch-1 decode speed under launch-config variants and kernel knock-outs (``benchmarks/batch1.py`` is the
plain measurement).

A launch config only shows its worth inside the decode chain: under programmatic dependent launch (PDL) each
kernel overlaps the previous one's tail, which a kernel timed alone cannot show. So each variant here patches the
module constants, builds a fresh engine (its CUDA graphs are captured with them) and runs ``minfer bench
--batch1``'s measurement on the same checkpoint. Run one variant per process (``gpu_tuning.sh`` does).

    python dev/batch1_sweep.py --shape llama-3.2-1b --variants splits4 [--input-len 2048]
    python dev/batch1_sweep.py --variants base,gemv,base,gemv --gemv-json /tmp/gemv_best.json

``gemv`` runs the matrix-vector configs ``gemv_chain.py --json`` picked; ``skip_rope``, ``skip_merge`` and
``skip_attn`` leave a kernel out of the graph, to price it inside the chain; ``dBN_W_S`` runs the
decode split kernel with BLOCK_N tokens per tile, W warps, S stages (``d32_4_1``). Each run also times
replays of the batch-1 decode graph (the step's GPU time, without the host).
"""
from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import sys
from pathlib import Path
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

from minfer import LLM  # noqa: E402
from minfer.benchmark.offline import run_batch1  # noqa: E402
from minfer.benchmark.shapes import write_random_checkpoint  # noqa: E402
from minfer.kernels.attention import decode_attention  # noqa: E402
from minfer.kernels.gemm import gemv as gm  # noqa: E402  (its default_config is what a variant replaces)
from minfer.kernels.gemm.gemv_config import GemvConfig  # noqa: E402

from batch1 import median_replay_us  # noqa: E402  (benchmarks/)

# name -> decode MIN_SPLIT_TOKENS (the engine's split count at batch 1 is the block table's width over it:
# 16 at max_model_len 4096 by default)
SPLIT_VARIANTS: dict[str, int] = {"splits1": 1 << 20, "splits2": 2048, "splits4": 1024, "splits8": 512, "splits32": 128}


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


# Knock-outs (timing only: the tokens they produce are wrong): name -> (module, attribute, stand-in). The graph
# time without a kernel, against ``base``, is what that kernel costs inside the chain (PDL overlap included).
KNOCKOUTS = {
    "skip_rope": ("minfer.ops.triton_ops", "rope_store_kv", lambda *a, **k: None),
    "skip_merge": ("minfer.kernels.attention.decode_attention", "_decode_merge_kernel", _NoLaunch()),
    "skip_attn": ("minfer.ops.triton_ops", "paged_decode_attention", lambda q, *a, out=None, **k: out),
}


def decode_rule(name: str, default):
    """A ``decode_attention.default_config`` stand-in for a variant ``dBN_W_S`` (16-bit caches get that split-kernel
    config: tile, warps, stages), or None."""
    if not (name.startswith("d") and name[1:2].isdigit()):
        return None
    block_n, warps, stages = (int(v) for v in name[1:].split("_"))
    cfg = decode_attention.DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages)
    return lambda device, head_dim, dtype, cache_dtype=None: cfg if cache_dtype is None else default(
        device, head_dim, dtype, cache_dtype)


def knock_out(name: str):
    """Apply the knock-out ``name``; returns a function that undoes it."""
    module, attr, stand_in = KNOCKOUTS[name]
    owner = importlib.import_module(module)
    old = getattr(owner, attr)
    setattr(owner, attr, stand_in)
    return lambda: setattr(owner, attr, old)


def gemv_rule(name: str, default, json_path: str | None):
    """A ``gemv.default_config`` stand-in per variant name (None: leave the module's own)."""
    if name == "gemv":  # the configs gemv_chain.py --json picked, for the shapes it tuned
        table = {tuple(v["shape"]): GemvConfig(**v["config"])
                 for v in json.loads(Path(json_path).read_text()).values()}
        return lambda n, k, prologue=0: table.get((n, k, prologue)) or default(n, k, prologue)
    return None


def graph_step_us(llm: LLM, reps: int = 300) -> float:
    """Median GPU time of one replay of the batch-1 decode graph, as the last step left its inputs: the step's
    device time without the host, steadier than tokens per second over a 512-token run."""
    return median_replay_us(llm.llm_engine.runner.graphs.graphs[1], reps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--checkpoint-dir", default="/tmp/minfer-checkpoints")
    ap.add_argument("--variants", default="base," + ",".join(SPLIT_VARIANTS),
                    help="comma list of base, splitsN, gemv, skip_*, dBN_W_S (repeat a name to alternate)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--gemv-json", default=None, help="gemv_chain.py's output, for the gemv variant")
    args = ap.parse_args()
    model = str(write_random_checkpoint(args.shape, Path(args.checkpoint_dir) / args.shape, device="cuda"))
    results: dict[str, list] = {}
    default_gemv, default_splits = gm.default_config, decode_attention.MIN_SPLIT_TOKENS
    default_decode = decode_attention.default_config
    for name in args.variants.split(","):
        decode_attention.MIN_SPLIT_TOKENS = SPLIT_VARIANTS.get(name, default_splits)
        gm.default_config = gemv_rule(name, default_gemv, args.gemv_json) or default_gemv
        decode_attention.default_config = decode_rule(name, default_decode) or default_decode
        undo = knock_out(name) if name in KNOCKOUTS else (lambda: None)
        llm = LLM(model, skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=8)
        r = run_batch1(llm, args.input_len, args.output_len)
        r["graph_step_us"] = round(graph_step_us(llm), 2)
        undo()
        results.setdefault(name, []).append(r)
        print(f"| {name} | {r['decode_tok_s']:,.1f} tok/s | {100 * r['share_of_bound']:.1f}% of "
              f"{r['bound_tok_s']:,.0f} | graph replay {r['graph_step_us']:.1f} us/step "
              f"({1e6 / r['graph_step_us'] / r['bound_tok_s']:.1%} of the bound) |", flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
