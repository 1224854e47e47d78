"""FP8 (e4m3) kernels on one GPU at llama-3.1-8b's linear-layer shapes, against bf16 and PyTorch's own FP8 GEMMs.

Per shape (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336) and M in 1..8192:
- GEMMs: bf16 ``torch.mm``; ``torch._scaled_mm`` with row-wise scales (the "channel" format); our Triton
  ``fp8_gemm_block`` (the "block" format); PyTorch's blockwise scaled mm (1x128 activations, 128x128 weights,
  cuBLAS on sm90 with CUDA 12.9+) where this torch has it. µs and TFLOP/s (against the measured 793 bf16 and
  ~1200 FP8 peaks).
- activation quantization: ``quantize_fp8`` alone, and the fused ``add_rms_norm_fp8`` / ``silu_and_mul_fp8``
  against their bf16 kernels (what the FP8 path adds over the bf16 one is the difference), µs and % of the
  4.22 TB/s copy bandwidth.
- batch 1: the matrix-vector kernels (with the prologues the one-token forward uses) on e4m3 weights against
  bf16 weights, µs and % of bandwidth.
Every variant is checked once against its torch reference before it is timed: ``err`` is
max|out - ref| / max|ref|; ``q-err`` (GEMMs) is the same against the unquantized float32 product, FP8's own cost.
Times are medians of CUDA-graph replays (``triton.testing.do_bench``, L2 flushed before each: cold weights).

    python benchmarks/bench_fp8.py                 # the tables (markdown; also $OUT/fp8.md), ~2 min on an H200
    python benchmarks/bench_fp8.py --sweep         # first time fp8_gemm_block / fp8 gemv launch configs
    python benchmarks/bench_fp8.py --smoke         # tiny shapes; runs on a CPU under the interpreter
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable

import torch

if not torch.cuda.is_available():  # --smoke on a CPU machine: the interpreter, set before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_kernels import bench_graph  # noqa: E402
from minfer.kernels.gemm import fp8_gemm as fg  # noqa: E402
from minfer.kernels.quant import fp8_quant as fq  # noqa: E402
from minfer.kernels.quant import fp8_ref as fr  # noqa: E402
from minfer.kernels.gemm import gemv as gm  # noqa: E402
from minfer.kernels.gemm import gemv_ref as gr  # noqa: E402
from minfer.kernels.gemm.gemv_config import GemvConfig  # noqa: E402
from minfer.kernels.activation import silu_and_mul  # noqa: E402
from minfer.kernels.rmsnorm import fused_add_rms_norm  # noqa: E402

PEAK_BW = 4.22e12  # measured device-to-device copy, bytes read + written (BENCHMARKS.md)
PEAK_BF16, PEAK_FP8 = 793e12, 1200e12  # measured bf16 torch.mm; torch._scaled_mm fp8 (approximate)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DT = torch.bfloat16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (1, 16, 64, 256, 1024, 4096, 8192)
HIDDEN, INTER = 4096, 14336


def bench(fn: Callable[[], object], rep: int = 100) -> float:
    """Median µs of a CUDA-graph replay of ``fn`` (``bench_kernels.bench_graph``: a short kernel is not timed
    as Python launch overhead); on a CPU (``--smoke``) a host-timed call, only to exercise the script."""
    return bench_graph(fn, rep) * 1e3


def max_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max|ref| (inf for a non-finite output)."""
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def block_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128-block quantization of ``w [N, K]`` (a checkpoint's), scales row-expanded to ``[N, ceil(K/128)]``."""
    n, k = w.shape
    g, nb = fr.num_groups(k), -(-n // 128)
    padded = torch.nn.functional.pad(w.float(), (0, g * 128 - k, 0, nb * 128 - n))
    amax = padded.view(nb, 128, g, 128).abs().amax(dim=(1, 3))
    scale = (amax / fr.FP8_MAX).clamp_min(fr.FP8_MIN_SCALE).repeat_interleave(128, 0)[:n].contiguous()
    wq = (w.float() / scale.repeat_interleave(128, 1)[:, :k]).clamp(-448, 448).to(fr.FP8_DTYPE)
    return wq, scale


# ----------------------------------------------------------------------------------- torch blockwise
def torch_blockwise() -> tuple[str, Callable] | None:
    """PyTorch's own 1x128 x 128x128 blockwise scaled mm, as ``(name, fn(xq, xs, wq, ws_rows))``, or None."""
    if DEV != "cuda":
        return None
    F = torch.nn.functional

    def scales(xs: torch.Tensor, ws_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # 1x128: [M, K/128] outer-dim-major (stride (1, M)). 128x128: [N/128, K/128] padded to a multiple of 4
        # along K/128, K-major in memory, passed transposed ([L4, N/128]).
        a = torch.empty_strided(xs.shape, (1, xs.shape[0]), dtype=xs.dtype, device=xs.device).copy_(xs)
        wb = ws_rows[::128]
        pad = (-wb.shape[1]) % 4
        b = torch.nn.functional.pad(wb, (0, pad)).contiguous().t()
        return a, b

    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
        st = F.ScalingType

        def v2(xq, xs, wq, ws_rows):
            a, b = scales(xs, ws_rows)
            return F.scaled_mm(xq, wq.t(), a, st.BlockWise1x128, b, st.BlockWise128x128, output_dtype=DT)
        return "F.scaled_mm blockwise", v2

    def v1(xq, xs, wq, ws_rows):
        a, b = scales(xs, ws_rows)
        return torch._scaled_mm(xq, wq.t(), scale_a=a, scale_b=b, out_dtype=DT)
    return "_scaled_mm blockwise", v1


# ------------------------------------------------------------------------------------------- cases
def gemm_rows(name: str, n: int, k: int, ms: tuple[int, ...]) -> list[str]:
    w = torch.randn(n, k, device=DEV, dtype=DT) * k ** -0.5
    wq_c, ws_c = fr.quantize_fp8_ref(w, None)
    wq_b, ws_b = block_weight(w)
    tb = torch_blockwise()
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=DEV, dtype=DT)
        exact = x.float() @ w.float().T
        xq_c, xs_c = fq.quantize_fp8(x, None)
        xq_b, xs_b = fq.quantize_fp8(x, 128)
        ref_c = fg.fp8_gemm_channel_ref(xq_c, xs_c, wq_c, ws_c, out_dtype=torch.float32)
        ref_b = fg.fp8_gemm_block_ref(xq_b, xs_b, wq_b, ws_b, out_dtype=torch.float32)
        flops = 2 * m * n * k
        variants = [("bf16 torch.mm", lambda: torch.mm(x, w.t()), exact, PEAK_BF16),
                    ("_scaled_mm rowwise", lambda: fg.fp8_gemm_channel(xq_c, xs_c, wq_c, ws_c), ref_c, PEAK_FP8),
                    ("fp8_gemm_block (triton)", lambda: fg.fp8_gemm_block(xq_b, xs_b, wq_b, ws_b), ref_b, PEAK_FP8)]
        if tb is not None:
            variants.append((tb[0], lambda: tb[1](xq_b, xs_b, wq_b, ws_b), ref_b, PEAK_FP8))
        for impl, fn, ref, peak in variants:
            try:
                out = fn()
                err, qerr = max_err(out, ref), max_err(out, exact)
                us = bench(fn)
            except Exception as e:  # e.g. a torch without this blockwise path: say so in the table
                rows.append(f"| {name} | {m} | {impl} | n/a | | | | {type(e).__name__}: {str(e)[:60]} |")
                continue
            tf = flops / (us * 1e-6) / 1e12
            note = "FAIL" if err > 2e-2 else ""
            rows.append(f"| {name} {n}x{k} | {m} | {impl} | {us:.1f} | {tf:.1f} | {100 * tf * 1e12 / peak:.0f}% | "
                        f"{err:.1e} / {qerr:.1e} | {note} |")
            print(rows[-1], flush=True)
    return rows


def act_rows(ms: tuple[int, ...], hidden: int, inter: int) -> list[str]:
    rows = []
    eps = 1e-5
    nw = 1 + 0.1 * torch.randn(hidden, device=DEV, dtype=DT)
    for m in ms:
        x = torch.randn(m, hidden, device=DEV, dtype=DT)
        res = torch.randn(m, hidden, device=DEV, dtype=DT)
        xgu = torch.randn(m, 2 * inter, device=DEV, dtype=DT) * 2
        for group in (None, 128):
            g = "token" if group is None else "1x128"
            out_bytes = lambda kk: m * kk * (1 + 4 / (kk if group is None else 128))  # codes + scales
            cases = [
                (f"quantize_fp8 [{m}, {hidden}] {g}", lambda: fq.quantize_fp8(x, group),
                 lambda: fr.quantize_fp8_ref(x, group), 2 * m * hidden + out_bytes(hidden)),
                (f"add_rms_norm_fp8 [{m}, {hidden}] {g}", lambda: fq.add_rms_norm_fp8(x, res, nw, eps, group)[:2],
                 lambda: fq.quantize_fp8(fused_add_rms_norm(x, res.clone(), nw, eps), group),
                 6 * m * hidden + out_bytes(hidden)),
                (f"silu_and_mul_fp8 [{m}, 2x{inter}] {g}", lambda: fq.silu_and_mul_fp8(xgu, group),
                 lambda: fq.quantize_fp8(silu_and_mul(xgu), group), 4 * m * inter + out_bytes(inter)),
            ]
            for label, fn, ref_fn, nbytes in cases:
                res_before = res.clone()
                q, s = fn()
                res.copy_(res_before)  # the in-place residual: check against the same input
                qr, sr = ref_fn()
                res.copy_(res_before)
                err = max_err(fr.dequantize_fp8(q, s), fr.dequantize_fp8(qr, sr))
                us = bench(fn)
                rows.append(f"| {label} | {us:.1f} | {100 * nbytes / (us * 1e-6) / PEAK_BW:.0f}% | {err:.1e} |")
                print(rows[-1], flush=True)
        for label, fn, nbytes in [
                (f"fused_add_rms_norm (bf16) [{m}, {hidden}]", lambda: fused_add_rms_norm(x, res, nw, eps),
                 8 * m * hidden),
                (f"silu_and_mul (bf16) [{m}, 2x{inter}]", lambda: silu_and_mul(xgu), 6 * m * inter)]:
            us = bench(fn)
            rows.append(f"| {label} | {us:.1f} | {100 * nbytes / (us * 1e-6) / PEAK_BW:.0f}% | |")
            print(rows[-1], flush=True)
    return rows


def gemv_rows(shapes: dict[str, tuple[int, int]], sweep: bool) -> list[str]:
    """Batch 1 with the one-token forward's prologues: qkv / gate_up after add + RMSNorm, down after SwiGLU."""
    rows = []
    prologue = {"qkv": "rms", "gate_up": "rms", "o": "plain", "down": "silu"}
    eps = 1e-5
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=DEV, dtype=DT) * k ** -0.5
        x, res = torch.randn(1, k, device=DEV, dtype=DT), torch.randn(1, k, device=DEV, dtype=DT)
        xgu = torch.randn(1, 2 * k, device=DEV, dtype=DT)
        nw = torch.ones(k, device=DEV, dtype=DT)
        p = prologue.get(name, "plain")
        weights = {"bf16": (w, None)}
        weights["fp8 channel"] = fr.quantize_fp8_ref(w, None)
        weights["fp8 block"] = block_weight(w)

        def call(wt, ws, cfg=None):
            if p == "rms":
                return gm.gemv_rms_norm(x, res, nw, eps, wt, None, cfg, weight_scale=ws)[0]
            if p == "silu":
                return gm.gemv_silu_mul(xgu, wt, cfg, weight_scale=ws)
            return gm.gemv(x, wt, None, cfg, weight_scale=ws)

        def ref(wt, ws):
            if p == "rms":
                return gr.gemv_rms_norm_ref(x, res, nw, eps, wt, weight_scale=ws)[0]
            if p == "silu":
                return gr.gemv_silu_mul_ref(xgu, wt, weight_scale=ws)
            return gr.gemv_ref(x, wt, weight_scale=ws)

        for impl, (wt, ws) in weights.items():
            nbytes = wt.numel() * wt.element_size() + (0 if ws is None else ws.numel() * 4)
            err = max_err(call(wt, ws), ref(wt, ws))
            us = bench(lambda: call(wt, ws))
            rows.append(f"| {name} {n}x{k} (+{p}) | {impl} | {us:.1f} | {100 * nbytes / (us * 1e-6) / PEAK_BW:.0f}% | "
                        f"{err:.1e} |")
            print(rows[-1], flush=True)
            if sweep:
                best = None
                for c in GEMV_SWEEP:
                    cfg = GemvConfig(c.block_n, min(c.block_k, 1 << (k - 1).bit_length()), c.num_warps, c.num_stages)
                    try:
                        e = max_err(call(wt, ws, cfg), ref(wt, ws))
                        t = bench(lambda: call(wt, ws, cfg), rep=50)
                    except Exception as ex:
                        print(f"  sweep gemv {name} {impl} {cfg}: {type(ex).__name__}", flush=True)
                        continue
                    print(f"  sweep gemv {name} {impl} {cfg}: {t:.1f} us {100 * nbytes / (t * 1e-6) / PEAK_BW:.0f}% "
                          f"err {e:.1e}", flush=True)
                    if e < 2e-2 and (best is None or t < best[0]):
                        best = (t, cfg)
                print(f"  BEST gemv {name} {impl}: {best}", flush=True)
    return rows


GEMM_SWEEP = [fg.Fp8GemmConfig(bm, bn, group_m=gmm, num_warps=w, num_stages=s) for bm, bn, gmm, w, s in [
    (16, 32, 1, 4, 4), (16, 64, 1, 4, 4), (16, 64, 1, 4, 5), (16, 128, 1, 4, 4), (32, 64, 1, 4, 4),
    (64, 32, 8, 4, 4), (64, 64, 8, 4, 4), (64, 64, 8, 4, 5), (64, 128, 8, 4, 3), (64, 128, 8, 4, 4),
    (128, 64, 8, 4, 4), (128, 128, 8, 8, 3), (128, 128, 8, 8, 4), (128, 128, 8, 4, 3), (128, 256, 8, 8, 3),
    (64, 256, 8, 4, 3)]]
# (rows, columns, warps, K-loop pipelining depth): the default shapes at depths 1-4 (above 1 Triton copies the
# chunks ahead into shared memory, gemv_config.STREAM_STAGES), then other shapes pipelined
GEMV_SWEEP = [GemvConfig(bn, bk, w, s) for bn, bk, w, s in [
    (8, 512, 4, 1), (8, 512, 4, 2), (8, 512, 4, 3), (8, 512, 4, 4), (8, 1024, 4, 1), (8, 1024, 4, 2),
    (8, 1024, 4, 3), (4, 1024, 4, 1), (4, 1024, 4, 3), (4, 2048, 4, 1), (4, 2048, 4, 2), (16, 256, 4, 3),
    (16, 512, 4, 3), (8, 2048, 8, 2), (16, 256, 8, 4), (4, 512, 4, 4)]]


def sweep_gemm(shapes: dict[str, tuple[int, int]], ms: tuple[int, ...]) -> None:
    """Each candidate config at each shape and M; BEST lines give the M-bucket table its entries."""
    for m in ms:
        totals: dict[fg.Fp8GemmConfig, float] = {}
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device=DEV, dtype=DT) * k ** -0.5
            wq, ws = block_weight(w)
            xq, xs = fq.quantize_fp8(torch.randn(m, k, device=DEV, dtype=DT), 128)
            ref = fg.fp8_gemm_block_ref(xq, xs, wq, ws, out_dtype=torch.float32)
            for cfg in GEMM_SWEEP:
                try:
                    fn = lambda: fg.fp8_gemm_block(xq, xs, wq, ws, config=cfg)
                    e = max_err(fn(), ref)
                    t = bench(fn, rep=40)
                except Exception as ex:
                    print(f"  sweep gemm M={m} {name} {cfg}: {type(ex).__name__}", flush=True)
                    totals[cfg] = float("inf")
                    continue
                if e > 2e-2:
                    t = float("inf")
                totals[cfg] = totals.get(cfg, 0.0) + t
                print(f"  sweep gemm M={m} {name} {cfg.block_m}x{cfg.block_n} g{cfg.group_m} w{cfg.num_warps} "
                      f"s{cfg.num_stages}: {t:.1f} us {2 * m * n * k / (t * 1e-6) / 1e12:.0f} TFLOP/s", flush=True)
        best = min(totals.items(), key=lambda kv: kv[1])
        current = totals.get(fg.block_config(m), float("nan"))
        print(f"  BEST gemm M={m}: {best[0]} sum {best[1]:.1f} us (table's: {current:.1f} us)", flush=True)


def sweep_act(ms: tuple[int, ...], hidden: int, inter: int) -> None:
    """Block width and warps of the quantizing kernels (per token: a block as wide as the row is one pass)."""
    for m in ms:
        x = torch.randn(m, hidden, device=DEV, dtype=DT)
        xgu = torch.randn(m, 2 * inter, device=DEV, dtype=DT)
        for label, fn, k, group in [("quantize_fp8", fq.quantize_fp8, hidden, 128),
                                    ("silu_and_mul_fp8", fq.silu_and_mul_fp8, inter, 128),
                                    ("quantize_fp8", fq.quantize_fp8, hidden, None),
                                    ("silu_and_mul_fp8", fq.silu_and_mul_fp8, inter, None)]:
            arg = x if label == "quantize_fp8" else xgu
            nbytes = arg.numel() * 2 + m * k
            blocks = (512, 1024, 2048, 4096) if group else (4096, 8192, 16384)
            for block in blocks:
                for warps in (2, 4, 8, 16):
                    try:
                        us = bench(lambda: fn(arg, group, block=block, num_warps=warps), rep=50)
                    except Exception as ex:
                        print(f"  sweep act {label} {group} M={m} block={block} warps={warps}: {type(ex).__name__}")
                        continue
                    print(f"  sweep act {label} {'token' if group is None else group} M={m} block={block} "
                          f"warps={warps}: {us:.1f} us {100 * nbytes / (us * 1e-6) / PEAK_BW:.0f}%", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="time launch configs of fp8_gemm_block and the fp8 gemv")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: the interpreter)")
    ap.add_argument("--only", default="gemm,act,gemv", help="comma list: gemm,act,gemv")
    ap.add_argument("--sweep-ms", default="", help="with --sweep: comma list of M (default: all)")
    args = ap.parse_args()
    torch.manual_seed(0)
    shapes, ms, hidden, inter = SHAPES, MS, HIDDEN, INTER
    if args.smoke:
        shapes, ms, hidden, inter = {"qkv": (192, 256), "down": (128, 384)}, (1, 17), 256, 384
    only = set(args.only.split(","))
    if DEV == "cuda":
        print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__}", flush=True)
    if args.sweep:
        if "gemm" in only:
            sweep_gemm(shapes, tuple(int(v) for v in args.sweep_ms.split(",")) if args.sweep_ms else ms)
        if "gemv" in only:
            gemv_rows(shapes, sweep=True)
        if "act" in only:
            sweep_act(tuple(int(v) for v in args.sweep_ms.split(",")) if args.sweep_ms else ms, hidden, inter)
        return
    out = []
    if "gemm" in only:
        out += ["", "| GEMM | M | impl | µs | TFLOP/s | % peak | err / q-err | |", "|---|---|---|---|---|---|---|---|"]
        for name, (n, k) in shapes.items():
            out += gemm_rows(name, n, k, ms)
    if "act" in only:
        out += ["", "| activation op | µs | % of 4.22 TB/s | err |", "|---|---|---|---|"]
        out += act_rows(ms, hidden, inter)
    if "gemv" in only:
        out += ["", "| batch-1 projection | weight | µs | % of 4.22 TB/s | err |", "|---|---|---|---|---|"]
        out += gemv_rows(shapes, sweep=False)
    text = "\n".join(out)
    print(text)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fp8.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
