"""Fused random sampling: temperature, Gumbel noise and argmax in one pass over the logits.

The engine's sampler draws from softmax(logits / T) as ``argmax(logits / T + g)`` with Gumbel noise
``g = -log(-log u)``, where ``u`` is a counter-based hash of (the row's seed and output index, the
token id): see ``minfer.engine.sampler.uniform_noise``, the reference. In torch that is a dozen
full passes over a ``[rows, vocab]`` int64 tensor (a quarter of a decode step's GPU time at a
150k vocabulary); here each program reads its row's logits once and keeps a running argmax.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(LOGITS, ROW_HASH, INV_TEMP, OUT, stride, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_hash = tl.load(ROW_HASH + row).to(tl.uint32)
    inv_temp = tl.load(INV_TEMP + row)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        logits = tl.load(LOGITS + row * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        col_hash = _mix32(cols.to(tl.uint32) * 0x27D4EB2F + 0x165667B1)
        bits = _mix32(row_hash ^ col_hash) >> 8
        u = (bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = logits * inv_temp - tl.log(-tl.log(u))
        better = score > best_val
        best_val = tl.where(better, score, best_val)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, vocab), axis=0)  # lowest index among ties
    tl.store(OUT + row, idx.to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, row_hash: torch.Tensor, temperature: torch.Tensor,
                  block: int = 2048) -> torch.Tensor:
    """Sampled token per row of ``logits`` [rows, vocab] (float32). ``row_hash`` (int64, values in
    [0, 2^32)) is the per-row hash of seed and output index; ``temperature`` float32 [rows] > 0."""
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _gumbel_argmax_kernel[(rows,)](logits, row_hash, (1.0 / temperature).float().contiguous(), out,
                                       logits.stride(0), vocab, BLOCK=block, num_warps=8)
    return out
