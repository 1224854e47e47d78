"""Gated DeltaNet's depthwise causal conv (SiLU) over a flat varlen step, one kernel for decodes and prompt chunks.

A program owns one sequence and a tile of channels: it walks the sequence's tokens in blocks, each output the K
taps over its window (inputs before the sequence's first token from the slot's buffer, or zeros without a state),
then writes the slot's new buffer, the sequence's last K - 1 inputs. One program reads and writes its own slot's
buffer and nobody else's, so the update is in place with no second launch; a barrier keeps the write behind every
thread's reads. Nothing is sized from the host but the grid (sequences from ``slots``' shape, channels from x's),
so a decode step is CUDA-graph capturable. Reference: ``gated_delta_ref.causal_conv1d_ref``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_dtype, next_pow2


@triton.jit
def _causal_conv_kernel(X, W, STATE, Y, QSL, SLOTS, HAS, stride_xt, stride_yt, stride_ss, C,
                        K: tl.constexpr, KP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = ch < C
    start = tl.load(QSL + b)
    end = tl.load(QSL + b + 1)
    slot = tl.load(SLOTS + b).to(tl.int64)
    # Positions before the first token come from the buffer only with a state: the lowest readable local position
    lowest = -(K - 1) * (tl.load(HAS + b) != 0).to(tl.int32)
    # The buffer [C, K - 1]: column K - 1 + p holds the input p (< 0) positions before the sequence's first token
    buf = STATE + slot * stride_ss + ch * (K - 1)
    out_ty = Y.dtype.element_ty

    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tmask = (t < end)[:, None] & cmask[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(K):
            p = t - (K - 1) + j  # flat position of tap j
            local = (p - start)[:, None]
            xv = tl.load(X + p.to(tl.int64)[:, None] * stride_xt + ch[None, :], mask=tmask & (local >= 0), other=0.0)
            sv = tl.load(buf[None, :] + (K - 1 + local), mask=tmask & (local < 0) & (local >= lowest), other=0.0)
            w = tl.load(W + ch * K + j, mask=cmask, other=0.0).to(tl.float32)
            acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
        y = acc.to(out_ty).to(tl.float32)  # HF's conv rounds to the model dtype before the SiLU
        y = y / (1.0 + tl.exp(-y))
        tl.store(Y + t.to(tl.int64)[:, None] * stride_yt + ch[None, :], y.to(out_ty), mask=tmask)

    # The new buffer: the last K - 1 inputs, from x, or from the old buffer when the sequence is shorter
    m = tl.arange(0, KP)
    local = (end - start - (K - 1) + m)[:, None]
    mmask = (m < K - 1)[:, None] & cmask[None, :]
    xv = tl.load(X + (end - (K - 1) + m).to(tl.int64)[:, None] * stride_xt + ch[None, :], mask=mmask & (local >= 0),
                 other=0.0)
    sv = tl.load(buf[None, :] + (K - 1 + local), mask=mmask & (local < 0) & (local >= lowest), other=0.0)
    new = xv.to(tl.float32) + sv.to(tl.float32)
    tl.debug_barrier()  # every thread's reads of the old buffer before any write of the new one
    tl.store(buf[None, :] + m[:, None], new.to(STATE.dtype.element_ty), mask=mmask)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                  slots: torch.Tensor, has_state: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``causal_conv1d_ref`` as one launch: y [T, C] in x's dtype, ``conv_state`` [S, C, K - 1] updated in place.

    ``x`` [T, C] with a contiguous last dimension (a view of a wider product is fine), ``weight`` [C, K]
    contiguous, ``query_start_loc`` int32 [B + 1], ``slots`` [B] (distinct), ``has_state`` bool [B]. A step of
    decodes alone (T == B) takes one-token blocks; a step with prompt chunks 16-token blocks.
    """
    t, c = x.shape
    k = weight.shape[1]
    check_dtype("x", x)
    if x.stride(1) != 1 or not weight.is_contiguous() or not conv_state.is_contiguous():
        raise ValueError("causal_conv1d needs x's channels, the weight and the conv state contiguous")
    if conv_state.shape[1:] != (c, k - 1):
        raise ValueError(f"conv_state {tuple(conv_state.shape)} does not hold [C={c}, K-1={k - 1}] per slot")
    if out is None:
        out = torch.empty(t, c, dtype=x.dtype, device=x.device)
    b = slots.shape[0]
    if b == 0:
        return out
    block_c = 128 if c >= 128 else max(16, next_pow2(c))
    block_t = 1 if t == b else 16
    _causal_conv_kernel[(b, triton.cdiv(c, block_c))](
        x, weight, conv_state, out, query_start_loc, slots, has_state, x.stride(0), out.stride(0),
        conv_state.stride(0), c, K=k, KP=max(2, next_pow2(k - 1)), BLOCK_T=block_t, BLOCK_C=block_c, num_warps=4)
    return out
