"""``RMSNorm``, with the residual add fused in front of it (the Triton ops fuse the two).

Gemma's norms scale by ``1 + w``: with ``offset=True`` the layer adds the one when its weight loads and keeps
the sum in float32, which the ops read as Gemma's rounding (the weight multiplies in float32). gpt-oss keeps
its plain ``w`` in float32 (``weight_dtype``), rounded the same way.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minfer.model.quantization.base import ActivationQuant
from minfer.ops import Ops


class RMSNorm(nn.Module):
    """``forward(x, residual)`` first adds the residual and returns the normed output together with the
    new residual stream."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, ops: Ops, offset: bool = False,
                 weight_dtype: torch.dtype | None = None) -> None:
        """``weight_dtype``: the weight's own dtype (default the model dtype; float32 with ``offset``)."""
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.offset = offset
        self.dtype = dtype
        kind = torch.float32 if offset else (weight_dtype or dtype)
        self.weight = nn.Parameter(torch.empty(size, dtype=kind), requires_grad=False)

    def load_shard(self, name: str, source: Any, shard: Any) -> None:
        """The checkpoint's weight (whole on every rank); Gemma's ``w`` becomes ``1 + w`` in float32."""
        w = source[:]
        if w.shape != self.weight.shape:
            raise ValueError(f"checkpoint shape {tuple(w.shape)} != model {tuple(self.weight.shape)}")
        # HF loads w into the model dtype before it adds the one: a float32 checkpoint run in bfloat16 rounds w first
        self.weight.data.copy_(w.to(self.dtype).float() + 1.0 if self.offset else w)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out: ActivationQuant | None = None) -> Any:
        """``out``: the next layer's input format (``FusedLinear.input_quant``), emitted by the norm's own
        kernel; None for the model dtype."""
        if out is not None:
            if residual is None:
                return out.rms_norm(self.ops, x, self.weight, self.eps)
            return out.add_rms_norm(self.ops, x, residual, self.weight, self.eps)
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
