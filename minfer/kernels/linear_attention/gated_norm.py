"""The Gated DeltaNet's output norm (HF's ``Qwen3_5RMSNormGated``) in one launch: each value head's output
RMS-normalised, times the weight, times ``silu(z)``.

In torch this is a dozen elementwise launches over a few KB per token (the casts, the square, the mean, the
rsqrt, the products, the SiLU), once in each of Qwen3.5-9B's 24 linear layers. Here a program takes one token's
heads as a ``[heads, D]`` tile and writes the result in one pass, with HF's roundings: the normed value rounded to
x's dtype before the weight multiplies it (in that dtype), the gate's SiLU and its product in float32, one last
rounding. At one token the matrix-vector kernel folds the same arithmetic into ``out_proj``
(``gemm/gemv_gated.py``'s ``gemv_gated_rms_norm``). Reference: ``gated_delta_ref.gated_rms_norm_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_dtype, next_pow2


@triton.jit
def _gated_rms_norm_kernel(X, Z, W, O, stride_xt, stride_xh, stride_zt, stride_zh, num_heads, dim, eps,
                           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (heads < num_heads)[:, None] & (d < dim)[None, :]
    x = tl.load(X + t * stride_xt + heads[:, None] * stride_xh + d[None, :], mask=mask, other=0.0)
    z = tl.load(Z + t * stride_zt + heads[:, None] * stride_zh + d[None, :], mask=mask, other=0.0)
    w = tl.load(W + d, mask=d < dim, other=0.0)
    dtype = x.dtype
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / dim + eps)
    h = (xf * inv[:, None]).to(dtype)
    h = (w.to(tl.float32)[None, :] * h.to(tl.float32)).to(dtype)
    zf = z.to(tl.float32)
    out = (h.to(tl.float32) * (zf / (1.0 + tl.exp(-zf)))).to(dtype)
    tl.store(O + (t * num_heads + heads[:, None]) * dim + d[None, :], out, mask=mask)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``gated_rms_norm_ref`` in Triton: x and gate [T, H, D] (strided views with a contiguous last dimension;
    gate is a slice of the fused z|b|a projection), weight [D] -> a contiguous [T, H, D] in x's dtype."""
    check_dtype("x", x)
    check_dtype("gate", gate)
    if x.dim() != 3 or gate.shape != x.shape or weight.shape != x.shape[-1:] or x.stride(2) != 1 \
            or gate.stride(2) != 1 or not weight.is_contiguous():
        raise ValueError(f"expected x and gate [T, H, D] with contiguous heads and weight [D], got {tuple(x.shape)}, "
                         f"{tuple(gate.shape)}, {tuple(weight.shape)}")
    t, h, d = x.shape
    out = torch.empty(t, h, d, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block_d = next_pow2(d)
    block_h = min(next_pow2(h), max(1, 4096 // block_d))
    _gated_rms_norm_kernel[(t, triton.cdiv(h, block_h))](
        x, gate, weight, out, x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), h, d, eps,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
    return out
