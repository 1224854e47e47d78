"""Launch-parameter sweep of the Hopper prefill kernel (``prefill_attention_sm90``) at the bench_kernels
shapes: each variant checked against the Triton kernel, timed under a CUDA graph, next to SDPA.

    python benchmarks/sweep_attention_sm90.py [--t 8192] [--variants 128x128x3,128x64x4]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_kernels import bench_graph, contiguous_kv, paged_cache, rel_err  # noqa: E402
from minfer.kernels import prefill_attention_sm90 as sm90  # noqa: E402
from minfer.kernels.prefill_attention import paged_prefill_attention  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--t", type=int, nargs="+", default=[8192])
    ap.add_argument("--variants", default="128x128x3", help="BLOCK_MxBLOCK_NxSTAGES, comma-separated")
    args = ap.parse_args()
    hq, hkv, d, page = 32, 8, 128, 16
    print("| T | impl | us | TFLOP/s | % of 793 | err vs triton |\n|---|---|---|---|---|---|")
    for t in args.t:
        kc, vc, table, lens = paged_cache([t], hkv, d, page)
        q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
        qsl = torch.tensor([0, t], dtype=torch.int32, device="cuda")
        scale = d ** -0.5
        flops = 4 * t * t / 2 * d * hq
        ref = paged_prefill_attention(q, kc, vc, table, qsl, lens, t, scale)
        line = lambda name, ms, err: print(f"| {t} | {name} | {ms * 1e3:.0f} | {flops / ms / 1e9:.0f} | "
                                           f"{100 * flops / ms / 1e9 / 793:.1f}% | {err} |", flush=True)
        line("triton paged", bench_graph(lambda: paged_prefill_attention(q, kc, vc, table, qsl, lens, t, scale)), "")
        out = torch.empty_like(q)
        for v in args.variants.split(","):
            sm90.BLOCK_M, sm90.BLOCK_N, sm90.STAGES = map(int, v.split("x"))
            try:
                fn = lambda: sm90.paged_prefill_attention_sm90(q, kc, vc, table, qsl, lens, t, scale, out)
                out.fill_(float("nan"))
                fn()
                line(f"gluon {v}", bench_graph(fn), f"{rel_err(out, ref):.1e}")
            except Exception as e:  # a variant that does not fit (shared memory, registers)
                print(f"| {t} | gluon {v} | failed: {type(e).__name__}: {str(e)[:120]} | | | |", flush=True)
        k, v_ = contiguous_kv(kc, vc, table, t)
        q4 = q.transpose(0, 1)[None]
        sd = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v_, is_causal=True, scale=scale,
                                                                      enable_gqa=True)
        line("SDPA contiguous", bench_graph(sd), "")


if __name__ == "__main__":
    main()
