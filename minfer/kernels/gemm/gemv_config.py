"""Launch configs of the batch-1 matrix-vector kernel (``gemv.py``): the config type, the codes of the
kernel's prologues and weight scalings, and the rules that pick a config from a product's shape.

Kept apart from the kernel because they change for different reasons: the rules are measured on a GPU
(``benchmarks/gemv_chain.py`` for bf16 weights, ``benchmarks/bench_fp8.py --sweep`` for e4m3 ones) and retuned
when the hardware or Triton changes, while the kernel is held to its reference by the tests.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .._utils import next_pow2
from ..quant.fp8_ref import FP8_GROUP


@dataclass(frozen=True)
class GemvConfig:
    """Rows per program, columns per step, warps, the K loop's pipelining depth. Four rows won on every layer
    shape of the 0.6B and 1B models on an H200 (sweep of 4/8/16 rows x 512/1024/2048 columns x 4/8 warps; the
    column width moved results by under 5%)."""

    block_n: int = 4
    block_k: int = 1024
    num_warps: int = 4
    num_stages: int = 1  # the K loop's software pipelining: see STREAM_STAGES


# The K loop's pipelining depth in the projections' default configs (this kernel's and the MoE decode kernels'; a
# LoRA shrink, a few rows over a split K, keeps 1). Triton pipelines a loop without a dot product only when the
# loop asks for it (``tl.range(num_stages=)``): at 1 each step loads its chunk when it needs it; at N > 1 Triton
# copies the chunks N - 1 steps ahead into shared memory (cp.async) while the warps convert and multiply the
# current one.
# The default stays 1: a warp's own 16-byte loads already keep enough bytes in flight, and the copies through shared
# memory made batch 1 slower on an H100 (benchmarks/RESULTS.md). ``MINFER_STREAM_STAGES`` sets it for the sweeps.
MAX_STREAM_STAGES = 8


def stream_stages(value: str) -> int:
    """``MINFER_STREAM_STAGES``'s depth, or a clear error naming it and the allowed range."""
    if not value.strip().isdigit() or not 1 <= int(value) <= MAX_STREAM_STAGES:
        raise ValueError(f"MINFER_STREAM_STAGES must be an integer in [1, {MAX_STREAM_STAGES}], got {value!r}")
    return int(value)


STREAM_STAGES = stream_stages(os.environ.get("MINFER_STREAM_STAGES", "1"))


# What feeds the dot product (the kernel's PROLOGUE, gemv_prologue.py): x itself, silu(gate) * up,
# rms_norm(x + residual), gelu_tanh(gate) * up (Gemma's GeGLU), x * sigmoid(gate) (Qwen3.5's gated attention), or a
# per-head rms_norm(x) * silu(gate) (Qwen3.5's Gated DeltaNet).
PLAIN, SILU_MUL, RMS_NORM, GELU_MUL, SIGMOID_GATE, GATED_RMS_NORM = 0, 1, 2, 3, 4, 5
# How the weight is scaled (the kernel's SCALE): not at all (a float weight), per row, per row and 128 columns.
NO_SCALE, CHANNEL, BLOCK = 0, 1, 2


def default_config(n: int, k: int, prologue: int = PLAIN) -> GemvConfig:
    """Four rows per program on four warps, with the widest column chunk each prologue affords: 2048 columns for
    the plain product; 1024 under the RMS prologue (its chunk also loads x, residual and norm weight); eight rows
    by 2048 columns on eight warps under the SwiGLU prologue, whose exp and division per element want more warps
    in flight. Chosen in the decode chain, not per kernel (``benchmarks/gemv_chain.py``: 16 layers of llama-3.2-1b
    projections in one CUDA graph under PDL, H200: 552 us). ``n`` is unused by this rule; a per-shape rule
    would take it. Qwen3.5's two gated prologues (an exp and a division per element, like SwiGLU's) take SwiGLU's
    config, not tuned apart."""
    if prologue in (SILU_MUL, GELU_MUL, SIGMOID_GATE, GATED_RMS_NORM):  # (GeGLU: SwiGLU's config, not tuned apart)
        return GemvConfig(block_n=8, block_k=min(2048, next_pow2(k)), num_warps=8, num_stages=STREAM_STAGES)
    return GemvConfig(block_k=min(1024 if prologue == RMS_NORM else 2048, next_pow2(k)), num_stages=STREAM_STAGES)


def default_fp8_config(n: int, k: int, prologue: int = PLAIN, scale: int = CHANNEL) -> GemvConfig:
    """The config for an e4m3 weight (``scale``: ``CHANNEL`` or ``BLOCK``, which share it): eight rows by 1024
    columns on four warps, 512 columns under the RMS prologue. The fastest of 7 candidates on llama-3.1-8b's
    projections on an H200 (``bench_fp8.py --sweep``; within 5% of each shape's best). It reaches ~75% of DRAM
    bandwidth on gate_up against ~89% for bf16 weights (H100, ``dev/ncu_gemv.py``; what was ruled out:
    benchmarks/RESULTS.md). A block-scaled K chunk covers whole 128-column groups or lies inside one (any power of
    two does)."""
    block_k = 512 if prologue == RMS_NORM else 1024
    return GemvConfig(block_n=8, block_k=min(block_k, max(next_pow2(k), FP8_GROUP)), num_warps=4,
                      num_stages=STREAM_STAGES)


def lora_shrink_config(rows: int, k: int, prologue: int = PLAIN) -> GemvConfig:
    """A LoRA shrink over one slot's ``shards × max_rank`` rows (``gemv_lora.py``): four rows by 2048 columns on
    eight warps, K split in up to ``gemv.LORA_MAX_SPLIT`` (4) parts of whole chunks. The best of the configs
    ``dev/gemv_lora_chain.py`` times (four llama-3.1-8b layers in one graph, H200; the figures: RESULTS.md)."""
    return GemvConfig(block_n=4, block_k=min(2048, next_pow2(k)), num_warps=8)
