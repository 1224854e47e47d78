"""Launch-parameter sweep of the Hopper decode kernel (``decode_attention_sm90``) at the bench_kernels decode
shapes (llama-3.1-8b heads, pages of 16): each variant and split count checked against the Triton kernel and
timed under a CUDA graph, next to the Triton kernel and (bf16) SDPA on contiguous K/V. Split launches are timed
with the merge in the split kernel ("fused") and with the merge kernel after it ("2-launch"); ``--merge`` picks one.

    python benchmarks/sweep_decode_sm90.py --kv-dtype int8 --variants 4,6,4x80 --splits 1,2
    python benchmarks/sweep_decode_sm90.py --batch 1 --ctx 32768 --splits 16,33,64
    python benchmarks/sweep_decode_sm90.py --shapes 1x32768,1x4096,64x4096   # fused vs 2-launch merge, and SDPA

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
from minfer.kernels.attention.decode_attention import choose_num_splits, paged_decode_attention  # noqa: E402


MERGES = {"fused": True, "2-launch": False}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--shapes", default="", help="BxCTX shapes, comma-separated, instead of --batch and --ctx")
    ap.add_argument("--variants", default="", help="comma-separated variants (see above; default: shipped)")
    ap.add_argument("--splits", default="", help="split counts or auto, comma-separated (default: the Triton "
                    "kernel's heuristic)")
    ap.add_argument("--kv-dtype", default="auto", help="auto (bf16) or an 8-bit format: int8, fp8_e4m3, fp8_e5m2")
    ap.add_argument("--merge", default="both", choices=["both", *MERGES], help="how split launches merge")
    args = ap.parse_args()
    os.environ.setdefault("MINFER_SM90_ATTENTION", "1")  # the kernel itself, whatever Triton it was measured on
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else \
        [(args.batch, args.ctx)]
    for batch, ctx in shapes:
        sweep(args, batch, ctx)
        torch.cuda.empty_cache()


def sweep(args: argparse.Namespace, batch: int, ctx: int) -> None:
    """The table of one (batch, context) shape."""
    args.batch, args.ctx = batch, ctx
    merges = list(MERGES) if args.merge == "both" else [args.merge]
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
    # "auto": the Hopper entry point's own choice (one program per SM for 16-bit caches), as the engine runs it.
    splits = [None if s == "auto" else int(s) for s in args.splits.split(",")] if args.splits else [heuristic]
    ref = paged_decode_attention(q, kc, vc, table, lens, scale, **sc)
    out = torch.empty_like(q)
    print(f"\nB={args.batch} ctx={args.ctx} {args.kv_dtype}, heuristic splits {heuristic} (the Hopper kernel's may "
          "differ)\n| impl | splits | merge | us | TB/s | % of peak | err vs triton |\n|---|---|---|---|---|---|---|")
    line = lambda name, ns, ms, err, m="": print(  # noqa: E731
        f"| {name} | {ns} | {m} | {ms * 1e3:.1f} | {nbytes / ms / 1e9:.2f} | "
        f"{100 * nbytes / ms / 1e9 / (PEAK_BW / 1e12):.0f}% | {err} |", flush=True)
    for m in merges:
        fn = lambda: paged_decode_attention(q, kc, vc, table, lens, scale, out, fused_merge=MERGES[m], **sc)  # noqa
        out.fill_(float("nan"))
        fn()
        line(f"triton {args.kv_dtype}", heuristic, bench_graph(fn), f"{rel_err(out, ref):.1e}", m)
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
        for ns, m in [(ns, m) for ns in splits for m in merges]:
            # A variant that does not build falls back to the Triton kernel inside the entry point: start each
            # variant afresh and report that instead of timing the fallback.
            sm90._guard.launched.clear()
            sm90._guard.failed.clear()
            fn = lambda: sm90.paged_decode_attention_sm90(  # noqa: E731
                q, kc, vc, table, lens, scale, out, num_splits=ns, fused_merge=MERGES[m], **sc)
            out.fill_(float("nan"))
            fn()
            if sm90._guard.failed or not sm90._guard.launched:
                print(f"| gluon {v} | {ns or 'auto'} | {m} | failed to build (see the warning above) | | | |",
                      flush=True)
                continue
            line(f"gluon {v}", ns or "auto", bench_graph(fn), f"{rel_err(out, ref):.1e}", m)
    if not sc:
        k, v_ = contiguous_kv(kc, vc, table, args.ctx)
        q4 = q[:, :, None, :]
        sd = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v_, scale=scale, enable_gqa=True)
        line("SDPA contiguous", "", bench_graph(sd), f"{rel_err(sd()[:, :, 0], ref):.1e}")


if __name__ == "__main__":
    main()
