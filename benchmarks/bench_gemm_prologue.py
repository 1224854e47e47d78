"""The decode step's projections at M rows, as the step runs them: every layer's qkv, o, gate_up and down in one CUDA
graph on distinct weights, the unfused layout (the norm kernel with its residual add, then cuBLAS; the SwiGLU kernel,
then cuBLAS) against the prologue GEMMs (``kernels/gemm/gemm_prologue.py``: the norm in qkv's and gate_up's launch,
SwiGLU in down's; o plain, by cuBLAS or by the same kernel). Each candidate config of one projection is timed in the
whole chain with the others at their defaults (a config can win alone and lose in the chain, ``gemv_chain.py``).

    python benchmarks/bench_gemm_prologue.py --shape qwen3-0.6b --rows 64,128,256 [--sweep] [--json best.json]

Prints a markdown table per M: the chain in µs for each layout, and per projection the best config found.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from batch1 import median_replay_us  # noqa: E402
from minfer.benchmark.shapes import SHAPES  # noqa: E402
from minfer.kernels.activation import silu_and_mul  # noqa: E402
from minfer.kernels.gemm.gemm_prologue import GemmConfig, default_config, gemm_rms_norm, gemm_rows, gemm_silu_mul  # noqa: E402
from minfer.kernels.rmsnorm import fused_add_rms_norm  # noqa: E402

OPS = ("qkv", "o", "gate_up", "down")


def candidates(m: int) -> list[GemmConfig]:
    bms = sorted({max(16, min(64, 1 << (m - 1).bit_length())), 64} | ({128} if m >= 128 else set()))
    out = []
    for bm in bms:
        for bn, bk, warps, stages in ((64, 64, 4, 3), (64, 128, 4, 3), (32, 64, 4, 4), (64, 64, 4, 4),
                                      (128, 64, 8, 3), (128, 128, 8, 3), (64, 128, 8, 4)):
            if bm == 128 and bn == 32:
                continue
            out.append(GemmConfig(bm, bn, bk, warps, stages))
    return out


class Chain:
    def __init__(self, shape: str, rows: int, layers: int | None) -> None:
        c = SHAPES[shape]
        h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
        q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
        self.shapes = {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i)}
        self.layers, self.eps, self.rows = layers or c["num_hidden_layers"], c["rms_norm_eps"], rows
        dev, dt = "cuda", torch.bfloat16
        self.w = [{op: torch.randn(n, k, device=dev, dtype=dt) * 0.02 for op, (n, k) in self.shapes.items()}
                  for _ in range(self.layers)]
        self.nw = torch.ones(h, device=dev, dtype=dt)
        self.x = torch.randn(rows, h, device=dev, dtype=dt)
        self.res = torch.randn(rows, h, device=dev, dtype=dt)
        self.res_inplace = self.res.clone()
        self.attn = torch.randn(rows, q, device=dev, dtype=dt)  # stands in for attention's output
        self.gate_up = torch.randn(rows, 2 * i, device=dev, dtype=dt)

    def unfused(self, _cfgs: dict | None = None) -> None:
        # The residual is updated in place, as the engine's norm does (no copy launch the engine does not make); it
        # grows by x at each call over the replays, which changes no timing and stays far from bfloat16's range.
        res = self.res_inplace
        for w in self.w:
            F.linear(fused_add_rms_norm(self.x, res, self.nw, self.eps), w["qkv"])
            F.linear(self.attn, w["o"])
            F.linear(fused_add_rms_norm(self.x, res, self.nw, self.eps), w["gate_up"])
            F.linear(silu_and_mul(self.gate_up), w["down"])

    def fused(self, cfgs: dict[str, GemmConfig | None]) -> None:
        for w in self.w:
            _, res = gemm_rms_norm(self.x, self.res, self.nw, self.eps, w["qkv"], config=cfgs["qkv"])
            if cfgs.get("o") is None:
                F.linear(self.attn, w["o"])
            else:
                gemm_rows(self.attn, w["o"], config=cfgs["o"])
            gemm_rms_norm(self.x, res, self.nw, self.eps, w["gate_up"], config=cfgs["gate_up"])
            gemm_silu_mul(self.gate_up, w["down"], config=cfgs["down"])

    def time_us(self, fn, cfgs: dict | None = None, reps: int = 50) -> float:
        fn(cfgs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(cfgs)
        for _ in range(3):
            graph.replay()
        us = median_replay_us(graph, reps)
        del graph
        return us / self.layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--rows", default="64,128,256")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--sweep", action="store_true", help="time each projection's candidate configs in the chain")
    ap.add_argument("--json", default=None, help="append the best configs per M to this file")
    args = ap.parse_args()
    best_all = {}
    print(f"## {args.shape}: µs a layer (qkv + o + gate_up + down and their norms / SwiGLU), one CUDA graph\n")
    print("| M | unfused (norm + cuBLAS) | prologue GEMMs, defaults, o by cuBLAS | o by the GEMM too | "
          "best configs | best / unfused |\n|---|---|---|---|---|---|")
    for m in map(int, args.rows.split(",")):
        chain = Chain(args.shape, m, args.layers)
        base = {op: default_config(m, *chain.shapes[op], 0) for op in OPS}
        base["o"] = None
        unfused = chain.time_us(chain.unfused)
        fused = chain.time_us(chain.fused, base)
        o_gemm = chain.time_us(chain.fused, {**base, "o": default_config(m, *chain.shapes["o"], 0)})
        best = dict(base)
        if args.sweep:
            for op in OPS:
                results = [(fused if op != "o" else min(fused, o_gemm), base[op] if op != "o" else None)]
                for cfg in candidates(m):
                    try:
                        results.append((chain.time_us(chain.fused, {**base, op: cfg}), cfg))
                    except Exception as e:  # noqa: BLE001 (a config past the shared memory: reported, skipped)
                        print(f"  {op} {cfg}: {type(e).__name__} {str(e)[:80]}", file=sys.stderr)
                best[op] = min(results, key=lambda r: r[0])[1]
                print(f"  M={m} {op}: best {best[op]} {min(r[0] for r in results):.2f} µs/layer", file=sys.stderr)
        best_us = chain.time_us(chain.fused, best)
        again = chain.time_us(chain.unfused)  # the machine drifts: the baseline again after the sweep
        names = ", ".join(f"{op} {tuple(vars(c).values()) if c else 'cuBLAS'}" for op, c in best.items())
        print(f"| {m} | {unfused:.2f} / {again:.2f} | {fused:.2f} | {o_gemm:.2f} | {best_us:.2f} ({names}) | "
              f"{best_us / min(unfused, again):.3f} |", flush=True)
        best_all[m] = {op: (vars(c) if c else None) for op, c in best.items()}
        del chain
        torch.cuda.empty_cache()
    if args.json:
        path = Path(args.json)
        data = json.loads(path.read_text()) if path.exists() else {}
        data[args.shape] = best_all
        path.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
