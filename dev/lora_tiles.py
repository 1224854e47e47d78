"""The LoRA kernels' launches as an eager step makes them: shrink and expand called back to back from Python (no
CUDA graph) for each block_m (and the expand's BLOCK_N) at llama-3.1-8b's four fused layers, rank 16, 1 and 8
adapters, over decode-batch token counts. On an H200 every pair takes 73-160 µs, its host launch cost, against
7-30 µs of GPU work (benchmarks/RESULTS.md): timing tiles needs graph replays (``bench_lora.py kernels``).

Usage (GPU): PYTHONPATH=. python3 dev/lora_tiles.py   — writes every setting's µs to $OUT/lora_tiles.md and
prints, for each layer, token count and adapter count, the default's time (block_m 16 to 256 tokens, BLOCK_N 64)
and the best setting's.
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


def _time(fn, iters: int = 100) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / iters


def main() -> None:
    dev, dt, rank, loras = torch.device("cuda"), torch.bfloat16, 16, 8
    rows = ["| layer | tokens | adapters | block_m | BLOCK_N | shrink µs | expand µs | sum µs |", "|---|" * 8]
    print("| layer | tokens | adapters | default µs | best µs | best block_m / BLOCK_N |\n|---|---|---|---|---|---|")
    for (name, (k, sizes)), t, used in itertools.product(LAYERS.items(), (64, 128, 256, 512), (1, 8)):
        x = torch.randn(t, k, device=dev, dtype=dt)
        a = torch.randn(loras, len(sizes), rank, k, device=dev, dtype=dt) * 0.02
        b = torch.randn(loras, sum(sizes), rank, device=dev, dtype=dt) * 0.02
        out = torch.zeros(t, sum(sizes), device=dev, dtype=dt)
        meta = build_lora_meta(torch.arange(t, device=dev) % used, loras)
        times = {}
        for block_m, block_n in itertools.product((16, 32, 64), (64, 128)):
            lora.BLOCK_N = block_n
            buf = lora.lora_shrink(x, a, meta, block_m=block_m)
            shrink = _time(lambda: lora.lora_shrink(x, a, meta, block_m=block_m))
            expand = _time(lambda: lora.lora_expand(buf, b, meta, out, sizes, block_m=block_m))
            times[block_m, block_n] = shrink + expand
            rows.append(f"| {name} | {t} | {used} | {block_m} | {block_n} | {shrink:.1f} | {expand:.1f} | "
                        f"{shrink + expand:.1f} |")
        best = min(times, key=times.get)
        default = times[lora.default_block_m(t), 64]
        print(f"| {name} | {t} | {used} | {default:.1f} | {times[best]:.1f} | {best[0]} / {best[1]} |", flush=True)
    lora.BLOCK_N = 64
    out_dir = Path(os.environ.get("OUT", "/tmp/minfer-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "lora_tiles.md").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
