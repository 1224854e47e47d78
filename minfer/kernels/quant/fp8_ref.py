"""The FP8 (e4m3) activation format's constants and torch references, torch only: the torch ops'
FP8 reference (``minfer/ops/base.py``) rounds with these without loading Triton, and the kernels of
``fp8_quant.py`` / ``fp8_gemm.py`` are held to them (see ``fp8_quant.py`` for the arithmetic)."""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
FP8_MIN_SCALE = 1e-12  # the scale of a row (group) whose amax is under 448e-12, zero rows included
FP8_GROUP = 128  # the "block" format's group: activation groups of 1x128, weight blocks of 128x128


def num_groups(k: int, group_size: int = FP8_GROUP) -> int:
    """Scale columns of a row of ``k`` values in groups of ``group_size``: ``ceil(k / group_size)``."""
    return -(-k // group_size)


def group_amax(x: torch.Tensor, group_size: int = FP8_GROUP) -> torch.Tensor:
    """``|x|``'s maximum per row and ``group_size``-column group of ``x [M, K]``: ``[M, ceil(K / group_size)]``
    (the last group may be partial)."""
    m, k = x.shape
    g = num_groups(k, group_size)
    return torch.nn.functional.pad(x, (0, g * group_size - k)).view(m, g, group_size).abs().amax(-1)


def _div(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """IEEE float32 division, elementwise. (On CUDA, torch divides a tensor by a Python scalar as a product with
    the scalar's reciprocal, which is off by an ulp at times; tensor by tensor divides.)"""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    shape = torch.broadcast_shapes(a.shape, b.shape)
    device = a.device if a.dim() else b.device
    return torch.div(a.to(device).expand(shape).contiguous(), b.to(device).expand(shape).contiguous())


def quantize_fp8_ref(x: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`quantize_fp8`: the same float32 steps (IEEE division, clamp, round to nearest
    even), so the codes and scales agree bit for bit with the kernel's on a GPU."""
    m, k = x.shape
    xf = x.float()
    if group_size is None:
        scale = _div(xf.abs().amax(-1), FP8_MAX).clamp_min(FP8_MIN_SCALE) if k else xf.new_full((m,), FP8_MIN_SCALE)
        inv = _div(1.0, scale)[:, None]
    else:
        scale = _div(group_amax(xf, group_size), FP8_MAX).clamp_min(FP8_MIN_SCALE)
        inv = _div(1.0, scale).repeat_interleave(group_size, dim=1)[:, :k]
    return (xf * inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, group_size: int = FP8_GROUP) -> torch.Tensor:
    """float32 values of e4m3 codes ``q [R, K]`` with per-row scales ``[R]`` or per-row-per-group scales
    ``[R, ceil(K / group_size)]``: activations (``x_scale``) and weights (``w_scale``, row-expanded) alike."""
    qf = q.float()
    if scale.dim() == 1:
        return qf * scale.float()[:, None]
    return qf * scale.float().repeat_interleave(group_size, dim=1)[:, :q.shape[1]]
