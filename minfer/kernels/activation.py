"""Gated activations over the fused gate_up projection output: SwiGLU ``silu(gate) * up`` and
GeGLU ``gelu_tanh(gate) * up`` (Gemma).

Rounded as HF rounds ``act_fn(gate_proj(x)) * up_proj(x)``: silu is evaluated in float32 and
rounded to the model dtype, then the product is taken and rounded again. The extra rounding costs
nothing in a memory-bound kernel and keeps the MLP bit-compatible with the HF reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_dtype, check_last_dim_contiguous
from .pdl import launch_options, use_pdl, wait_for_previous


SILU, GELU_TANH = 0, 1  # the ACT codes of the kernel (literals inside it: Triton reads no plain globals)


@triton.jit
def _act_and_mul_kernel(X, OUT, stride_x, stride_o, inter, ACT: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    if ACT == 0:  # SILU
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    else:  # tanh-approximated GELU; tanh(u) = 1 - 2 / (exp(2u) + 1) saturates cleanly at both ends
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi)
        act = (0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))).to(gate.dtype)
    out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(OUT + row * stride_o + cols, out, mask=mask)


def silu_and_mul(x: torch.Tensor, *, block: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """``x`` ``[T, 2*I]`` = [gate | up] -> ``silu(gate) * up`` ``[T, I]`` in x's dtype.

    ``block``/``num_warps`` exist for the tuning sweep in benchmarks/bench_kernels.py.
    """
    return _act_and_mul(x, SILU, block, num_warps)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, 2*I]`` = [gate | up] -> ``gelu_tanh(gate) * up`` ``[T, I]`` in x's dtype (GeGLU)."""
    return _act_and_mul(x, GELU_TANH, 1024, 4)


def _act_and_mul(x: torch.Tensor, act: int, block: int, num_warps: int) -> torch.Tensor:
    check_dtype("x", x)
    check_last_dim_contiguous("x", x)
    num_rows, width = x.shape
    if width % 2:
        raise ValueError(f"last dim of x must be even (gate | up), got {width}")
    inter = width // 2
    out = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    grid = (num_rows, triton.cdiv(inter, block))
    pdl = use_pdl(x.device)
    _act_and_mul_kernel[grid](x, out, x.stride(0), out.stride(0), inter, ACT=act, BLOCK=block, PDL=pdl,
                              num_warps=num_warps, **launch_options(pdl))
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`silu_and_mul`, the HF arithmetic."""
    inter = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :inter]) * x[..., inter:]


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`gelu_tanh_and_mul`, the HF arithmetic (``gelu_pytorch_tanh``)."""
    inter = x.shape[-1] // 2
    return torch.nn.functional.gelu(x[..., :inter], approximate="tanh") * x[..., inter:]
