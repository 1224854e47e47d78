"""Batch-1 matrix-vector kernels timed as the decode step runs them: a chain of every layer's four projections.

A matrix-vector kernel timed alone pays its own launch and ramp-up and, under programmatic dependent launch
(PDL), hides none of it behind the previous kernel, so single-kernel timings rank configs wrongly (a config
can win alone and lose in the engine; RESULTS.md has the case). Here one CUDA graph holds all layers' qkv (+ RMSNorm
prologue), o, gate_up (+ RMSNorm) and down (+ SwiGLU) launches on distinct weights (1.95 GB for llama-3.2-1b,
far beyond L2), and each config of one projection is timed with the other three at their defaults: a change
in the chain's time is that projection's change. The best config per projection is then timed together and
written to ``--json`` (``dev/batch1_sweep.py --gemv-json`` runs the engine with it).

    python benchmarks/gemv_chain.py --shape llama-3.2-1b --json /tmp/gemv_best.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from batch1 import median_replay_us  # noqa: E402  (this folder)
from minfer.benchmark.bounds import HBM_BYTES_PER_S  # noqa: E402
from minfer.benchmark.shapes import SHAPES  # noqa: E402
from minfer.kernels._utils import next_pow2  # noqa: E402
from minfer.kernels.gemm import gemv as gm  # noqa: E402
from minfer.kernels.gemm.gemv_config import PLAIN, RMS_NORM, SILU_MUL, GemvConfig, default_config  # noqa: E402

OPS = ("qkv", "o", "gate_up", "down")


def op_shapes(shape: str) -> dict[str, tuple[int, int, int]]:
    """op -> (N, K, prologue) of one decoder layer."""
    c = SHAPES[shape]
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return {"qkv": (q + 2 * kv, h, RMS_NORM), "o": (h, q, PLAIN), "gate_up": (2 * i, h, RMS_NORM),
            "down": (h, i, SILU_MUL)}


class Chain:
    def __init__(self, shape: str, layers: int | None) -> None:
        self.shapes = op_shapes(shape)
        c = SHAPES[shape]
        self.layers = layers or c["num_hidden_layers"]
        self.eps = c["rms_norm_eps"]
        dev, dt = "cuda", torch.bfloat16
        self.w = [{op: torch.randn(n, k, device=dev, dtype=dt) * 0.02 for op, (n, k, _) in self.shapes.items()}
                  for _ in range(self.layers)]
        h = c["hidden_size"]
        self.nw = torch.ones(h, device=dev, dtype=dt)
        self.x = torch.randn(1, h, device=dev, dtype=dt)
        self.res = torch.randn(1, h, device=dev, dtype=dt)
        self.attn = torch.randn(1, self.shapes["o"][1], device=dev, dtype=dt)  # stands in for attention's output
        self.bytes = sum(t.numel() * t.element_size() for layer in self.w for t in layer.values())

    def run(self, cfgs: dict[str, GemvConfig]) -> torch.Tensor:
        x, res = self.x, self.res
        for w in self.w:
            _, res = gm.gemv_rms_norm(x, res, self.nw, self.eps, w["qkv"], config=cfgs["qkv"])
            o = gm.gemv(self.attn, w["o"], config=cfgs["o"])
            gate_up, res = gm.gemv_rms_norm(o, res, self.nw, self.eps, w["gate_up"], config=cfgs["gate_up"])
            x = gm.gemv_silu_mul(gate_up, w["down"], config=cfgs["down"])
        return x

    def time_us(self, cfgs: dict[str, GemvConfig], reps: int = 60) -> float:
        self.run(cfgs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.run(cfgs)
        for _ in range(5):
            graph.replay()
        us = median_replay_us(graph, reps)
        del graph
        return us


def candidates(k: int) -> list[GemvConfig]:
    """Rows x columns x warps x the K loop's pipelining depth (above 1 Triton copies the chunks ahead into shared
    memory: gemv_config.STREAM_STAGES)."""
    widths = sorted({min(w, next_pow2(k)) for w in (512, 1024, 2048)})
    return [GemvConfig(bn, bk, warps, stages) for bn, bk, warps, stages in
            itertools.product((2, 4, 8), widths, (4, 8), (1, 2, 3))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    chain = Chain(args.shape, args.layers)
    base = {op: default_config(n, k, p) for op, (n, k, p) in chain.shapes.items()}
    ideal = chain.bytes / HBM_BYTES_PER_S * 1e6
    base_us = chain.time_us(base)
    print(f"{args.shape}: {chain.layers} layers, {chain.bytes / 1e9:.2f} GB, ideal {ideal:.0f} us at "
          f"{HBM_BYTES_PER_S / 1e12:.2f} TB/s; defaults {base_us:.1f} us ({ideal / base_us:.1%})", flush=True)
    best = dict(base)
    for op in filter(None, args.ops.split(",")):
        n, k, _ = chain.shapes[op]
        results = []
        for cfg in candidates(k):
            us = chain.time_us({**base, op: cfg})
            results.append((us, cfg))
            print(f"  {op} {n}x{k} {cfg}: chain {us:.1f} us ({us - base_us:+.1f})", flush=True)
        us, cfg = min(results, key=lambda r: r[0])
        best[op] = cfg
        print(f"BEST {op}: {cfg} chain {us:.1f} us ({us - base_us:+.1f})", flush=True)
    best_us = chain.time_us(best)  # the defaults again after the sweep: the machine drifts
    again = chain.time_us(base)
    print(f"all best: {best_us:.1f} us ({ideal / best_us:.1%} of bandwidth) vs defaults {again:.1f} us "
          f"({ideal / again:.1%})", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {op: {"shape": list(chain.shapes[op]), "config": vars(best[op])} for op in chain.shapes}, indent=1))


if __name__ == "__main__":
    main()
