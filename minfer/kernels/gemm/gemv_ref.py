"""Torch references of the batch-1 matrix-vector kernels (``gemv.py``): float32 products and sums rounded once,
after the prologue's op computed as the unfused kernels compute it (the tests' oracles)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..activation import gelu_tanh_and_mul_ref, silu_and_mul_ref
from ..linear_attention.gated_delta_ref import gated_rms_norm_ref
from ..quant.fp8_ref import dequantize_fp8
from ..rmsnorm import fused_add_rms_norm_ref, rms_norm_ref

if TYPE_CHECKING:  # torch-only callers never load Triton through it
    from .gemv_lora import GemvLora


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
             weight_scale: torch.Tensor | None = None, lora: GemvLora | None = None) -> torch.Tensor:
    """float32 products and sums, rounded once to x's dtype (the tests' oracle); an e4m3 weight is dequantized
    with its ``weight_scale`` first; ``lora``'s product joins the sums before the rounding."""
    w = weight.float() if weight_scale is None else dequantize_fp8(weight, weight_scale)
    y = x.float() @ w.T
    if bias is not None:
        y += bias.float()
    if lora is not None:
        y += lora_delta_ref(x, lora)
    return y.to(x.dtype)


def lora_delta_ref(x: torch.Tensor, lora: GemvLora) -> torch.Tensor:
    """``[1, N]`` float32: shard s's rows get ``(x · A[slot, s]ᵀ) · B[slot, shard s rows]ᵀ``; zero for a slot outside
    the stack (the base model alone)."""
    slot = int(lora.slot[0])
    n = sum(lora.shard_sizes)
    if not 0 <= slot < lora.a_stack.shape[0]:
        return torch.zeros(1, n, device=x.device)
    xa = torch.einsum("k,srk->sr", x[0].float(), lora.a_stack[slot].float())
    shards = lora.b_stack[slot].float().split(list(lora.shard_sizes))
    return torch.cat([b @ xa[s] for s, b in enumerate(shards)])[None]


def gemv_silu_mul_ref(x_gate_up: torch.Tensor, weight: torch.Tensor, *,
                      weight_scale: torch.Tensor | None = None, lora: GemvLora | None = None) -> torch.Tensor:
    """Torch reference of :func:`gemv_silu_mul`. For bfloat16/float16, torch's silu and product each compute in
    float32 and round, which is exactly the kernel's rounding (silu rounded, then the product rounded)."""
    return gemv_ref(silu_and_mul_ref(x_gate_up), weight, weight_scale=weight_scale, lora=lora)


def gemv_gelu_tanh_mul_ref(x_gate_up: torch.Tensor, weight: torch.Tensor, *,
                           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`gemv_gelu_tanh_mul` (torch's tanh GELU rounds once in the dtype, as the kernel)."""
    return gemv_ref(gelu_tanh_and_mul_ref(x_gate_up), weight, weight_scale=weight_scale)


def gemv_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                      weight_scale: torch.Tensor | None = None, lora: GemvLora | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`gemv_rms_norm`: ``(y, new_residual)``; ``residual`` is left unmodified."""
    if residual is None:
        new_residual, xn = x, rms_norm_ref(x, norm_weight, eps)
    else:
        new_residual = residual.clone()
        xn = fused_add_rms_norm_ref(x, new_residual, norm_weight, eps)
    return gemv_ref(xn.to(x.dtype), weight, bias, weight_scale=weight_scale, lora=lora), new_residual


def gemv_sigmoid_gate_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                          *, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`gemv_sigmoid_gate`: HF's ``x * torch.sigmoid(gate)`` in x's dtype, then the product."""
    return gemv_ref((x.view(gate.shape) * torch.sigmoid(gate)).reshape(x.shape), weight, bias,
                    weight_scale=weight_scale)


def gemv_gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor, *, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`gemv_gated_rms_norm`: HF's gated RMSNorm per head, then the product."""
    normed = gated_rms_norm_ref(x.view(gate.shape), gate, norm_weight, eps)
    return gemv_ref(normed.reshape(x.shape), weight, weight_scale=weight_scale)
