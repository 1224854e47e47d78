"""The seam between the layers and weight formats.

A ``QuantConfig`` is read once from the checkpoint (or the engine's ``quantization`` argument) and hands
each layer the method that owns its weights: a ``LinearMethod`` for a linear layer (which tensors it
creates, how a checkpoint slice loads into them, how the product is computed) and an ``ExpertMethod`` for
a MoE block's stacked experts. A method may also want its input in a format of its own (an 8-bit code
and its scales, say): it says so with an ``ActivationQuant``, which the layer before calls to emit that
format from its norm or activation (a fused kernel), so no layer names a format.

``UNQUANTIZED`` is the method of plain float weights, and the default everywhere.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minfer.ops import Ops

Activation = Any  # a [tokens, features] tensor, or what an ActivationQuant emits for the next layer


class ActivationQuant(ABC):
    """How a layer's producer hands over its output: the norm before a projection and the activation
    before a down projection call these instead of their plain ops."""

    @abstractmethod
    def rms_norm(self, ops: Ops, x: torch.Tensor, weight: torch.Tensor, eps: float) -> Activation: ...

    @abstractmethod
    def add_rms_norm(self, ops: Ops, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[Activation, torch.Tensor]: ...

    @abstractmethod
    def silu_and_mul(self, ops: Ops, x: torch.Tensor) -> Activation: ...


class LinearMethod(ABC):
    """One linear layer's weights: created on the layer, loaded slice by slice, multiplied.

    The layer (``layers.linear.FusedLinear``) keeps the sharding: which rows and columns of each checkpoint
    matrix this rank holds; the method decides what a row is made of."""

    input_quant: ActivationQuant | None = None  # the input format the layer before should emit (None: as is)

    @abstractmethod
    def create_weights(self, layer: nn.Module, rows: int, in_features: int, dtype: torch.dtype) -> None:
        """Register ``layer.weight`` ([rows, in_features]) and whatever else the format keeps."""

    def checkpoint_tensors(self) -> list[str]:
        """Tensors besides ``weight`` and ``bias`` the checkpoint supplies for each stacked matrix."""
        return []

    def convert_weight(self, layer: nn.Module, tensor: torch.Tensor, row_start: int) -> torch.Tensor:
        """A checkpoint weight slice as the layer stores it, rows ``row_start...`` of ``layer.weight``."""
        return tensor

    def load_tensor(self, layer: nn.Module, name: str, source: Any, shard: int) -> str | None:
        """A checkpoint tensor other than the weight and bias (scales): loaded, and the attribute it filled
        returned, or None when the format stores nothing for it."""
        raise ValueError(f"unexpected tensor {name!r} for a {type(self).__name__} layer")

    @abstractmethod
    def apply(self, layer: nn.Module, x: Activation, bias: torch.Tensor | None) -> torch.Tensor:
        """x Wᵀ (+ b) for this rank's share."""


class UnquantizedLinear(LinearMethod):
    """Float weights in the model dtype."""

    def create_weights(self, layer: nn.Module, rows: int, in_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(rows, in_features, dtype=dtype), requires_grad=False)

    def apply(self, layer: nn.Module, x: Activation, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinear()


class ExpertMethod(ABC):
    """A MoE block's expert matrices in a checkpoint format: the extra tensors each one comes with, and
    the float matrix they make (the fused MoE kernels multiply in the model dtype). A format the MoE op
    multiplies as stored (MXFP4) sets ``keeps_format``: its family's experts module keeps the codes."""

    keeps_format = False
    bytes_per_weight: float | None = None  # what one kept weight costs in memory (None: the model dtype's)

    @abstractmethod
    def checkpoint_tensors(self) -> list[str]:
        """Suffixes (``'weight_scale'``) of the tensors besides each expert matrix's weight."""

    @abstractmethod
    def load(self, key: tuple[str, int], part: str, source: Any) -> torch.Tensor | None:
        """One tensor of expert matrix ``key`` ((matrix, expert)); the matrix in float once all its
        tensors have come, else None. ``part`` is 'weight' or a suffix of ``checkpoint_tensors``."""


class QuantConfig(ABC):
    """A checkpoint's weight format, and the method of each layer."""

    name: str  # what get_stats() reports as the weight dtype
    random_weights = False  # whether random_weights draws a checkpoint's tensors in this format (dummy loads)

    @abstractmethod
    def linear_method(self, checkpoint_modules: list[str]) -> LinearMethod:
        """The method of a layer fused from these checkpoint modules (``layers.0.self_attn.q_proj`` ...);
        ``UNQUANTIZED`` for modules the checkpoint leaves in float."""

    def expert_method(self) -> ExpertMethod | None:
        """The method of MoE experts stored in this format; None when they load as float."""
        return None
