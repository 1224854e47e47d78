"""The LoRA kernels' tiles timed as a decode graph runs them: shrink and expand captured in one CUDA graph for each
block_m, BLOCK_N and split_k at llama-3.1-8b's four fused layers, rank 16, 1 and 8 adapters, over decode-batch token
counts (timed back to back from Python each pair costs its host launch, 73-160 µs on an H200, which hides the tiles).

Usage (GPU): PYTHONPATH=. python3 dev/lora_tiles.py   — writes every setting's µs to $OUT/lora_tiles.md and
prints, for each layer, token count and adapter count, the default's time and the best setting's.
"""
from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch

import minfer.kernels.lora.lora as lora
from minfer.kernels.lora.lora_meta import build_lora_meta

LAYERS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
          "down": (14336, (4096,))}


def _time(fn, iters: int = 50) -> float:
    """µs per replay of a graph of ``fn`` (compiled first, outside the capture)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / iters


def main() -> None:
    dev, dt, rank, loras = torch.device("cuda"), torch.bfloat16, 16, 8
    rows = ["| layer | tokens | adapters | block_m | BLOCK_N | split_k | µs |", "|---|" * 7]
    print("| layer | tokens | adapters | default µs | best µs | best block_m / BLOCK_N / split_k |")
    print("|---|" * 6)
    for (name, (k, sizes)), t, used in itertools.product(LAYERS.items(), (1, 8, 64, 256), (1, 8)):
        if used > t:
            continue
        x = torch.randn(t, k, device=dev, dtype=dt)
        a = torch.randn(loras, len(sizes), rank, k, device=dev, dtype=dt) * 0.02
        b = torch.randn(loras, sum(sizes), rank, device=dev, dtype=dt) * 0.02
        out = torch.zeros(t, sum(sizes), device=dev, dtype=dt)
        meta = build_lora_meta(torch.arange(t, device=dev) % used, loras)
        times = {}
        for block_m, block_n, split in itertools.product((16, 32, 64), (64, 128, 256), (None, 1, 4)):

            def pair() -> None:
                buf = lora.lora_shrink(x, a, meta, split_k=split, block_m=block_m)
                lora.lora_expand(buf, b, meta, out, sizes, block_m=block_m, block_n=block_n)
            times[block_m, block_n, split] = us = _time(pair)
            rows.append(f"| {name} | {t} | {used} | {block_m} | {block_n} | {split} | {us:.1f} |")
        best = min(times, key=times.get)
        default = times[lora.default_block_m(t), lora.default_block_n(t, sizes), None]
        print(f"| {name} | {t} | {used} | {default:.1f} | {times[best]:.1f} | {' / '.join(map(str, best))} |",
              flush=True)
    out_dir = Path(os.environ.get("OUT", "/tmp/minfer-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "lora_tiles.md").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
