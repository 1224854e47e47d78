"""Batch-1 LoRA in the fused matrix-vector chain, as the one-token forward runs it: four llama-3.1-8b layers'
projections (qkv behind the RMS prologue, o, gate_up behind the RMS prologue, down behind SwiGLU) captured in one
CUDA graph, without LoRA, then with a rank-16 adapter (slot 0) and with none (slot -1, the shrinks exit at once),
for each shrink launch config (rows a program, columns a chunk, the most parts of K) and with PDL on and off.

Usage (GPU): PYTHONPATH=. python3 dev/gemv_lora_chain.py   — prints µs a layer and writes $OUT/gemv_lora_chain.md.
"""
from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch

from minfer.kernels.gemm import gemv as g
from minfer.kernels.gemm.gemv_config import GemvConfig
from minfer.kernels.gemm.gemv_lora import GemvLora

H, FFN, RANK, SLOTS, LAYERS = 4096, 14336, 16, 4, 4
DEV, DT = torch.device("cuda"), torch.bfloat16


def _w(n: int, k: int) -> torch.Tensor:
    return torch.randn(n, k, device=DEV, dtype=DT) / k ** 0.5


def _lora(slot: torch.Tensor, sizes: tuple[int, ...], k: int) -> GemvLora:
    a = torch.randn(SLOTS, len(sizes), RANK, k, device=DEV, dtype=DT) * 0.01
    b = torch.randn(SLOTS, sum(sizes), RANK, device=DEV, dtype=DT) * 0.01
    return GemvLora(slot, a, b, sizes)


def _replay_us(fn) -> float:
    """µs a layer per replay of a graph of ``fn`` (lora_tiles' graph timer; this script's directory is on the path)."""
    from lora_tiles import _time

    return _time(fn) / LAYERS


def main() -> None:
    torch.manual_seed(0)
    weights = [(_w(6144, H), _w(H, H), _w(2 * FFN, H), _w(H, FFN)) for _ in range(LAYERS)]
    slot = torch.zeros(1, dtype=torch.int32, device=DEV)
    loras = [(_lora(slot, (H, 1024, 1024), H), _lora(slot, (H,), H), _lora(slot, (FFN, FFN), H), _lora(slot, (H,), FFN))
             for _ in range(LAYERS)]
    norm_w = torch.ones(H, device=DEV, dtype=DT)
    x0, attn = torch.randn(1, H, device=DEV, dtype=DT), torch.randn(1, H, device=DEV, dtype=DT)

    def chain(use: bool) -> None:
        x, res = x0, None
        for (wq, wo, wgu, wd), lo in zip(weights, loras):
            _, res = g.gemv_rms_norm(x, res, norm_w, 1e-5, wq, lora=lo[0] if use else None)
            x = g.gemv(attn, wo, lora=lo[1] if use else None)
            gu, res = g.gemv_rms_norm(x, res, norm_w, 1e-5, wgu, lora=lo[2] if use else None)
            x = g.gemv_silu_mul(gu, wd, lora=lo[3] if use else None)

    rows = ["| shrink block_n / block_k / warps | max parts | PDL | base µs | adapter µs | no adapter µs |",
            "|---|" * 6]
    default_cfg, default_split = g.lora_shrink_config, g.LORA_MAX_SPLIT
    variants = [(None, None, True)] + [(GemvConfig(bn, bk, w), split, True) for (bn, bk, w), split in
                                        itertools.product(((1, 512, 4), (1, 2048, 4), (4, 512, 4), (4, 2048, 8),
                                                           (2, 1024, 4)), (1, 4, 16))] + [(None, None, False)]
    for cfg, split, pdl in variants:
        os.environ["MINFER_PDL"] = "1" if pdl else "0"
        g.lora_shrink_config = default_cfg if cfg is None else (lambda *_, c=cfg: c)
        g.LORA_MAX_SPLIT = default_split if split is None else split
        base = _replay_us(lambda: chain(False))
        slot.fill_(0)
        with_adapter = _replay_us(lambda: chain(True))
        slot.fill_(-1)
        without = _replay_us(lambda: chain(True))
        name = "default" if cfg is None else f"{cfg.block_n} / {cfg.block_k} / {cfg.num_warps}"
        line = (f"| {name} | {g.LORA_MAX_SPLIT} | {'on' if pdl else 'off'} | {base:.1f} | {with_adapter:.1f} | "
                f"{without:.1f} |")
        rows.append(line)
        print(line, flush=True)
    out = Path(os.environ.get("OUT", "/tmp/minfer-out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv_lora_chain.md").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
