"""The MoE decode kernels (``kernels/moe/moe_decode.py``) at the MoE shapes (bf16; gpt-oss MXFP4), each timed.

A decode step replays the layer in a CUDA graph, so every figure here is a graph replay's (L2 warm: the chosen
experts' weights, tens of MB, mostly do not fit the 60 MB L2 across 48 layers, but a single layer's replay does;
the byte bound is printed beside it). For each layer and T: the grouped GEMMs (``fused_moe``), the decode op with
its default config, the split of that default into its gate/up and down kernels (torch.profiler over replays), and
the decode op under each candidate ``MoeDecodeConfig``.

Usage (GPU): PYTHONPATH=. python3 dev/moe_decode_sweep.py [--only qwen3-30b-a3b] [--tokens 1,4,8]
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from minfer.kernels.moe.moe import fused_moe
from minfer.kernels.moe.moe_args import MoeDecodeConfig, moe_decode_config
from minfer.kernels.moe.moe_decode import fused_moe_decode
from minfer.kernels.quant.mxfp4_ref import quantize_mxfp4

# name: (H, I, experts, top_k, MXFP4 experts as gpt-oss's)
LAYERS = {"qwen3-30b-a3b": (2048, 768, 128, 8, False), "qwen3.5-35b-a3b": (2048, 512, 256, 8, False),
          "gpt-oss-20b": (2880, 2880, 32, 4, True), "mixtral-8x7b": (4096, 14336, 8, 2, False)}
# (gate/up rows, down rows, tile, warps, K-loop pipelining depth, experts in turn); a depth above 1 has Triton copy
# the weight chunks ahead into shared memory (gemm/gemv_config.STREAM_STAGES)
CANDIDATES = [(8, 4, 8192, 4, 1, False), (8, 4, 8192, 4, 3, False), (8, 8, 8192, 8, 1, False),
              (8, 4, 2048, 2, 1, False), (8, 4, 4096, 4, 1, True), (8, 4, 4096, 4, 2, True), (8, 4, 4096, 4, 3, True),
              (8, 4, 4096, 4, 4, True), (8, 4, 8192, 4, 1, True), (8, 4, 8192, 4, 3, True), (8, 8, 8192, 4, 3, True),
              (8, 2, 4096, 4, 3, True), (8, 4, 2048, 2, 3, True), (8, 1, 2048, 2, 3, True), (16, 4, 8192, 8, 3, True),
              (4, 4, 4096, 4, 3, True), (4, 4, 2048, 4, 4, True)]


def graph_us(fn, iters: int = 100) -> float:
    """µs per replay of a graph of ``fn`` (lora_tiles' graph timer; this script's directory is on the path)."""
    from lora_tiles import _time
    return _time(fn, iters)


def kernel_split(fn, iters: int = 50) -> dict[str, float]:
    """µs per call of each kernel ``fn`` launches, from the profiler's device times over graph replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            graph.replay()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_time_total > 0 and "kernel" in ev.key:
            out[ev.key[:40]] = ev.device_time_total / iters
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="qwen3-30b-a3b,qwen3.5-35b-a3b,gpt-oss-20b")
    ap.add_argument("--tokens", default="1,4,8")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    print("| layer | T | bound µs | grouped µs | decode default µs | default's kernels µs | best µs | best config |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.only.split(","):
        h, i, e, k, mxfp4 = LAYERS[name]
        if mxfp4:  # gpt-oss: MXFP4 codes with biases, clamped SwiGLU, top-k-then-softmax routing
            gate_up = [quantize_mxfp4(torch.randn(2 * i, h, device=dev) * 3 / h ** 0.5) for _ in range(e)]
            down = [quantize_mxfp4(torch.randn(h, i, device=dev) / i ** 0.5) for _ in range(e)]
            w_gu, w_d = torch.stack([b for b, _ in gate_up]), torch.stack([b for b, _ in down])
            extra = dict(scale_gate_up=torch.stack([s for _, s in gate_up]),
                         scale_down=torch.stack([s for _, s in down]),
                         bias_gate_up=torch.randn(e, 2 * i, device=dev).to(dt),
                         bias_down=(0.1 * torch.randn(e, h, device=dev)).to(dt), swiglu_limit=7.0, swiglu_alpha=1.702,
                         topk_softmax=True)
        else:
            w_gu = (torch.randn(e, 2 * i, h, device=dev) / h ** 0.5).to(dt)
            w_d = (torch.randn(e, h, i, device=dev) / i ** 0.5).to(dt)
            extra = {}
        for t in (int(v) for v in args.tokens.split(",")):
            x = torch.randn(t, h, device=dev).to(dt)
            logits = torch.randn(t, e, device=dev).to(dt)
            used = len(torch.unique(torch.topk(logits.float(), k, dim=-1).indices))
            bound = used * 3 * h * i * (17 / 32 if mxfp4 else 2) / 4.22e12 * 1e6
            kw = dict(top_k=k, renormalize=not mxfp4, **extra)
            want = fused_moe(x, logits, w_gu, w_d, **kw)
            grouped = graph_us(lambda: fused_moe(x, logits, w_gu, w_d, **kw))
            default = graph_us(lambda: fused_moe_decode(x, logits, w_gu, w_d, **kw))
            split = kernel_split(lambda: fused_moe_decode(x, logits, w_gu, w_d, **kw))
            times = {}
            for c in CANDIDATES:
                cfg = MoeDecodeConfig(*c)
                try:
                    got = fused_moe_decode(x, logits, w_gu, w_d, config=cfg, **kw)
                    err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                    times[c] = (graph_us(lambda: fused_moe_decode(x, logits, w_gu, w_d, config=cfg, **kw)), err)
                except Exception as exc:  # noqa: BLE001 (a config too big for the kernel: skip it)
                    print(f"  {c}: {type(exc).__name__} {str(exc)[:80]}", flush=True)
            best = min(times, key=lambda c: times[c][0])
            split_s = ", ".join(f"{n.split('(')[0]} {v:.1f}" for n, v in split.items())
            print(f"| {name} | {t} | {bound:.1f} | {grouped:.1f} | {default:.1f} "
                  f"(cfg {moe_decode_config(0.5 if mxfp4 else 2, h, i, x.device)}) | {split_s} | {times[best][0]:.1f} "
                  f"(err {times[best][1]:.1e}) | {best} |", flush=True)
            for c, (us, err) in sorted(times.items(), key=lambda kv: kv[1][0])[:6]:
                print(f"    {c}: {us:.1f} µs, err {err:.1e}")


if __name__ == "__main__":
    main()
