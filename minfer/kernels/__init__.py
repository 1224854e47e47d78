"""Triton kernels of the engine, each with a plain torch reference (``*_ref``) beside it.

The references are the yardstick the tests hold the kernels to (the attention ones compute in
float32, or float64 for float64 inputs). The engine's own torch attention path is
minfer/model/attention.py, which rounds as HF's eager attention does (matmuls in the model dtype).
On a machine without a CUDA GPU we switch Triton to its interpreter before any kernel is
decorated (Triton reads TRITON_INTERPRET when ``@triton.jit`` runs), so the kernels stay callable
on CPU tensors, slowly, for tests. An explicit TRITON_INTERPRET in the environment always wins.
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from .activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from .decode_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from .kv_store import store_kv, store_kv_ref  # noqa: E402
from .prefill_attention import paged_prefill_attention, paged_prefill_attention_ref  # noqa: E402
from .rmsnorm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref  # noqa: E402
from .rotary import apply_rotary, apply_rotary_ref  # noqa: E402

__all__ = [
    "apply_rotary", "apply_rotary_ref",
    "fused_add_rms_norm", "fused_add_rms_norm_ref",
    "paged_decode_attention", "paged_decode_attention_ref",
    "paged_prefill_attention", "paged_prefill_attention_ref",
    "rms_norm", "rms_norm_ref",
    "silu_and_mul", "silu_and_mul_ref",
    "store_kv", "store_kv_ref",
]
