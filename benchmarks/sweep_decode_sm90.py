"""Launch-parameter sweep of the Hopper decode kernel (``decode_attention_sm90``) at the bench_kernels decode
shapes (llama-3.1-8b heads, pages of 16): each variant and split count checked against the Triton kernel and
timed under a CUDA graph, next to the Triton kernel and (bf16) SDPA on contiguous K/V.

    python benchmarks/sweep_decode_sm90.py --kv-dtype int8 --variants 4,6,4x80 --splits 1,2
    python benchmarks/sweep_decode_sm90.py --batch 1 --ctx 32768 --splits 16,33,64

A variant is STAGES for 16-bit caches, STAGES[xMAX_REGS] for 8-bit ones (``decode_attention_sm90_8bit``: registers
per thread at launch, 128 for two programs an SM, 80 for three); the split counts default to the engine's heuristic.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_kernels import PEAK_BW, bench_graph, contiguous_kv, kv_bytes, paged_cache, quantized_cache, rel_err  # noqa: E402
from minfer.kernels.attention import decode_attention_sm90 as sm90  # noqa: E402
from minfer.kernels.attention.decode_attention import (  # noqa: E402
    SPLIT_TARGET_PER_SM, choose_num_splits, paged_decode_attention)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--variants", default="", help="comma-separated variants (see above; default: shipped)")
    ap.add_argument("--splits", default="", help="split counts, comma-separated; auto: the Hopper entry's heuristic "
                    "(the default)")
    ap.add_argument("--kv-dtype", default="auto", help="auto (bf16) or an 8-bit format: int8, fp8_e4m3, fp8_e5m2")
    args = ap.parse_args()
    os.environ.setdefault("MINFER_SM90_ATTENTION", "1")  # the kernel itself, whatever Triton it was measured on
    hq, hkv, d, page = 32, 8, 128, 16
    kc, vc, table, lens = paged_cache([args.ctx] * args.batch, hkv, d, page)
    q = torch.randn(args.batch, hq, d, device="cuda", dtype=torch.bfloat16)
    sc = {}
    if args.kv_dtype != "auto":
        kc, vc, ks, vs = quantized_cache(kc, vc, args.kv_dtype)
        sc = dict(k_scale=ks, v_scale=vs)
    scale = d ** -0.5
    nbytes = kv_bytes(args.batch * args.ctx, hkv, d, args.kv_dtype) + 4 * q.numel()
    heuristic = choose_num_splits(args.batch, hkv, table.shape[1] * page, q.device)
    per_sm = SPLIT_TARGET_PER_SM if sc else sm90.SPLITS_PER_SM
    sm90_heuristic = choose_num_splits(args.batch, hkv, table.shape[1] * page, q.device, per_sm)
    splits = [sm90_heuristic if s == "auto" else int(s) for s in args.splits.split(",")] if args.splits \
        else [sm90_heuristic]
    ref = paged_decode_attention(q, kc, vc, table, lens, scale, **sc)
    out = torch.empty_like(q)
    print(f"B={args.batch} ctx={args.ctx} {args.kv_dtype}, heuristic splits: triton {heuristic}, "
          f"gluon {sm90_heuristic}\n"
          "| impl | splits | us | TB/s | % of peak | err vs triton |\n|---|---|---|---|---|---|")
    line = lambda name, ns, ms, err: print(f"| {name} | {ns} | {ms * 1e3:.1f} | {nbytes / ms / 1e9:.2f} | "
                                           f"{100 * nbytes / ms / 1e9 / (PEAK_BW / 1e12):.0f}% | {err} |", flush=True)
    line(f"triton {args.kv_dtype}", heuristic, bench_graph(lambda: paged_decode_attention(q, kc, vc, table, lens, scale,
                                                                                          out, **sc)), "")
    sm90_8bit = sm90.sm90_8bit
    defaults = (sm90.STAGES, sm90.SOLE_STAGES, sm90_8bit.STAGES, sm90_8bit.MAX_REGS)
    for v in (args.variants.split(",") if args.variants else ["shipped"]):
        sm90.STAGES, sm90.SOLE_STAGES, sm90_8bit.STAGES, sm90_8bit.MAX_REGS = defaults
        if v != "shipped" and sc:  # STAGES[xMAX_REGS] of the 8-bit kernel
            dims = list(map(int, v.split("x")))
            sm90_8bit.STAGES = dims[0]
            sm90_8bit.MAX_REGS = dims[1] if len(dims) > 1 else sm90_8bit.MAX_REGS
        elif v != "shipped":
            sm90.STAGES = sm90.SOLE_STAGES = int(v)
        for ns in splits:
            # A variant that does not build falls back to the Triton kernel inside the entry point: start each
            # variant afresh and report that instead of timing the fallback.
            sm90._guard.launched.clear()
            sm90._guard.failed.clear()
            fn = lambda: sm90.paged_decode_attention_sm90(q, kc, vc, table, lens, scale, out, num_splits=ns, **sc)
            out.fill_(float("nan"))
            fn()
            if bool(sc) not in sm90._guard.launched:
                print(f"| gluon {v} | {ns} | failed to build (see the warning above) | | | |", flush=True)
                continue
            line(f"gluon {v}", ns, bench_graph(fn), f"{rel_err(out, ref):.1e}")
    if not sc:
        k, v_ = contiguous_kv(kc, vc, table, args.ctx)
        q4 = q[:, :, None, :]
        sd = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v_, scale=scale, enable_gqa=True)
        line("SDPA contiguous", "", bench_graph(sd), f"{rel_err(sd()[:, :, 0], ref):.1e}")


if __name__ == "__main__":
    main()
