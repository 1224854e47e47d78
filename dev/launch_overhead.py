"""Host cost of one kernel launch, per kind of launch (GPU): what an eager engine step pays per kernel.

A CUDA-graph decode step replays its kernels without Python; an eager step (any step that carries
prompt tokens) launches each one from Python. With tiny tensors the GPU finishes each kernel long
before the next launch is ready, so the wall time of N back-to-back launches over N is the host
cost of one. Compared: a torch elementwise op, ``torch.mm``, the Triton launchers of the engine
(argument checks included), and a bare ``kernel[grid](...)`` call without our checks.

Usage: python3 dev/launch_overhead.py [--calls 2000]
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from minfer.kernels.rmsnorm import _rms_norm_kernel, rms_norm
from minfer.kernels.rope_store import rope_store_kv
from minfer.model.layers.rotary import RotaryEmbedding


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(4, 1024, device=dev, dtype=dt)
    w = torch.ones(1024, device=dev, dtype=dt)
    out = torch.empty_like(x)
    a = torch.randn(4, 1024, device=dev, dtype=dt)
    b = torch.randn(1024, 1024, device=dev, dtype=dt)
    qkv = torch.randn(4, 32 * 128, device=dev, dtype=dt)
    q, k, v = qkv[:, :2048].view(4, 16, 128), qkv[:, 2048:3072].view(4, 8, 128), qkv[:, 3072:].view(4, 8, 128)
    cache = RotaryEmbedding(128, 4096, 1e6, None).cos_sin_cache.to(dev)
    kc, vc = (torch.zeros(8, 16, 8, 128, device=dev, dtype=dt) for _ in range(2))
    pos = torch.arange(4, device=dev)
    slots = torch.arange(4, device=dev)
    cases = {
        "torch add (x + x)": lambda: x + x,
        "torch.mm [4,1024]x[1024,1024]": lambda: torch.mm(a, b),
        "rms_norm launcher": lambda: rms_norm(x, w, 1e-6),
        "bare _rms_norm_kernel[grid]": lambda: _rms_norm_kernel[(4,)](
            x, x, w, out, 1024, 0, 1024, 1, 1024, 1e-6, HAS_RESIDUAL=False, BLOCK=1024, num_warps=2),
        "rope_store_kv launcher": lambda: rope_store_kv(q, k, v, pos, cache, kc, vc, slots),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, fn in cases.items():
        print(f"{name:36s} {per_call_us(fn, args.calls):7.1f} us per call")


if __name__ == "__main__":
    main()
