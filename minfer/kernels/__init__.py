"""Triton kernels of the engine, each with a plain torch reference (``*_ref``) beside it.

The ground floor: nothing here imports the model, the ops or the engine. The references are the
yardstick the tests hold the kernels to (the attention ones compute in float32, or float64 for
float64 inputs); the engine's own torch path is ``minfer/ops/torch_ops.py``, which rounds as HF's
eager attention does (matmuls in the model dtype).

On a machine without a CUDA GPU we switch Triton to its interpreter before any kernel is
decorated (Triton reads TRITON_INTERPRET when ``@triton.jit`` runs), so the kernels stay callable
on CPU tensors, slowly, for tests. An explicit TRITON_INTERPRET in the environment always wins.
The names below load their module on first use, so a torch-only caller (``kv_quant``, ``fp8_ref``,
``moe_ref``) never loads Triton.
"""

import importlib
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

_EXPORTS = {
    "silu_and_mul": "activation", "silu_and_mul_ref": "activation",
    "paged_decode_attention": "decode_attention", "paged_decode_attention_ref": "decode_attention",
    "store_kv": "kv_store", "store_kv_ref": "kv_store",
    "paged_prefill_attention": "prefill_attention", "paged_prefill_attention_ref": "prefill_attention",
    "fused_add_rms_norm": "rmsnorm", "fused_add_rms_norm_ref": "rmsnorm", "rms_norm": "rmsnorm",
    "rms_norm_ref": "rmsnorm",
    "quantize_fp8": "fp8_quant", "quantize_fp8_ref": "fp8_ref", "dequantize_fp8": "fp8_ref",
    "add_rms_norm_fp8": "fp8_quant", "add_rms_norm_fp8_ref": "fp8_quant", "rms_norm_fp8": "fp8_quant",
    "rms_norm_fp8_ref": "fp8_quant", "silu_and_mul_fp8": "fp8_quant", "silu_and_mul_fp8_ref": "fp8_quant",
    "fp8_gemm_block": "fp8_gemm", "fp8_gemm_block_ref": "fp8_gemm", "fp8_gemm_channel": "fp8_gemm",
    "fp8_gemm_channel_ref": "fp8_gemm",
    "fused_moe": "moe", "fused_moe_ref": "moe_ref", "moe_route": "moe", "moe_route_ref": "moe_ref",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """``from minfer.kernels import rms_norm``: import the kernel's module now (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
