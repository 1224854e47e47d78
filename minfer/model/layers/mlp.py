"""``GatedMLP``: SwiGLU, down(silu(gate(x)) * up(x)), gate and up fused into one matmul; GeGLU (Gemma's
tanh-approximated GELU in place of silu) with ``activation="gelu_tanh"``.

Under tensor parallelism each rank holds a share of the intermediate features (gate/up by rows, down by
columns), and only down's output is summed across ranks.
"""
from __future__ import annotations

import torch
from torch import nn

from minfer.distributed import SINGLE, TensorParallel
from minfer.model.layers.linear import FusedLinear
from minfer.model.quantization.base import UNQUANTIZED, Activation, QuantConfig
from minfer.ops import Ops


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, ops: Ops,
                 tp: TensorParallel = SINGLE, quant: QuantConfig | None = None, prefix: str = "mlp",
                 activation: str = "silu") -> None:
        super().__init__()
        if activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"activation must be 'silu' or 'gelu_tanh', got {activation!r}")
        self.ops = ops
        self.activation = activation
        start, inter = tp.split(intermediate)
        gate_up = quant.linear_method([f"{prefix}.gate_proj", f"{prefix}.up_proj"]) if quant else UNQUANTIZED
        down = quant.linear_method([f"{prefix}.down_proj"]) if quant else UNQUANTIZED
        self.gate_up_proj = FusedLinear(hidden, [inter, inter], False, dtype, rows_from=[start, start],
                                        method=gate_up, ops=ops)
        self.down_proj = FusedLinear(inter, [hidden], False, dtype, cols_from=start, tp=tp, method=down, ops=ops)

    def forward(self, x: Activation) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.activation == "gelu_tanh":  # (a down projection that wants another input format converts it itself)
            return self.down_proj(self.ops.gelu_tanh_and_mul(gate_up))
        out = self.down_proj.input_quant
        act = self.ops.silu_and_mul(gate_up) if out is None else out.silu_and_mul(self.ops, gate_up)
        return self.down_proj(act)
