"""Scatter one packed upload of a decode step's inputs into the static buffers of its CUDA graph.

A graph replays kernels on fixed addresses, so every step's inputs (token ids, positions, cache slots,
context lengths, block tables) must land in the graph's own buffers, and the padding rows of the bucket
need their harmless values (slot -1, one token of context). With torch ops that is two uploads, five
device copies, two fills and the gather/scatter of the tokens still on the device: about ten launches
outside the graph. Here the host packs everything into one pinned int64 buffer, which goes up in one copy,
and one kernel puts each row where the graph reads it, taking a token sampled by the previous step straight
from that step's output. With the one-launch argmax (``sampling.py``), a batch-1 token spends ~17 us
outside the graph on an H200 (llama-3.2-1b).

Packed layout for ``n`` rows and tables ``width`` entries wide (int64 words): ids [n] | positions [n] |
slots [n] | source rows [n] (the row of the previous step's sampled ids that holds this row's input token,
or -1 when ``ids`` has it) | context lengths and then the tables as int32 pairs packed into the words after.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl


def packed_words(n: int, width: int) -> int:
    """int64 words of the packed upload for ``n`` rows of ``width`` table entries."""
    return 4 * n + (n + n * width + 1) // 2


def pack_decode_inputs(out: np.ndarray, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                       src_rows: np.ndarray, ctx_lens: np.ndarray, tables: np.ndarray) -> None:
    """Fill ``out`` (int64, ``packed_words(n, width)`` long) with the step's arrays, in the packed layout."""
    n, width = tables.shape
    for i, a in enumerate((ids, positions, slots, src_rows)):
        out[i * n:(i + 1) * n] = a
    words = out[4 * n:].view(np.int32)
    words[:n] = ctx_lens
    words[n:n + n * width] = tables.ravel()


@triton.jit(do_not_specialize=["n", "width"])
def _stage_kernel(PACKED, PACKED32, PREV, IDS, POS, SLOTS, CTX, TABLES, n, width, stride_t, BLOCK: tl.constexpr):
    """Program r: row r of the bucket. PACKED32 is PACKED read as int32 (the lengths and tables)."""
    r = tl.program_id(0)
    if r < n:
        src = tl.load(PACKED + 3 * n + r)
        token = tl.load(PACKED + r)
        if src >= 0:
            token = tl.load(PREV + src)
        tl.store(IDS + r, token)
        tl.store(POS + r, tl.load(PACKED + n + r))
        tl.store(SLOTS + r, tl.load(PACKED + 2 * n + r))
        small = PACKED32 + 8 * n
        tl.store(CTX + r, tl.load(small + r))
        row = small + n + r.to(tl.int64) * width
        for c0 in range(0, width, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            tl.store(TABLES + r.to(tl.int64) * stride_t + c, tl.load(row + c, mask=c < width), mask=c < width)
    else:  # a padding row of the bucket: no KV store, attend over one (harmless) slot
        tl.store(SLOTS + r, -1)
        tl.store(CTX + r, 1)


def stage_decode_inputs(packed: torch.Tensor, n: int, width: int, prev_tokens: torch.Tensor | None,
                        ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ctx_lens: torch.Tensor,
                        tables: torch.Tensor) -> None:
    """Unpack ``packed`` (the device copy of :func:`pack_decode_inputs`' buffer) into the first ``n`` rows of the
    static buffers (``tables[:n, :width]``) and mark their remaining rows as padding. ``prev_tokens``: the
    previous step's sampled ids (int64), read by rows whose source row is >= 0."""
    if not (ids.dtype == positions.dtype == slots.dtype == packed.dtype == torch.int64
            and ctx_lens.dtype == tables.dtype == torch.int32):
        raise TypeError("ids, positions, slots and packed must be int64; ctx_lens and tables int32")
    rows = len(ids)
    if not n <= rows or width > tables.shape[1] or packed.numel() < packed_words(n, width):
        raise ValueError(f"{n} rows of {width} table entries do not fit buffers of {rows} rows, "
                         f"{tables.shape[1]} entries, {packed.numel()} packed words")
    prev = prev_tokens if prev_tokens is not None else packed
    _stage_kernel[(rows,)](packed, packed.view(torch.int32), prev, ids, positions, slots, ctx_lens, tables, n, width,
                           tables.stride(0), BLOCK=128, num_warps=1)


def stage_decode_inputs_ref(packed: torch.Tensor, n: int, width: int, prev_tokens: torch.Tensor | None,
                            ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, ctx_lens: torch.Tensor,
                            tables: torch.Tensor) -> None:
    """Torch reference of :func:`stage_decode_inputs`."""
    src = packed[3 * n:4 * n]
    token = packed[:n].clone()
    pending = src >= 0
    if bool(pending.any()):
        token[pending] = prev_tokens[src[pending]]
    ids[:n] = token
    positions[:n] = packed[n:2 * n]
    slots[:n] = packed[2 * n:3 * n]
    small = packed[4 * n:].view(torch.int32)
    ctx_lens[:n] = small[:n]
    tables[:n, :width] = small[n:n + n * width].view(n, width)
    slots[n:] = -1
    ctx_lens[n:] = 1
