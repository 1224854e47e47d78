"""Greedy and Gumbel-max draws in plain torch: the CPU path and the reference of the fused kernels
(``minfer/kernels/sampling.py``).

The noise is a counter-based hash of (the row's hash of seed and output index, the token id), so a
seeded request draws the same numbers whatever else is in its batch.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche finaliser on int64 tensors (or uint64 arrays) holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def noise_from_row_hash(row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform noise u[r, v] in (0, 1) from the rows' hashes (int64 ``[R]``): 23 random bits per token, so
    ``bits + 0.5`` is exact in float32 and u stays below 1 (u = 1 would make the Gumbel noise +inf)."""
    col = mix32((torch.arange(vocab_size, device=row.device) * 0x27D4EB2F + 0x165667B1) & _M32)
    bits = mix32(row[:, None] ^ col[None, :]) >> 9
    return (bits.float() + 0.5) * (1.0 / (1 << 23))


def gumbel_argmax(logits: torch.Tensor, row_hash: torch.Tensor, inv_temperature: torch.Tensor) -> torch.Tensor:
    """``argmax(logits / T - log(-log u))``: an exact draw from softmax(logits / T) (Gumbel-max)."""
    gumbel = -torch.log(-torch.log(noise_from_row_hash(row_hash, logits.shape[-1])))
    return (logits * inv_temperature[:, None] + gumbel).argmax(-1)
