"""Launch-parameter sweep of the Hopper prefill kernel (``prefill_attention_sm90``) at the bench_kernels
shapes: each variant checked against the Triton kernel, timed under a CUDA graph, next to SDPA.

    python benchmarks/sweep_attention_sm90.py [--t 8192] [--variants 128x128x3,128x64x4]
    python benchmarks/sweep_attention_sm90.py --kv-dtype int8 --variants 128x128x2x2,128x64x4x3

A variant is BLOCK_M x BLOCK_N x STAGES (the ring the consumers read) [x CODE_STAGES [x CONVERT_ROWS
[x consumer registers x converter registers]], 8-bit caches]; the parameters it leaves out keep their
shipped values.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_kernels import bench_graph, contiguous_kv, paged_cache, quantized_cache, rel_err  # noqa: E402
from minfer.kernels.attention import prefill_attention_sm90 as sm90  # noqa: E402
from minfer.kernels.attention.prefill_attention import paged_prefill_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, nargs="+", default=[8192])
    ap.add_argument("--variants", default="128x128x3", help="BLOCK_MxBLOCK_NxSTAGES[xCODE_STAGES], comma-separated")
    ap.add_argument("--kv-dtype", default="auto", help="auto (bf16) or an 8-bit format: int8, fp8_e4m3, fp8_e5m2")
    args = ap.parse_args()
    os.environ.setdefault("MINFER_SM90_ATTENTION", "1")  # the kernel itself, whatever Triton it was measured on
    defaults = {name: getattr(sm90, name) for name in
                ("BLOCK_M", "BLOCK_N", "STAGES", "QUANT_STAGES", "CODE_STAGES", "CONVERT_ROWS", "QUANT_REGS")}
    hq, hkv, d, page = 32, 8, 128, 16
    print("| T | impl | us | TFLOP/s | % of 793 | err vs triton |\n|---|---|---|---|---|---|")
    for t in args.t:
        kc, vc, table, lens = paged_cache([t], hkv, d, page)
        sc = {}
        if args.kv_dtype != "auto":
            kc, vc, ks, vs = quantized_cache(kc, vc, args.kv_dtype)
            sc = dict(k_scale=ks, v_scale=vs)
        q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
        qsl = torch.tensor([0, t], dtype=torch.int32, device="cuda")
        scale = d ** -0.5
        flops = 4 * t * t / 2 * d * hq
        ref = paged_prefill_attention(q, kc, vc, table, qsl, lens, t, scale, **sc)
        line = lambda name, ms, err: print(f"| {t} | {name} | {ms * 1e3:.0f} | {flops / ms / 1e9:.0f} | "
                                           f"{100 * flops / ms / 1e9 / 793:.1f}% | {err} |", flush=True)
        line(f"triton paged {args.kv_dtype}",
             bench_graph(lambda: paged_prefill_attention(q, kc, vc, table, qsl, lens, t, scale, **sc)), "")
        out = torch.empty_like(q)
        for v in args.variants.split(","):
            for name, value in defaults.items():  # each variant from the shipped parameters
                setattr(sm90, name, value)
            dims = list(map(int, v.split("x")))
            sm90.BLOCK_M, sm90.BLOCK_N = dims[:2]
            if sc:
                sm90.QUANT_STAGES, sm90.CODE_STAGES = dims[2:4]
                if len(dims) > 4:
                    sm90.CONVERT_ROWS = dims[4]
                if len(dims) > 6:
                    sm90.QUANT_REGS = (dims[5], sm90.QUANT_REGS[1], dims[6])
            else:
                sm90.STAGES = dims[2]
            # A variant that does not build (shared memory, registers) falls back to the Triton kernel inside
            # the entry point: start each variant afresh and report that instead of timing the fallback.
            sm90._guard.launched.clear()
            sm90._guard.failed.clear()
            fn = lambda: sm90.paged_prefill_attention_sm90(q, kc, vc, table, qsl, lens, t, scale, out, **sc)
            out.fill_(float("nan"))
            fn()
            if bool(sc) not in sm90._guard.launched:
                print(f"| {t} | gluon {v} | failed to build (see the warning above) | | | |", flush=True)
                continue
            line(f"gluon {v}", bench_graph(fn), f"{rel_err(out, ref):.1e}")
        if sc:
            continue
        k, v_ = contiguous_kv(kc, vc, table, t)
        q4 = q.transpose(0, 1)[None]
        sd = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v_, is_causal=True, scale=scale,
                                                                      enable_gqa=True)
        line("SDPA contiguous", bench_graph(sd), "")


if __name__ == "__main__":
    main()
