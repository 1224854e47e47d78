"""The ops the model computes with, and the one place their backend is chosen.

``select_ops`` picks the torch ops (HF's rounding; the CPU path and the reference) or the Triton
ops (``minfer/kernels``) once, from the engine's ``attention_backend``; the model gets the object at
construction and calls its named ops (``base.Ops``) without knowing which backend runs them.
"""
from __future__ import annotations

import logging

import torch

from minfer.ops.base import ModelForward, Ops
from minfer.ops.metadata import AttentionMetadata, Fp8Activation, MoeExperts, PagedKVCache, RopeInputs
from minfer.ops.torch_ops import TorchOps

logger = logging.getLogger("minfer")

__all__ = ["AttentionMetadata", "Fp8Activation", "ModelForward", "MoeExperts", "Ops", "PagedKVCache", "RopeInputs",
           "TorchOps", "select_ops"]


def select_ops(attention_backend: str, device: torch.device, block_size: int, head_dim: int,
               stage_tokens: int = 0) -> Ops:
    """'auto' takes the Triton kernels on CUDA where they apply, the torch ops otherwise; 'triton'
    on the CPU runs the kernels in Triton's interpreter (tests). ``stage_tokens``: the most tokens whose pages
    the Triton ops stage for a prompt step's 8-bit prefill (``TritonOps``)."""
    fits = block_size >= 16 and head_dim & (head_dim - 1) == 0 and 16 <= head_dim <= 256
    if attention_backend == "triton" and not fits:
        raise ValueError(f"attention_backend='triton' needs block_size >= 16 (got {block_size}) and a "
                         f"power-of-two head_dim in [16, 256] (got {head_dim})")
    if attention_backend == "auto":
        attention_backend = "triton" if device.type == "cuda" and fits else "torch"
    elif attention_backend == "triton" and device.type == "cpu":
        _check_triton_interpreter()
        logger.warning("attention_backend='triton' on the CPU runs every kernel in Triton's interpreter, which is "
                       "meant for tests at tiny shapes: a short prompt on a small model takes minutes. Use "
                       "attention_backend='auto' (the torch ops) to generate on the CPU.")
    if attention_backend == "triton":
        from minfer.ops.triton_ops import TritonOps

        return TritonOps(device, block_size, head_dim, stage_tokens)
    return TorchOps()


def _check_triton_interpreter() -> None:
    """On the CPU, Triton kernels only run in its interpreter, which must be on before Triton loads."""
    from minfer.kernels.rmsnorm import rms_norm

    try:
        rms_norm(torch.ones(1, 16), torch.ones(16), 1e-6)
    except Exception as exc:
        raise ValueError("attention_backend='triton' on the CPU needs Triton's interpreter: start Python with "
                         f"TRITON_INTERPRET=1 (Triton was loaded before minfer could set it): {exc}") from exc
