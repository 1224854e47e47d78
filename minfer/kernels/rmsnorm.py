"""RMSNorm and fused residual-add + RMSNorm, rounded exactly as HF Llama rounds.

HF computes ``r = x + residual`` in the model dtype, the variance and the normalisation in
float32, casts the normalised row back to the model dtype, and only then multiplies by the weight
(again in the model dtype). We reproduce each rounding step so greedy decoding matches HF
token for token; a single fp32 pass with one final rounding would drift by an ulp here and there.

A float32 weight (Gemma's ``1 + w``, kept in float32 by ``model/layers/norm.py``) is Gemma's rounding
instead: the normalised row stays float32, is multiplied by the weight, and is rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_dtype, check_last_dim_contiguous, next_pow2
from .pdl import launch_options, use_pdl, wait_for_previous


@triton.jit
def norm_row(x, R, W, row, cols, mask, stride_r, hidden, eps, HAS_RESIDUAL: tl.constexpr,
             F32_WEIGHT: tl.constexpr):
    """One loaded row ``x`` (BLOCK wide, ``mask`` over ``hidden``): the residual added (and stored back to R)
    when HAS_RESIDUAL, RMS-normalised and weighted, with HF's roundings; returned in x's dtype. The
    FP8-emitting norm (fp8_quant.py) shares it, so both round alike."""
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(R + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / hidden
    w = tl.load(W + cols, mask=mask, other=0.0)
    if F32_WEIGHT:
        return (w * (xf * tl.rsqrt(var + eps))).to(dtype)
    normed = (xf * tl.rsqrt(var + eps)).to(dtype)
    return (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)


@triton.jit
def _rms_norm_kernel(
    X, R, W, OUT, stride_x, stride_xh, stride_r, heads, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, F32_WEIGHT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(X + (row // heads) * stride_x + (row % heads) * stride_xh + cols, mask=mask, other=0.0)
    out = norm_row(x, R, W, row, cols, mask, stride_r, hidden, eps, HAS_RESIDUAL, F32_WEIGHT)
    tl.store(OUT + row * hidden + cols, out, mask=mask)  # OUT is contiguous


def norm_launch(hidden: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` of a norm over rows of ``hidden``: one row per program, the whole row in one
    block (a 4K-8K row fits in registers, so x is read once and never re-read). The FP8-emitting norm
    (fp8_quant.py) launches by this rule too: the same block and warps reduce alike, so both round alike."""
    block = next_pow2(hidden)
    return block, min(16, max(1, block // 512))


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            num_warps: int | None = None) -> torch.Tensor:
    check_dtype("x", x)
    check_dtype("weight", weight)
    check_last_dim_contiguous("x", x)
    if x.dim() != 2 and (x.dim() != 3 or residual is not None):
        raise ValueError(f"x must be [T, H] (or [T, heads, H] without a residual), got shape {tuple(x.shape)}")
    heads, stride_xh = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    num_rows, hidden = x.shape[0] * heads, x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_rows == 0:
        return out
    res = x if residual is None else residual
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("residual must match x in shape and dtype")
        check_last_dim_contiguous("residual", residual)
    block, default_warps = norm_launch(hidden)
    if num_warps is None:
        num_warps = default_warps
    pdl = use_pdl(x.device)
    _rms_norm_kernel[(num_rows,)](
        x, res, weight, out, x.stride(0), stride_xh, res.stride(0), heads, hidden, eps,
        HAS_RESIDUAL=residual is not None, F32_WEIGHT=weight.dtype == torch.float32, BLOCK=block, PDL=pdl, num_warps=num_warps, **launch_options(pdl),
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dim of ``x`` ``[T, H]``; output in x's dtype.

    ``x`` may also be ``[T, heads, H]`` with any token and head strides (Qwen3's per-head q/k norms
    read the fused qkv output in place, where a reshape would copy every step); the output is
    contiguous."""
    return _launch(x, None, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Set ``residual <- x + residual`` (in place, model dtype) and return ``rms_norm(residual)``."""
    return _launch(x, residual, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference of :func:`rms_norm`, the HF LlamaRMSNorm arithmetic."""
    xf = x.float() if x.dtype != torch.float64 else x
    var = xf.pow(2).mean(-1, keepdim=True)
    if weight.dtype == torch.float32:  # Gemma's rounding: the weight multiplies in float32
        return (weight * (xf * torch.rsqrt(var + eps))).to(x.dtype)
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference of :func:`fused_add_rms_norm` (updates ``residual`` in place)."""
    residual.add_(x)
    return rms_norm_ref(residual, weight, eps)
