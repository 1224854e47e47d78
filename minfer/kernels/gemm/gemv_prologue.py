"""The input-vector prologues of the batch-1 matrix-vector kernel (``gemv.py``): what each program computes from
the layer before's outputs, chunk by chunk, before multiplying a chunk with its weight rows.

Every prologue rounds as the unfused kernel (or HF's torch op) it replaces, so the vector fed to the products is
the one the separate launch would have written. The codes are ``gemv_config``'s (``PROLOGUE``):

- ``SILU_MUL`` / ``GELU_MUL``: ``act(gate) * up`` over ``[gate | up]`` (``activation.py``'s roundings).
- ``RMS_NORM``: ``x (+ residual)`` RMS-normalised (``rmsnorm.py``'s; a float32 weight as Gemma's ``1 + w``), the
  row's mean square summed first by :func:`sum_squares`.
- ``SIGMOID_GATE``: ``x * sigmoid(gate)`` (Qwen3.5's gated attention before ``o_proj``), ``gate`` read per head
  at its own stride (it sits beside each query head in the fused qkv output).
- ``GATED_RMS_NORM``: per ``HEAD``-wide group, ``rms_norm(x) * silu(gate)`` (the Gated DeltaNet's norm before
  ``out_proj``, HF's ``Qwen3_5RMSNormGated``). A group is a value head, which a column chunk holds whole (the
  chunk is a multiple of the head size), so each program normalises its own chunks with no first pass.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sum_squares(X, R, K, HAS_RESIDUAL: tl.constexpr, RMS_BLOCK: tl.constexpr, EVEN_R: tl.constexpr,
                ONE_BLOCK: tl.constexpr):
    """float32 sum over the row of ``r * r``, ``r = x (+ residual)`` rounded to x's dtype as the norm rounds it."""
    cols = tl.arange(0, RMS_BLOCK)
    if ONE_BLOCK:  # the whole row in one block, one tl.sum: the shape of the rmsnorm kernel's reduction
        if EVEN_R:
            x = tl.load(X + cols)
        else:
            x = tl.load(X + cols, mask=cols < K, other=0.0)
        if HAS_RESIDUAL:
            if EVEN_R:
                res = tl.load(R + cols)
            else:
                res = tl.load(R + cols, mask=cols < K, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
        xf = x.to(tl.float32)
        ss = tl.sum(xf * xf, axis=0)
    else:
        ss = 0.0
        for r0 in range(0, K, RMS_BLOCK):
            if EVEN_R:
                x = tl.load(X + r0 + cols)
            else:
                x = tl.load(X + r0 + cols, mask=r0 + cols < K, other=0.0)
            if HAS_RESIDUAL:
                if EVEN_R:
                    res = tl.load(R + r0 + cols)
                else:
                    res = tl.load(R + r0 + cols, mask=r0 + cols < K, other=0.0)
                x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=0)
    return ss


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0.0)
    return tl.load(ptrs)


@triton.jit
def input_chunk(X, R, NW, R_OUT, N_OUT, offs, K, inv_rms, write_residual, eps, stride_r, PROLOGUE: tl.constexpr,
                HAS_RESIDUAL: tl.constexpr, MASKED: tl.constexpr, F32_NORM: tl.constexpr, HEAD: tl.constexpr,
                BLOCK_K: tl.constexpr, WRITE_NORMED: tl.constexpr = False):
    """The input vector's elements at ``offs`` (zero past K when MASKED), rounded to x's dtype as the unfused
    kernels round them; under the RMS prologue, ``write_residual`` also stores ``x + residual`` to R_OUT, and with
    WRITE_NORMED the normed elements to N_OUT (a router's launch keeps them for the experts after it). ``R`` is
    the prologue's second input: the residual (RMS), or the gate read at ``(c // HEAD) * stride_r + c % HEAD``
    (the two gated prologues)."""
    mask = offs < K
    if PROLOGUE == 1 or PROLOGUE == 3:  # silu/gelu_and_mul (activation.py): the activation in float32, rounded,
        gate = _load(X + offs, mask, MASKED)  # then the product, rounded
        up = _load(X + K + offs, mask, MASKED)
        g = gate.to(tl.float32)
        if PROLOGUE == 1:
            act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        else:  # tanh-approximated GELU, activation.py's arithmetic
            u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
            act = (0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))).to(gate.dtype)
        x = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    elif PROLOGUE == 2:  # fused_add_rms_norm / rms_norm (rmsnorm.py), same roundings
        x = _load(X + offs, mask, MASKED)
        w = _load(NW + offs, mask, MASKED)
        dtype = x.dtype
        if HAS_RESIDUAL:
            res = _load(R + offs, mask, MASKED)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
            if write_residual:
                if MASKED:
                    tl.store(R_OUT + offs, x, mask=mask)
                else:
                    tl.store(R_OUT + offs, x)
        if F32_NORM:  # a float32 weight (Gemma's 1 + w): one rounding, as rmsnorm.py's norm_row
            x = (w * (x.to(tl.float32) * inv_rms)).to(dtype)
        else:
            normed = (x.to(tl.float32) * inv_rms).to(dtype)
            x = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)
        if WRITE_NORMED:
            if write_residual:
                if MASKED:
                    tl.store(N_OUT + offs, x, mask=mask)
                else:
                    tl.store(N_OUT + offs, x)
    elif PROLOGUE == 4:  # x * sigmoid(gate), both in the model dtype as HF multiplies them: sigmoid rounded, product
        x = _load(X + offs, mask, MASKED)
        gate = _load(R + (offs // HEAD) * stride_r + offs % HEAD, mask, MASKED)
        sig = (1.0 / (1.0 + tl.exp(-gate.to(tl.float32)))).to(gate.dtype)
        x = (x.to(tl.float32) * sig.to(tl.float32)).to(x.dtype)
    elif PROLOGUE == 5:  # HF's gated RMSNorm per head: normed x rounded, times the weight rounded, times silu(gate)
        x = _load(X + offs, mask, MASKED)  # in float32, one last rounding
        gate = _load(R + (offs // HEAD) * stride_r + offs % HEAD, mask, MASKED)
        w = tl.load(NW + offs % HEAD)
        dtype = x.dtype
        xf = tl.reshape(x.to(tl.float32), (BLOCK_K // HEAD, HEAD))
        inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / HEAD + eps)
        h = tl.reshape(xf * inv[:, None], (BLOCK_K,)).to(dtype)
        h = (w.to(tl.float32) * h.to(tl.float32)).to(dtype)
        z = gate.to(tl.float32)
        x = (h.to(tl.float32) * (z / (1.0 + tl.exp(-z)))).to(dtype)
    else:
        x = _load(X + offs, mask, MASKED)
    return x
