"""Fused random sampling: temperature, Gumbel noise and argmax in one pass over the logits.

The engine's sampler draws from softmax(logits / T) as ``argmax(logits / T + g)`` with Gumbel noise
``g = -log(-log u)``, where ``u`` is a counter-based hash of (the row's seed and output index, the
token id): see ``minfer.engine.sampler.uniform_noise``, the reference. In torch that is a dozen
full passes over a ``[rows, vocab]`` int64 tensor (a quarter of a decode step's GPU time at a
150k vocabulary); here each program reads a chunk of a row's logits once and keeps a running
argmax. Greedy rows take the same kernel without the noise.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._utils import interpreting, next_pow2, num_sms


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["chunk"])
def _argmax_chunk_kernel(LOGITS, ROW_HASH, INV_TEMP, VALS, IDXS, stride, vocab, chunk,
                         NOISE: tl.constexpr, FAST_LOG: tl.constexpr, BLOCK: tl.constexpr):
    """Program (row, c): best score and its lowest column in columns [c * chunk, (c + 1) * chunk)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if NOISE:
        row_hash = tl.load(ROW_HASH + row).to(tl.uint32)
        inv_temp = tl.load(INV_TEMP + row)
    best_val = tl.full([BLOCK], float("-inf"), tl.float32)
    # A chunk with no score above -inf (all -inf or NaN: a broken model, a fully masked row) reports its first
    # column, so the token is always a real id: one past the vocabulary would fault the embedding next step.
    best_idx = tl.full([BLOCK], 0, tl.int32) + c * chunk
    end = tl.minimum(c * chunk + chunk, vocab)
    for start in range(c * chunk, end, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < end
        score = tl.load(LOGITS + row * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        if NOISE:
            col_hash = _mix32(cols.to(tl.uint32) * 0x27D4EB2F + 0x165667B1)
            bits = _mix32(row_hash ^ col_hash) >> 9  # 23 bits: u < 1 exactly (see noise_from_row_hash)
            u = (bits.to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            if FAST_LOG:  # the hardware's approximate log (libdevice's precise one is ~20 FMAs per call)
                score = score * inv_temp - libdevice.fast_logf(-libdevice.fast_logf(u))
            else:  # the interpreter has no fast_logf
                score = score * inv_temp - tl.log(-tl.log(u))
        better = (score > best_val) & mask
        best_val = tl.where(better, score, best_val)
        best_idx = tl.where(better, cols, best_idx)
    top = tl.max(best_val, axis=0)
    idx = tl.min(tl.where(best_val == top, best_idx, vocab), axis=0)  # lowest index among ties
    out = row * tl.num_programs(1) + c
    tl.store(VALS + out, top)
    tl.store(IDXS + out, idx.to(tl.int64))


@triton.jit(do_not_specialize=["chunks"])
def _pick_chunk_kernel(VALS, IDXS, OUT, chunks, BLOCK_C: tl.constexpr):
    """Program row: the index of its best chunk (the lowest chunk among equal bests, so the lowest token id)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    vals = tl.load(VALS + row * chunks + c, mask=c < chunks, other=float("-inf"))
    best = tl.min(tl.where(vals == tl.max(vals, axis=0), c, chunks - 1), axis=0)  # all -inf: chunk 0
    tl.store(OUT + row, tl.load(IDXS + row * chunks + best))


def _chunked_argmax(logits: torch.Tensor, row_hash: torch.Tensor | None, inv_temp: torch.Tensor | None,
                    block: int) -> torch.Tensor:
    """Argmax per row of ``logits`` (plus Gumbel noise when ``row_hash`` is given), in two passes.

    One program per row would leave all but a few multiprocessors idle at small batches (batch 1:
    one program walking a 128k vocabulary, ~28 us); instead each row's vocabulary is cut into
    chunks so that about two programs per SM exist, and a second tiny pass picks the best chunk
    (the first best chunk, so ties still resolve to the lowest token id): one launch, where torch's
    argmax and gather of the chunks' bests took two (~5.6 us of a batch-1 step on an H200).
    """
    rows, vocab = logits.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    sms = num_sms(logits.device)
    chunks = max(1, min(triton.cdiv(2 * sms, rows), triton.cdiv(vocab, block)))
    chunk = triton.cdiv(triton.cdiv(vocab, chunks), block) * block
    chunks = triton.cdiv(vocab, chunk)
    vals = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    idxs = torch.empty(rows, chunks, dtype=torch.int64, device=logits.device)
    noise = row_hash is not None
    _argmax_chunk_kernel[(rows, chunks)](
        logits, row_hash if noise else logits, inv_temp if noise else logits, vals, idxs,
        logits.stride(0), vocab, chunk, NOISE=noise, FAST_LOG=not interpreting(), BLOCK=block,
        num_warps=8 if block >= 2048 else 4)
    if chunks == 1:
        return idxs[:, 0]
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    # One block size per vocabulary (chunks varies with the batch): a variant per batch size compiled mid-run.
    _pick_chunk_kernel[(rows,)](vals, idxs, out, chunks, BLOCK_C=next_pow2(triton.cdiv(vocab, block)), num_warps=1)
    return out


def gumbel_argmax(logits: torch.Tensor, row_hash: torch.Tensor, inv_temperature: torch.Tensor,
                  block: int = 2048) -> torch.Tensor:
    """Sampled token per row of ``logits`` [rows, vocab] (float32 or the model dtype). ``row_hash``
    (int64, values in [0, 2^32)) is the per-row hash of seed and output index; ``inv_temperature``
    contiguous float32 [rows], 1 / T (the sampler keeps it per batch: one division fewer per step)."""
    return _chunked_argmax(logits, row_hash, inv_temperature, block)


def greedy_argmax(logits: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """``logits.argmax(-1)`` (first maximum), spread over the whole GPU even for a single row."""
    return _chunked_argmax(logits, None, None, block)
