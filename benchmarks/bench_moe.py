"""The fused MoE kernels on one GPU at real layers, against the torch reference and the layer's bound.

Layers (bfloat16 activations): qwen3-30b-a3b (H 2048, I 768, 128 experts, top 8, renormalised) and mixtral-8x7b
(H 4096, I 14336, 8 experts, top 2, renormalised) with bfloat16 experts; gpt-oss-20b and gpt-oss-120b (H 2880,
I 2880, 32 / 128 experts, top 4, top-k-then-softmax routing, biases, clamped SwiGLU) with MXFP4 experts (the
codes expanded in registers). T = 1, 8, 16, 64, 256, 1024, 4096 tokens, router logits N(0, 1) (roughly even
loads). The grouped GEMMs (``fused_moe``) run at every T; the decode kernels (``moe_decode.fused_moe_decode``, the
``decode`` rows; the op takes them up to ``moe_args.DECODE_MAX_TOKENS``) up to 16 tokens. Per row: the experts
some token chose; the kernels' and ``fused_moe_ref``'s µs; the bound, the larger of the bytes of the chosen
experts' weights (MXFP4: codes, scales and biases) plus x and the output over 4.22 TB/s and the FLOPs
(``6 * T * top_k * H * I``) over 793 TFLOP/s; the kernel's share of it; and ``err``, the kernel's relative
Frobenius error against the reference. The kernels are timed as CUDA-graph replays (how decode steps run them),
the reference eagerly (it reads the chosen experts back to the host, and dequantizes MXFP4 ones); both medians
of ``triton.testing.do_bench``, L2 flushed before each repetition (cold weights).

    python benchmarks/bench_moe.py            # the table (markdown; also $OUT/moe.md), a few minutes on an H200
    python benchmarks/bench_moe.py --only gpt-oss-20b,gpt-oss-120b   # some layers
    python benchmarks/bench_moe.py --sweep    # each T against a few candidate configs (for MOE_CONFIGS; and the
                                              # decode kernels' MoeDecodeConfig up to 16 tokens)
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
from minfer.kernels.moe.moe_args import MoeDecodeConfig, moe_decode_config  # noqa: E402
from minfer.kernels.moe.moe_decode import fused_moe_decode  # noqa: E402
from minfer.kernels.moe.moe_ref import fused_moe_ref, moe_route_ref  # noqa: E402
from minfer.kernels.quant.mxfp4_ref import quantize_mxfp4  # noqa: E402

PEAK_BW = 4.22e12  # measured device-to-device copy, bytes read + written (BENCHMARKS.md)
PEAK_FLOPS = 793e12  # measured bf16 torch.mm
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16
# name: (hidden H, expert intermediate I, experts E, top_k, gpt-oss: MXFP4 experts with biases and clamped SwiGLU,
# top-k-then-softmax routing)
LAYERS = {"qwen3-30b-a3b": (2048, 768, 128, 8, False), "mixtral-8x7b": (4096, 14336, 8, 2, False),
          "gpt-oss-20b": (2880, 2880, 32, 4, True), "gpt-oss-120b": (2880, 2880, 128, 4, True)}
TOKENS = (1, 8, 16, 64, 256, 1024, 4096)
DECODE_TOKENS = 16  # the decode rows: up to this many tokens
SMOKE_LAYERS = {"qwen3-like": (64, 32, 16, 4, False), "mixtral-like": (64, 48, 4, 2, False),
                "gpt-oss-like": (64, 64, 8, 4, True)}
SMOKE_TOKENS = (1, 16)
SWEEP = [MoeConfig(*c) for c in (
    (16, 32, 256, 1, 4, 3), (16, 32, 128, 1, 2, 4), (16, 128, 64, 1, 4, 4), (16, 256, 64, 1, 8, 3),
    (16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 64, 256, 1, 4, 3), (16, 128, 128, 1, 4, 4),
    (32, 64, 128, 4, 4, 4), (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 3),
)]
# (gate/up rows, down rows, tile, warps, stages) of the decode kernels, around the default (8, 4, 8192, 4, 3)
DECODE_SWEEP = [MoeDecodeConfig(*c) for c in (
    (8, 4, 8192, 4, 3), (8, 4, 8192, 4, 1), (4, 2, 8192, 4, 3), (16, 8, 8192, 4, 3), (8, 4, 4096, 4, 3),
    (8, 4, 16384, 8, 3), (4, 4, 4096, 2, 3), (16, 4, 8192, 8, 3), (8, 8, 8192, 4, 3),
)]


def config_name(cfg: MoeConfig | MoeDecodeConfig) -> str:
    if isinstance(cfg, MoeDecodeConfig):
        return (f"decode {cfg.block_n_gate_up}/{cfg.block_n_down} rows, tile {cfg.tile} w{cfg.num_warps} "
                f"s{cfg.num_stages}")
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} g{cfg.group_m} w{cfg.num_warps} s{cfg.num_stages}"


def make_layer(h: int, i: int, e: int, t: int, gpt_oss: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """x, router logits and ``fused_moe``'s keywords past them: bfloat16 experts (unit-scale outputs), or
    gpt-oss's (MXFP4 codes quantized from normal weights expert by expert, the gate/up values a few units wide so
    the clamp bites, biases, top-k-then-softmax routing)."""
    x = torch.randn(t, h, device=DEV).to(DT)
    logits = torch.randn(t, e, device=DEV).to(DT)
    if not gpt_oss:
        return x, logits, dict(w_gate_up=(torch.randn(e, 2 * i, h, device=DEV) / h ** 0.5).to(DT),
                               w_down=(torch.randn(e, h, i, device=DEV) / i ** 0.5).to(DT), renormalize=True)
    gate_up = [quantize_mxfp4(torch.randn(2 * i, h, device=DEV) * 3 / h ** 0.5) for _ in range(e)]
    down = [quantize_mxfp4(torch.randn(h, i, device=DEV) / i ** 0.5) for _ in range(e)]
    return x, logits, dict(
        w_gate_up=torch.stack([b for b, _ in gate_up]), scale_gate_up=torch.stack([s for _, s in gate_up]),
        w_down=torch.stack([b for b, _ in down]), scale_down=torch.stack([s for _, s in down]),
        bias_gate_up=torch.randn(e, 2 * i, device=DEV).to(DT), bias_down=(0.1 * torch.randn(e, h, device=DEV)).to(DT),
        swiglu_limit=7.0, swiglu_alpha=1.702, renormalize=False, topk_softmax=True)


def bound_us(h: int, i: int, e_used: int, t: int, top_k: int, gpt_oss: bool) -> tuple[float, float]:
    """(memory bound, compute bound) in µs: the chosen experts' weights (MXFP4: half a byte an element, a scale
    byte per 32, the bfloat16 biases) + x + out; 2 FLOPs per MAC."""
    expert = 3 * h * i * (17 / 32 if gpt_oss else 2) + (2 * (3 * i + h) if gpt_oss else 0)
    nbytes = e_used * expert + 2 * 2 * t * h
    return nbytes / PEAK_BW * 1e6, 6 * t * top_k * h * i / PEAK_FLOPS * 1e6


def run_table(layers: dict, tokens: tuple[int, ...]) -> list[str]:
    lines = ["| layer | T | experts used | kernel µs | reference µs | bound µs (mem / flops) | of bound | err |",
             "|---|---|---|---|---|---|---|---|"]
    for name, (h, i, e, top_k, gpt_oss) in layers.items():
        xs, all_logits, kw = make_layer(h, i, e, max(tokens), gpt_oss)
        for t in tokens:
            x, logits = xs[:t].contiguous(), all_logits[:t].contiguous()
            want = fused_moe_ref(x, logits, top_k=top_k, **kw)
            e_used = int(torch.unique(moe_route_ref(logits, top_k, True, topk_softmax=gpt_oss)[1]).numel())
            ref = bench(lambda: fused_moe_ref(x, logits, top_k=top_k, **kw), rep=100) * 1e3
            mem, flops = bound_us(h, i, e_used, t, top_k, gpt_oss)
            kernels = [("", fused_moe)] + ([(" decode", fused_moe_decode)] if t <= DECODE_TOKENS else [])
            for label, kernel in kernels:
                err = rel_err(kernel(x, logits, top_k=top_k, **kw), want)
                ours = bench_graph(lambda: kernel(x, logits, top_k=top_k, **kw)) * 1e3
                line = (f"| {name}{label} | {t} | {e_used}/{e} | {ours:.1f} | {ref:.1f} | "
                        f"{max(mem, flops):.3g} ({mem:.3g} / {flops:.3g}) | {100 * max(mem, flops) / ours:.0f}% | "
                        f"{err:.1e} |")
                print(line, flush=True)
                lines.append(line)
        del xs, all_logits, kw
    return lines


def run_sweep(layers: dict, tokens: tuple[int, ...]) -> list[str]:
    """µs of every candidate config per (layer, T), the table's choice and the fastest marked."""
    lines = ["| layer | T | table's config µs | fastest µs | fastest config |", "|---|---|---|---|---|"]
    for name, (h, i, e, top_k, gpt_oss) in layers.items():
        xs, all_logits, kw = make_layer(h, i, e, max(tokens), gpt_oss)
        for t in tokens:
            x, logits = xs[:t].contiguous(), all_logits[:t].contiguous()
            paths = [("", fused_moe, SWEEP, moe_config(t, top_k, e))]
            if t <= DECODE_TOKENS:
                paths.append((" decode", fused_moe_decode, DECODE_SWEEP,
                              moe_decode_config(0.5 if gpt_oss else x.element_size(), h, i, x.device)))
            for label, kernel, candidates, default in paths:
                times = {}
                for cfg in candidates:
                    try:
                        times[cfg] = bench_graph(lambda: kernel(x, logits, top_k=top_k, config=cfg, **kw),
                                                 rep=50) * 1e3
                    except Exception as exc:  # a tile too big for shared memory (or too shallow for MXFP4): skip
                        print(f"  {config_name(cfg)}: {type(exc).__name__}", flush=True)
                best = min(times, key=times.get)
                table = bench_graph(lambda: kernel(x, logits, top_k=top_k, **kw), rep=50) * 1e3
                line = (f"| {name}{label} | {t} | {table:.1f} ({config_name(default)}) | {times[best]:.1f} | "
                        f"{config_name(best)} |")
                print(line, flush=True)
                lines.append(line)
        del xs, all_logits, kw
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: the interpreter)")
    ap.add_argument("--sweep", action="store_true", help="time candidate launch configs per T")
    ap.add_argument("--only", help=f"comma-separated layers (of {', '.join(LAYERS)})")
    args = ap.parse_args()
    if DEV == "cpu" and not args.smoke:
        sys.exit("no CUDA GPU: run with --smoke (tiny shapes under the interpreter)")
    layers, tokens = (SMOKE_LAYERS, SMOKE_TOKENS) if args.smoke else (LAYERS, TOKENS)
    if args.only:
        layers = {name: layers[name] for name in args.only.split(",")}
    torch.manual_seed(0)
    lines = (run_sweep if args.sweep else run_table)(layers, tokens)
    print("\n" + "\n".join(lines))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_sweep.md" if args.sweep else "moe.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
