"""Channel FP8 GEMMs at decode batch sizes: cuBLASLt's row-wise ``_scaled_mm`` against the split-K Triton kernel
(``kernels/gemm/splitk_gemm.py``: its rule's pick and the best of a candidate grid), with bf16 ``torch.mm`` for
scale, at llama-3.1-8b's four projections and M = 4..256 rows (workload A's decode steps, small batches).

Each variant is checked against its reference before it is timed; times are medians of CUDA-graph replays with L2
flushed before each (``bench_kernels.bench_graph``: the weights come from HBM, as in a step). The last tables sum a
layer's four projections per M and list every candidate, fastest first.

    python benchmarks/bench_decode_gemm.py [--ms 4,16,64] [--out decode_gemm.md]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_kernels import bench_graph  # noqa: E402
from minfer.kernels._utils import num_sms  # noqa: E402
from minfer.kernels.gemm import fp8_gemm as fg  # noqa: E402
from minfer.kernels.gemm import splitk_gemm as fs  # noqa: E402
from minfer.kernels.quant import fp8_quant as fq  # noqa: E402
from minfer.kernels.quant import fp8_ref as fr  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# block_m, block_n, warps; 16- and 32-row tiles (mma.sync, no rows wasted) only where M fits them
TILES = [(16, 64, 4), (16, 128, 4), (32, 64, 4), (64, 32, 4), (64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8)]
SPLITS = [1, 2, 3, 4, 6]


def us(fn) -> float:
    return bench_graph(fn) * 1e3


def candidates(m: int, stages: list[int]) -> set[fs.SplitKConfig]:
    """The grid: tiles x splits x pipeline depths, 128-row tiles only past 64 rows, tiles under 64 rows only for M
    within them."""
    return {fs.SplitKConfig(bm, bn, s, num_warps=w, num_stages=st)
            for bm, bn, w in TILES for s in SPLITS for st in stages
            if not (bm == 128 and m <= 64) and not (bm < 64 and m > bm)}


def label(c: fs.SplitKConfig) -> str:
    return f"{c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages} split {c.split}" + (" fast" if c.fast_accum else "")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="4,16,32,64,96,128,256")
    ap.add_argument("--stages", default="4", help="pipeline depths of the candidate grid, comma list")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    stages = [int(s) for s in args.stages.split(",")]
    sms = num_sms(torch.device("cuda"))
    base = "cuBLAS fp8"
    lines = [f"{torch.cuda.get_device_name()}, {sms} SMs; µs (TFLOP/s)",
             f"| proj | M | bf16 mm | {base} | split-K auto | auto config | best candidate | best config "
             "| cuBLAS / auto | cuBLAS / best |", "|---|---|---|---|---|---|---|---|---|---|"]
    layer: dict[int, list[float]] = {m: [0.0, 0.0, 0.0, 0.0] for m in ms}
    grid: list[str] = []  # every candidate per shape and M, fastest first (tile w warps / split µs)
    for name, (n, k) in SHAPES.items():
        wb = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
        wq, ws = fr.quantize_fp8_ref(wb.float(), None)
        ws = ws.contiguous()
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = fq.quantize_fp8(x, None)
            ref = fg.fp8_gemm_channel_ref(xq, xs, wq, ws)
            ours = lambda cfg=None: fs.fp8_gemm_splitk(xq, xs, wq, ws, config=cfg)  # noqa: E731
            t_cublas = us(lambda: fg.fp8_gemm_channel(xq, xs, wq, ws))
            tflops = lambda t: 2 * m * n * k / t / 1e6  # noqa: E731 (t in µs)
            t_bf16 = us(lambda: x @ wb.T)
            auto = fs.splitk_config(m, n, k, sms)
            timed: dict[fs.SplitKConfig, float] = {}
            for cfg in sorted({auto} | candidates(m, stages), key=label):
                try:
                    out = ours(cfg)
                    err = (out.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
                    if err > 1e-2:
                        print(f"{name} M={m} {label(cfg)}: error {err:.1e}, not timed", flush=True)
                        continue
                    timed[cfg] = us(lambda: ours(cfg))
                except Exception as e:  # a config that does not fit (shared memory) is skipped, named
                    print(f"{name} M={m} {label(cfg)}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            best = min(timed, key=timed.get)
            fast = fs.SplitKConfig(**{**best.__dict__, "fast_accum": True})  # what the float32 promotion costs
            note = f"; best fast-accum {us(lambda: ours(fast)):.1f}"
            ranked = sorted(timed.items(), key=lambda kv: kv[1])
            grid.append(f"{name} M={m}: cuBLAS {t_cublas:.1f}{note}; "
                        + ", ".join(f"{c.block_m}x{c.block_n}w{c.num_warps}/{c.split} {t:.1f}" for c, t in ranked))
            t_auto, t_best = timed.get(auto, float("nan")), timed[best]
            layer[m] = [a + b for a, b in zip(layer[m], (t_bf16, t_cublas, t_auto, t_best))]
            cell = lambda t: f"{t:.1f} ({tflops(t):.0f})"  # noqa: E731
            lines.append(f"| {name} | {m} | {cell(t_bf16)} | {cell(t_cublas)} | {cell(t_auto)} | {label(auto)} "
                         f"| {cell(t_best)} | {label(best)} | {t_cublas / t_auto:.2f}× | {t_cublas / t_best:.2f}× |")
            print(lines[-1], flush=True)
    lines += ["", f"| M | layer: bf16 mm | {base} | split-K auto | best per projection | cuBLAS / auto |",
              "|---|---|---|---|---|---|"]
    for m, (b, c, a, best) in layer.items():
        lines.append(f"| {m} | {b:.1f} | {c:.1f} | {a:.1f} | {best:.1f} | {c / a:.2f}× |")
    lines += ["", "Every candidate, fastest first (block_m x block_n, warps / split: µs):", ""] + grid
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
