"""Triton kernels of the engine, each with a plain torch reference (``*_ref``) beside it, grouped by concern.

The ground floor: nothing here imports the model, the ops or the engine. The references are the
yardstick the tests hold the kernels to (the attention ones compute in float32, or float64 for
float64 inputs); the engine's own torch path is ``minfer/ops/torch_ops.py``, which rounds as HF's
eager attention does (matmuls in the model dtype).

``attention/`` (paged prefill and decode, Triton and Hopper Gluon), ``quant/`` (the FP8 activation format and
the 8-bit KV cache formats), ``gemm/`` (batch-1 matrix-vector products, the FP8 GEMMs), ``moe/`` (the fused
mixture-of-experts block), ``linear_attention/`` (Gated DeltaNet's conv and delta rule), ``lora/`` (batched
multi-LoRA shrink and expand); the small kernels the others share or the engine calls alone (norms, activation,
rotary + KV store, sampling, a decode graph's input staging, PDL) sit at this level. Callers import the
module they use (``from minfer.kernels.attention.decode_attention import paged_decode_attention``); no package
here imports its modules, so a torch-only caller (``quant/kv_quant.py``, ``quant/fp8_ref.py``,
``moe/moe_ref.py``) never loads Triton.

On a machine without a CUDA GPU we switch Triton to its interpreter before any kernel is
decorated (Triton reads TRITON_INTERPRET when ``@triton.jit`` runs), so the kernels stay callable
on CPU tensors, slowly, for tests. An explicit TRITON_INTERPRET in the environment always wins.
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
