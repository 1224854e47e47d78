"""Float projections that compute their own input: the norm before qkv and gate_up, and SwiGLU before down, run in
the projection's launch (``kernels/gemm/gemm_prologue.py``) when a step has few rows.

It rides on the ``ActivationQuant`` seam the 8-bit formats use: the norm (or the activation) before a float
projection hands over a deferred input, which the projection's ``UnquantizedLinear.apply`` computes in its GEMM's
prologue. The ops decide per call: past ``ops.prologue_rows`` rows (a prompt step), or on ops without the fused
kernels (torch), the norm runs as it always did and hands over a tensor.

The add of the residual moves with the norm: the new residual stream is a new tensor, written by the projection's
launch, so nothing may read it between the norm's call and the projection's (a layer's capture of its residual for
EAGLE-3 happens after attention). ``MINFER_GEMM_PROLOGUE=1`` turns the layout on.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from minfer.model.quantization.base import Activation, ActivationQuant
from minfer.ops import Ops


def gemm_prologue_enabled() -> bool:
    """Read once per projection, when the model is built. Off unless ``MINFER_GEMM_PROLOGUE=1``."""
    return os.environ.get("MINFER_GEMM_PROLOGUE", "0") == "1"


@dataclass
class NormedInput:
    """``rms_norm(x (+ residual))``, not yet computed; ``residual_out`` receives ``x + residual``."""

    ops: Ops
    x: torch.Tensor
    residual: torch.Tensor | None
    residual_out: torch.Tensor | None
    weight: torch.Tensor
    eps: float

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.ops.rms_norm_linear(self.x, self.residual, self.residual_out, self.weight, self.eps, weight, bias)


@dataclass
class SwigluInput:
    """``silu(gate) * up`` of ``gate_up`` = [gate | up], not yet computed."""

    ops: Ops
    gate_up: torch.Tensor

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = self.ops.silu_mul_linear(self.gate_up, weight)
        return y if bias is None else y + bias


def _fits(ops: Ops, x: torch.Tensor) -> bool:
    return x.dim() == 2 and 0 < x.shape[0] <= ops.prologue_rows


class GemmPrologueInputs(ActivationQuant):
    """The deferred inputs when the step is small enough, the plain ops' outputs otherwise."""

    def rms_norm(self, ops: Ops, x: torch.Tensor, weight: torch.Tensor, eps: float) -> Activation:
        if not _fits(ops, x):
            return ops.rms_norm(x, weight, eps)
        return NormedInput(ops, x, None, None, weight, eps)

    def add_rms_norm(self, ops: Ops, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[Activation, torch.Tensor]:
        if not _fits(ops, x):
            return ops.add_rms_norm(x, residual, weight, eps)
        out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
        return NormedInput(ops, x, residual, out, weight, eps), out

    def silu_and_mul(self, ops: Ops, x: torch.Tensor) -> Activation:
        if not _fits(ops, x):
            return ops.silu_and_mul(x)
        return SwigluInput(ops, x)


GEMM_PROLOGUE = GemmPrologueInputs()
