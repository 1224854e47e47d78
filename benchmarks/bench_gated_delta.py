"""Gated DeltaNet's kernels on one GPU at Qwen3.5-9B's linear-attention layer, against the torch references and
the bytes / FLOPs they move.

The layer: 16 key heads and 32 value heads of 128, conv kernel 4 (conv channels C = 2·16·128 + 32·128 = 8192),
bfloat16 activations, float32 states. Steps: decode at batch 1 and 64 (the conv and the recurrent kernel, each a
CUDA-graph replay, as decode steps run), and prefill of 4096 tokens as one fresh sequence and as four of 1024 (the
conv and the chunked pair, eager). Per row: kernel and reference µs (medians of ``triton.testing.do_bench``), the
bound, the kernel's share of it, and the kernel's relative error against the reference (one call each, on the
same state).

Bounds: bytes over 4.22 TB/s (the measured device copy), or FLOPs over a third of the measured TF32 matmul rate
(the chunked products run in tf32x3: three tensor-core passes), whichever is longer.
- conv: x read and y written, each slot's buffer read and written, the weight.
- decode (recurrent): q, k, v, g, beta read and o written, each state read and written (float32: the state is
  the traffic, 64 KiB per value head, 2 MiB per sequence each way); ~7·Dk·Dv FLOPs per token and value head.
- prefill (chunked pair): inputs and output (once), the float32 workspace (U, W and the cumulative decay, written
  once; U read once, W and the decay once per Dv tile), the states; FLOPs of the chunked form's products per 64-token block and value head:
  A = βKKᵀ (2·64²·Dk), the inverse by doubling (5 levels of two 64³ products), U and W (2·64²·(Dv + Dk)), and the
  scan's W·S, Q·S, Kᵀ·v' (3 · 2·64·Dk·Dv), Q·Kᵀ and P·v' (2·64²·(Dk + Dv)).

    python benchmarks/bench_gated_delta.py           # the table (markdown; also $OUT/gated_delta.md)
    python benchmarks/bench_gated_delta.py --smoke   # tiny shapes; runs on a CPU under the interpreter
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
from minfer.kernels.linear_attention.causal_conv import causal_conv1d  # noqa: E402
from minfer.kernels.linear_attention.gated_delta import gated_delta_rule  # noqa: E402
from minfer.kernels.linear_attention.gated_delta_ref import causal_conv1d_ref, gated_delta_rule_ref  # noqa: E402

PEAK_BW = 4.22e12  # measured device-to-device copy, bytes read + written (BENCHMARKS.md)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16
LAYER = dict(hk=16, hv=32, dk=128, dv=128, kernel=4)  # Qwen3.5-9B
SMOKE_LAYER = dict(hk=2, hv=4, dk=32, dv=32, kernel=4)
STEPS = {"decode b1": [1], "decode b64": [1] * 64, "prefill 4096": [4096], "prefill 4x1024": [1024] * 4}
SMOKE_STEPS = {"decode b1": [1], "decode b4": [1] * 4, "prefill 80": [80], "prefill 2x40": [40] * 2}


def tf32_flops() -> float:
    """Measured TF32 matmul FLOP/s (a 8192³ float32 product with TF32 allowed); no FLOP bound on a CPU."""
    if DEV == "cpu":
        return float("inf")
    a, b = torch.randn(8192, 8192, device=DEV), torch.randn(8192, 8192, device=DEV)
    torch.backends.cuda.matmul.allow_tf32 = True
    ms = bench(lambda: a @ b, rep=50)
    torch.backends.cuda.matmul.allow_tf32 = False
    return 2 * 8192 ** 3 / (ms * 1e-3)


def make_step(lens: list[int], s: dict) -> dict:
    """The layer's inputs for one step: the conv's input and weight, the delta rule's inputs (q/k/v filled by the
    conv), states in shuffled slots (a fresh prompt has none; decodes have one)."""
    t, b = sum(lens), len(lens)
    c = 2 * s["hk"] * s["dk"] + s["hv"] * s["dv"]
    qsl = torch.tensor([0] + lens, device=DEV).cumsum(0).to(torch.int32)
    slots = torch.randperm(2 * b, device=DEV)[:b].to(torch.int32)
    has = torch.tensor([n == 1 for n in lens], device=DEV)
    x = torch.randn(t, c, device=DEV).to(DT)
    rate = torch.linspace(0.02, 1.0, s["hv"], device=DEV)
    return dict(
        x=x, w=(torch.randn(c, s["kernel"], device=DEV) / 2).to(DT),
        buf=torch.randn(2 * b, c, s["kernel"] - 1, device=DEV).to(DT),
        y=torch.randn(t, c, device=DEV).to(DT),
        g=-rate * torch.nn.functional.softplus(torch.randn(t, s["hv"], device=DEV) - 1),
        beta=torch.randn(t, s["hv"], device=DEV).sigmoid().to(DT),
        state=torch.randn(2 * b, s["hv"], s["dk"], s["dv"], device=DEV) * 0.1, step=(qsl, slots, has), c=c)


def qkv(y: torch.Tensor, s: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = y.shape[0]
    parts = y.split([s["hk"] * s["dk"]] * 2 + [s["hv"] * s["dv"]], 1)
    return tuple(p.reshape(t, -1, d) for p, d in zip(parts, (s["dk"], s["dk"], s["dv"])))


def conv_bytes(t: int, b: int, c: int, k: int) -> int:
    return 2 * (2 * t * c + 2 * b * c * (k - 1) + c * k)


def gdn_cost(lens: list[int], s: dict) -> tuple[int, int]:
    """(bytes, FLOPs) of the delta rule over a step of ``lens`` (the recurrent kernel when all are 1)."""
    t, b = sum(lens), len(lens)
    hk, hv, dk, dv = s["hk"], s["hv"], s["dk"], s["dv"]
    io = 2 * t * (2 * hk * dk + 2 * hv * dv + hv) + 4 * t * hv + 8 * b * hv * dk * dv  # bf16 in/out, g, states
    if t == b:
        return io, 7 * t * hv * dk * dv
    blocks = sum(-(-n // 64) for n in lens)
    tiles = -(-dv // (64 if b * hv * -(-dv // 64) >= 128 else 32))
    workspace = 4 * t * hv * ((dk + dv + 1) + (dk + 1) * tiles + dv)
    per_block = (2 * 64 * 64 * dk + 5 * 2 * 2 * 64 ** 3 + 2 * 64 * 64 * (dv + dk) + 3 * 2 * 64 * dk * dv
                 + 2 * 64 * 64 * (dk + dv))
    return io + workspace, blocks * hv * per_block


def row(name: str, kind: str, kernel_ms: float, ref_ms: float, nbytes: int, flops: int, peak_flops: float,
        err: float) -> str:
    bound_us = max(nbytes / PEAK_BW, flops / (peak_flops / 3)) * 1e6
    us = kernel_ms * 1e3
    return (f"| {name} | {kind} | {us:.1f} | {ref_ms * 1e3:.1f} | {bound_us:.1f} ({nbytes / 2 ** 20:.1f} MiB, "
            f"{flops / 1e9:.2f} GFLOP) | {bound_us / us:.0%} | {err:.1e} |")


def run(name: str, lens: list[int], s: dict, peak_flops: float) -> list[str]:
    d = make_step(lens, s)
    decode = all(n == 1 for n in lens)
    timer = bench_graph if decode else bench
    t, b = sum(lens), len(lens)

    buf = d["buf"].clone()
    want = causal_conv1d_ref(d["x"], d["w"], buf, *d["step"])
    err = rel_err(causal_conv1d(d["x"], d["w"], d["buf"].clone(), *d["step"]), want)
    kernel_ms = timer(lambda: causal_conv1d(d["x"], d["w"], d["buf"], *d["step"], out=d["y"]))
    ref_ms = bench(lambda: causal_conv1d_ref(d["x"], d["w"], buf, *d["step"]))
    rows = [row(name, "conv", kernel_ms, ref_ms, conv_bytes(t, b, d["c"], s["kernel"]), 0, peak_flops, err)]

    q, k, v = qkv(d["y"], s)
    state = d["state"].clone()
    want = gated_delta_rule_ref(q, k, v, d["g"], d["beta"], state, *d["step"])
    err = rel_err(gated_delta_rule(q, k, v, d["g"], d["beta"], d["state"].clone(), *d["step"]), want)
    out = torch.empty_like(want)
    kernel_ms = timer(lambda: gated_delta_rule(q, k, v, d["g"], d["beta"], d["state"], *d["step"], out=out))
    ref_ms = bench(lambda: gated_delta_rule_ref(q, k, v, d["g"], d["beta"], state, *d["step"]), rep=20)
    kind = "recurrent" if decode else "chunked"
    rows.append(row(name, kind, kernel_ms, ref_ms, *gdn_cost(lens, s), peak_flops, err))
    for line in rows:
        print(line, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (runs on a CPU under the interpreter)")
    args = ap.parse_args()
    torch.manual_seed(0)
    layer, steps = (SMOKE_LAYER, SMOKE_STEPS) if args.smoke else (LAYER, STEPS)
    peak = tf32_flops()
    lines = [f"Gated DeltaNet at {layer} ({torch.cuda.get_device_name() if DEV == 'cuda' else 'CPU'}; measured TF32 "
             f"{peak / 1e12:.0f} TFLOP/s)", "",
             "| step | kernel | µs | ref µs | bound µs (bytes, FLOPs) | share of bound | err |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for name, lens in steps.items():
        lines += run(name, lens, layer, peak)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gated_delta.md"), "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
