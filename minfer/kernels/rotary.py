"""Rotary position embedding, non-interleaved ("rotate_half", HF Llama / GPT-NeoX style), in place.

The cache holds ``cos`` in ``[:, :D/2]`` and ``sin`` in ``[:, D/2:]`` as float32, so any rope
scaling (Llama 3, YaRN, ...) is decided once when the cache is built and this kernel never
changes. q and k usually are strided views into the fused qkv projection: we write through the
views instead of copying, which saves a full read and write of q and k.

The engine rotates inside its KV-store launch (``rope_store.py``); this standalone kernel is what
that fused one is tested against, element for element, and a building block for other callers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_dtype, check_last_dim_contiguous, next_pow2


@triton.jit
def _rotate_heads(X, row, stride_h, cos, sin, NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    mask = heads[:, None] < NUM_HEADS
    p1 = X + row + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    tl.store(p1, (x1f * cos - x2f * sin).to(x1.dtype), mask=mask)
    tl.store(p1 + HALF, (x2f * cos + x1f * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    Q, K, POS, CACHE, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t)
    dims = tl.arange(0, HALF)
    cos = tl.load(CACHE + pos * stride_c + dims)[None, :]
    sin = tl.load(CACHE + pos * stride_c + HALF + dims)[None, :]
    _rotate_heads(Q, t * stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, BLOCK_HQ, HALF)
    _rotate_heads(K, t * stride_kt, stride_kh, cos, sin, NUM_K_HEADS, BLOCK_HK, HALF)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 *, num_warps: int | None = None) -> None:
    """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` in place by ``positions`` (int64 ``[T]``).

    Only the last dimension of q and k must be contiguous; token and head strides are free.
    Arithmetic is float32 with one rounding to the input dtype.
    """
    check_dtype("q", q)
    check_dtype("k", k)
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("k", k)
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1):
        raise ValueError(f"head_dim must be a power of two >= 2, got {head_dim}")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(f"cos_sin_cache must be float32 [max_pos, {head_dim}]")
    if num_tokens == 0:
        return
    block_hq, block_hk = next_pow2(num_q_heads), next_pow2(num_k_heads)
    if num_warps is None:
        num_warps = min(8, max(1, block_hq * head_dim // 1024))
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, HALF=head_dim // 2, num_warps=num_warps,
    )


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Torch reference of :func:`apply_rotary` (in place, float32 math, one rounding)."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions]
    for x in (q, k):
        cos = cs[:, None, :half].to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        sin = cs[:, None, half:].to(cos.dtype)
        xf = x.to(cos.dtype)
        x1, x2 = xf[..., :half], xf[..., half:]
        x.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
