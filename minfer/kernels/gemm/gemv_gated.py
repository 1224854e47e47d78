"""Qwen3.5's two gated inputs as matrix-vector launches (``gemv.py``'s kernel, its prologues 4 and 5):
:func:`gemv_sigmoid_gate` (the gated attention's output gate before o_proj) and :func:`gemv_gated_rms_norm` (the
Gated DeltaNet's per-head gated norm before out_proj). Their torch references are in ``gemv_ref.py``.
"""
from __future__ import annotations

import torch

from .._utils import check_dtype
from .gemv import _check_weight, _launch
from .gemv_config import GATED_RMS_NORM, NO_SCALE, SIGMOID_GATE, GemvConfig, default_config, default_fp8_config


def _check_head_gate(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> None:
    """x [1, H*D] contiguous, gate [1, H, D] (heads at any stride, each head's D contiguous), weight [N, H*D]."""
    check_dtype("x", x)
    check_dtype("gate", gate)
    if (x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or gate.dim() != 3
            or gate.shape[0] != 1 or gate.shape[1] * gate.shape[2] != x.shape[1] or gate.stride(2) != 1):
        raise ValueError(f"expected x [1, H*D], gate [1, H, D] (contiguous heads) and weight [N, H*D], got "
                         f"{tuple(x.shape)}, {tuple(gate.shape)} (strides {gate.stride()}) and {tuple(weight.shape)}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")


def gemv_sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      config: GemvConfig | None = None, *, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``gemv(x * sigmoid(gate), weight, bias)`` in one launch: ``x`` [1, H*D] (the attention output), ``gate``
    [1, H, D] -> [1, N].

    Why: Qwen3.5's gated attention multiplies its output by a sigmoid gate that its q projection computed beside
    each query head (``gate`` is a strided view of the fused qkv output); unfused that is two launches before
    ``o_proj``. The roundings are HF's (``attn_output * torch.sigmoid(gate)`` in the model dtype): the sigmoid
    rounded, then the product.
    """
    _check_head_gate(x, gate, weight)
    scale = _check_weight(weight, bias, weight_scale)
    return _launch(x, weight, bias, config, prologue=SIGMOID_GATE, weight_scale=weight_scale, scale=scale, gate=gate)


def gemv_gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, config: GemvConfig | None = None, *,
                        weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``gemv(gated_rms_norm(x, gate, norm_weight, eps), weight)`` in one launch: ``x`` [1, H*D] (the delta
    rule's output, H value heads of D), ``gate`` [1, H, D] (the z projection), ``norm_weight`` [D] -> [1, N].

    Why: the Gated DeltaNet normalises each value head's output and multiplies it by ``silu(z)`` before
    ``out_proj``; in torch that is a dozen launches over a few KB. The norm is per head, so a column chunk (a
    multiple of D, which must be a power of two) normalises its own heads: no pass over the row first, unlike
    :func:`gemv_rms_norm`. HF's roundings (``Qwen3_5RMSNormGated``): the normed head rounded to x's dtype, times
    the weight rounded, times ``silu(gate)`` in float32, rounded once more.
    """
    _check_head_gate(x, gate, weight)
    check_dtype("norm_weight", norm_weight)
    d = gate.shape[2]
    if d & (d - 1) or norm_weight.shape != (d,) or not norm_weight.is_contiguous():
        raise ValueError(f"the head size must be a power of two and norm_weight a contiguous [{d}], got "
                         f"{tuple(norm_weight.shape)}")
    scale = _check_weight(weight, None, weight_scale)
    n, k = weight.shape
    cfg = config or (default_config(n, k, GATED_RMS_NORM) if scale == NO_SCALE
                     else default_fp8_config(n, k, GATED_RMS_NORM, scale))
    if cfg.block_k % d:
        raise ValueError(f"block_k {cfg.block_k} must hold whole heads of {d}")
    return _launch(x, weight, None, cfg, prologue=GATED_RMS_NORM, norm_weight=norm_weight, eps=eps,
                   weight_scale=weight_scale, scale=scale, gate=gate)
