"""``RMSNorm``, with the residual add fused in front of it (the Triton ops fuse the two)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minfer.model.quantization.base import ActivationQuant
from minfer.ops import Ops


class RMSNorm(nn.Module):
    """``forward(x, residual)`` first adds the residual and returns the normed output together with the
    new residual stream."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, ops: Ops) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)

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
