"""Small helpers shared by the kernel launchers (device queries, dtype checks)."""

from __future__ import annotations

import functools
import os

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1; read once, since
    Triton itself reads it when the kernels are decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of `device`; a small stand-in on the CPU so split heuristics stay cheap there."""
    if device.type == "cuda":
        return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


def check_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dot_mode(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast operands to fp32?, tl.dot input_precision) for attention products in `dtype`.

    float32 on the GPU uses "tf32x3" (three tensor-core passes, float32-level error; plain tf32
    costs ~3e-4 relative error, and "ieee" FMA products spill registers heavily at our tile
    sizes). Triton's CPU interpreter multiplies bfloat16 dot operands wrongly (seen with
    triton 3.9), so there the operands are upcast to float32 and multiplied exactly; GPUs take
    bf16/fp16 straight to the tensor cores.
    """
    interp = interpreting()
    upcast = dtype == torch.bfloat16 and interp
    if dtype == torch.float32 or upcast:
        return upcast, "ieee" if interp else "tf32x3"
    return False, "tf32"
