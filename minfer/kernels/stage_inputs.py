"""Scatter one packed upload of a decode step's inputs into the static buffers of its CUDA graph.

A graph replays kernels on fixed addresses, so every step's inputs (token ids, positions, cache slots,
context lengths, block tables) must land in the graph's own buffers, and the padding rows of the bucket
need their harmless values (slot -1, one token of context). With torch ops that is two uploads, five
device copies, two fills and the gather/scatter of the tokens still on the device: about ten launches
outside the graph. Here the host packs everything into one pinned int64 buffer, which goes up in one copy,
and one kernel puts each row where the graph reads it, taking a token sampled by the previous step straight
from that step's output. With the one-launch argmax (``sampling.py``), a batch-1 token spends ~17 us
outside the graph on an H200 (llama-3.2-1b).

Packed layout for ``n`` rows, ``groups`` KV groups and tables ``width`` entries wide (int64 words): ids [n] |
positions [n] | source rows [n] (the row of the previous step's sampled ids that holds this row's input
token, or -1 when ``ids`` has it) | slots [groups, n] | context lengths and then the tables [groups, n, width]
as int32 pairs packed into the words after.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl


def packed_words(n: int, width: int, groups: int = 1) -> int:
    """int64 words of the packed upload for ``n`` rows of ``width`` table entries in ``groups`` KV groups."""
    return (3 + groups) * n + (n + groups * n * width + 1) // 2


def pack_decode_inputs(out: np.ndarray, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                       src_rows: np.ndarray, ctx_lens: np.ndarray, tables: np.ndarray) -> None:
    """Fill ``out`` (int64, ``packed_words(n, width, groups)`` long) with the step's arrays, in the packed
    layout: ``slots`` [groups, n], ``tables`` [groups, n, width]."""
    groups, n, width = tables.shape
    for i, a in enumerate((ids, positions, src_rows)):
        out[i * n:(i + 1) * n] = a
    out[3 * n:(3 + groups) * n] = slots.ravel()
    words = out[(3 + groups) * n:].view(np.int32)
    words[:n] = ctx_lens
    words[n:n + groups * n * width] = tables.ravel()


@triton.jit(do_not_specialize=["n", "width"])
def _stage_kernel(PACKED, PACKED32, PREV, IDS, POS, SLOTS, CTX, TABLES, n, width, stride_sg, stride_tg, stride_t,
                  GROUPS: tl.constexpr, BLOCK: tl.constexpr):
    """Program r: row r of the bucket. PACKED32 is PACKED read as int32 (the lengths and tables)."""
    r = tl.program_id(0)
    if r < n:
        src = tl.load(PACKED + 2 * n + r)
        token = tl.load(PACKED + r)
        if src >= 0:
            token = tl.load(PREV + src)
        tl.store(IDS + r, token)
        tl.store(POS + r, tl.load(PACKED + n + r))
        small = PACKED32 + 2 * (3 + GROUPS) * n
        tl.store(CTX + r, tl.load(small + r))
        for g in tl.static_range(GROUPS):
            tl.store(SLOTS + g * stride_sg + r, tl.load(PACKED + (3 + g) * n + r))
            row = small + n + (g * n + r).to(tl.int64) * width
            for c0 in range(0, width, BLOCK):
                c = c0 + tl.arange(0, BLOCK)
                tl.store(TABLES + g * stride_tg + r.to(tl.int64) * stride_t + c, tl.load(row + c, mask=c < width),
                         mask=c < width)
    else:  # a padding row of the bucket: no KV store, attend over one (harmless) slot
        for g in tl.static_range(GROUPS):
            tl.store(SLOTS + g * stride_sg + r, -1)
        tl.store(CTX + r, 1)


def stage_decode_inputs(packed: torch.Tensor, n: int, width: int, prev_tokens: torch.Tensor | None,
                        ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ctx_lens: torch.Tensor,
                        tables: torch.Tensor) -> None:
    """Unpack ``packed`` (the device copy of :func:`pack_decode_inputs`' buffer) into the first ``n`` rows of the
    static buffers (``slots`` [groups, rows], ``tables[:, :n, :width]``) and mark their remaining rows as
    padding. ``prev_tokens``: the previous step's sampled ids (int64), read by rows whose source row is >= 0."""
    if not (ids.dtype == positions.dtype == slots.dtype == packed.dtype == torch.int64
            and ctx_lens.dtype == tables.dtype == torch.int32):
        raise TypeError("ids, positions, slots and packed must be int64; ctx_lens and tables int32")
    rows, groups = len(ids), tables.shape[0]
    if not n <= rows or width > tables.shape[2] or packed.numel() < packed_words(n, width, groups):
        raise ValueError(f"{n} rows of {width} table entries do not fit buffers of {rows} rows, "
                         f"{tables.shape[2]} entries, {packed.numel()} packed words")
    prev = prev_tokens if prev_tokens is not None else packed
    _stage_kernel[(rows,)](packed, packed.view(torch.int32), prev, ids, positions, slots, ctx_lens, tables, n, width,
                           slots.stride(0), tables.stride(0), tables.stride(1), GROUPS=groups, BLOCK=128, num_warps=1)


def stage_decode_inputs_ref(packed: torch.Tensor, n: int, width: int, prev_tokens: torch.Tensor | None,
                            ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ctx_lens: torch.Tensor,
                            tables: torch.Tensor) -> None:
    """Torch reference of :func:`stage_decode_inputs`."""
    groups = tables.shape[0]
    src = packed[2 * n:3 * n]
    token = packed[:n].clone()
    pending = src >= 0
    if bool(pending.any()):
        token[pending] = prev_tokens[src[pending]]
    ids[:n] = token
    positions[:n] = packed[n:2 * n]
    slots[:, :n] = packed[3 * n:(3 + groups) * n].view(groups, n)
    small = packed[(3 + groups) * n:].view(torch.int32)
    ctx_lens[:n] = small[:n]
    tables[:, :n, :width] = small[n:n + groups * n * width].view(groups, n, width)
    slots[:, n:] = -1
    ctx_lens[n:] = 1
