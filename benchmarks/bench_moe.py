"""The fused MoE kernels on one GPU at two real layers, against the torch reference and the layer's bound.

Layers (bfloat16): qwen3-30b-a3b (H 2048, I 768, 128 experts, top 8, renormalised) and mixtral-8x7b (H 4096,
I 14336, 8 experts, top 2, renormalised), at T = 1, 16, 64, 256, 1024, 4096 tokens, router logits N(0, 1)
(roughly even loads). Per row: the experts some token chose; ``fused_moe`` and ``fused_moe_ref`` in µs; the
bound, the larger of the bytes of the chosen experts' weights plus x and the output over 4.22 TB/s and the
FLOPs (``6 * T * top_k * H * I``) over 793 TFLOP/s; the kernel's share of it; and ``err``, the kernel's
relative Frobenius error against the reference. ``fused_moe`` is timed as a CUDA-graph replay (how decode steps
run it), the reference eagerly (it reads the chosen experts back to the host); both medians of
``triton.testing.do_bench``, L2 flushed before each repetition (cold weights).

    python benchmarks/bench_moe.py            # the table (markdown; also $OUT/moe.md), ~1-2 min on an H200
    python benchmarks/bench_moe.py --sweep    # each T against a few candidate configs (for MOE_CONFIGS)
    python benchmarks/bench_moe.py --smoke    # tiny shapes; runs on a CPU under the interpreter
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():  # --smoke on a CPU machine: the interpreter, set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_kernels import bench, bench_graph, rel_err  # noqa: E402
from minfer.kernels.moe.moe import MoeConfig, fused_moe, moe_config  # noqa: E402
from minfer.kernels.moe.moe_ref import fused_moe_ref, moe_route_ref  # noqa: E402

PEAK_BW = 4.22e12  # measured device-to-device copy, bytes read + written (BENCHMARKS.md)
PEAK_FLOPS = 793e12  # measured bf16 torch.mm
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16
# name: (hidden H, expert intermediate I, experts E, top_k)
LAYERS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}
TOKENS = (1, 16, 64, 256, 1024, 4096)
SMOKE_LAYERS = {"qwen3-like": (64, 32, 16, 4), "mixtral-like": (64, 48, 4, 2)}
SMOKE_TOKENS = (1, 16)
SWEEP = [MoeConfig(*c) for c in (
    (16, 32, 256, 1, 4, 3), (16, 32, 128, 1, 2, 4), (16, 128, 64, 1, 4, 4), (16, 256, 64, 1, 8, 3),
    (16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 64, 256, 1, 4, 3), (16, 128, 128, 1, 4, 4),
    (32, 64, 128, 4, 4, 4), (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 3),
)]


def config_name(cfg: MoeConfig) -> str:
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} g{cfg.group_m} w{cfg.num_warps} s{cfg.num_stages}"


def make_layer(h: int, i: int, e: int, t: int) -> tuple[torch.Tensor, ...]:
    """x, router logits, w_gate_up, w_down (bfloat16, unit-scale outputs)."""
    x = torch.randn(t, h, device=DEV).to(DT)
    logits = torch.randn(t, e, device=DEV).to(DT)
    w_gate_up = (torch.randn(e, 2 * i, h, device=DEV) / h ** 0.5).to(DT)
    w_down = (torch.randn(e, h, i, device=DEV) / i ** 0.5).to(DT)
    return x, logits, w_gate_up, w_down


def bound_us(h: int, i: int, e_used: int, t: int, top_k: int) -> tuple[float, float]:
    """(memory bound, compute bound) in µs: the chosen experts' weights + x + out; 2 FLOPs per MAC."""
    nbytes = 2 * (e_used * 3 * h * i + 2 * t * h)
    return nbytes / PEAK_BW * 1e6, 6 * t * top_k * h * i / PEAK_FLOPS * 1e6


def run_table(layers: dict, tokens: tuple[int, ...]) -> list[str]:
    lines = ["| layer | T | experts used | fused_moe µs | reference µs | bound µs (mem / flops) | of bound | err |",
             "|---|---|---|---|---|---|---|---|"]
    for name, (h, i, e, top_k) in layers.items():
        w = make_layer(h, i, e, max(tokens))
        for t in tokens:
            x, logits = w[0][:t].contiguous(), w[1][:t].contiguous()
            args = (x, logits, w[2], w[3], top_k, True)
            err = rel_err(fused_moe(*args), fused_moe_ref(*args))
            e_used = int(torch.unique(moe_route_ref(logits, top_k, True)[1]).numel())
            ours = bench_graph(lambda: fused_moe(*args)) * 1e3
            ref = bench(lambda: fused_moe_ref(*args), rep=100) * 1e3
            mem, flops = bound_us(h, i, e_used, t, top_k)
            line = (f"| {name} | {t} | {e_used}/{e} | {ours:.1f} | {ref:.1f} | {max(mem, flops):.3g} ({mem:.3g} / "
                    f"{flops:.3g}) | {100 * max(mem, flops) / ours:.0f}% | {err:.1e} |")
            print(line, flush=True)
            lines.append(line)
        del w
    return lines


def run_sweep(layers: dict, tokens: tuple[int, ...]) -> list[str]:
    """µs of every candidate config per (layer, T), the table's choice and the fastest marked."""
    lines = ["| layer | T | table's config µs | fastest µs | fastest config |", "|---|---|---|---|---|"]
    for name, (h, i, e, top_k) in layers.items():
        w = make_layer(h, i, e, max(tokens))
        for t in tokens:
            args = (w[0][:t].contiguous(), w[1][:t].contiguous(), w[2], w[3], top_k, True)
            times = {}
            for cfg in SWEEP:
                try:
                    times[cfg] = bench_graph(lambda: fused_moe(*args, cfg), rep=50) * 1e3
                except Exception as exc:  # a tile too big for shared memory: skip it
                    print(f"  {config_name(cfg)}: {type(exc).__name__}", flush=True)
            best = min(times, key=times.get)
            table = bench_graph(lambda: fused_moe(*args), rep=50) * 1e3
            line = (f"| {name} | {t} | {table:.1f} ({config_name(moe_config(t, top_k, e))}) | {times[best]:.1f} | "
                    f"{config_name(best)} |")
            print(line, flush=True)
            lines.append(line)
        del w
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: the interpreter)")
    ap.add_argument("--sweep", action="store_true", help="time candidate launch configs per T")
    args = ap.parse_args()
    if DEV == "cpu" and not args.smoke:
        sys.exit("no CUDA GPU: run with --smoke (tiny shapes under the interpreter)")
    layers, tokens = (SMOKE_LAYERS, SMOKE_TOKENS) if args.smoke else (LAYERS, TOKENS)
    torch.manual_seed(0)
    lines = (run_sweep if args.sweep else run_table)(layers, tokens)
    print("\n" + "\n".join(lines))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_sweep.md" if args.sweep else "moe.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
