"""Staged 8-bit prefill: a prompt step's pages of an 8-bit cache dequantized into a 16-bit scratch cache,
over which the 16-bit prefill kernel runs.

Why not convert in the attention kernel: prefill attention is compute-bound (a chunk of T rows reads each key
tile once per 128 rows), so every conversion there is paid T / 128 times and sits on the tensor cores' path; the
Hopper kernel's converter partition holds the 8-bit prefill well under the 16-bit kernel (benchmarks/RESULTS.md).
Converting each page once costs a pass over the context's bytes (read 1 byte, write 2 per value): for an 8k causal
prompt on llama-3.1-8b's heads ~50 MB, 26 us against the attention's ~970 us on an H100. It pays where the kernel
would convert a key several times (``conversions``), not for a few rows over a long context (speculative
verification), which stays with the converting kernel.

A plan (``plan_stage``, once per step for each block table and window) lists the pages the chunks can see: each
chunk's pages from its first row's window start (from page 0 without a window) to its context's end, laid out
chunk after chunk in the scratch, and a block table over the scratch in the cache table's shape. Entries before a
chunk's first staged page or past its last point at its first / last staged page: the kernels may read them
(whole tiles) but mask them by position, so they only need finite values.

Each value is ``code * scale`` rounded once to the scratch dtype: bf16's 8 significant bits move it by less than
half an int8 step (|code| <= 127) and far less than an e4m3 step; float16 scratch saturates at ±65504, as the 8-bit
kernels' q does. The scratch lives for one layer's attention; the engine stages only while its pages hold no more
tokens than its start-up memory profile staged (``TritonOps``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from .._utils import interpreting
from .prefill_attention_sm90 import BLOCK_M
from ..quant.quant import check_cache_scales, codes_to_f16, product_mode, round_to_float_grid

STAGE_BLOCK = 4096  # values a program converts per loop iteration
_GRID = {torch.bfloat16: (7, -126), torch.float16: (10, -14)}  # scratch dtype -> (mantissa bits, min exponent)


@dataclass(frozen=True)
class StagePlan:
    """Which cache pages a prompt step stages, and where (all int32 on the device)."""

    table: torch.Tensor  # [num_chunks, width]: each chunk's block table over the scratch cache
    seq: torch.Tensor  # [pages]: the chunk each staged page belongs to
    col: torch.Tensor  # [pages]: the page's column in that chunk's row of the cache's block table
    pages: int


def plan_stage(context_lens: Sequence[int], query_lens: Sequence[int], page: int, width: int, window: int,
               device: torch.device, max_pages: int | None = None, min_reuse: float = 0.0) -> StagePlan | None:
    """The pages chunks of ``query_lens`` rows ending at ``context_lens`` tokens see (host ints, one per chunk),
    in a cache of ``page``-token pages whose block table is ``width`` columns wide; ``window`` > 0: the last
    ``window`` keys of each row (the first row's window start bounds the chunk's first page). None when they
    are more than ``max_pages``, or when the converting kernel would convert a staged key fewer than
    ``min_reuse`` times on average (``conversions``): then staging costs more than it saves."""
    ctx = np.asarray(context_lens, dtype=np.int64)
    q_lens = np.asarray(query_lens, dtype=np.int64)
    if ctx.shape != q_lens.shape or (q_lens < 1).any() or (q_lens > ctx).any():
        raise ValueError("every chunk needs 1 <= query_len <= context_len")
    last = -(-ctx // page)
    if (last > width).any():
        raise ValueError(f"a context of {int(ctx.max())} tokens needs more than the table's {width} pages")
    first = np.maximum(ctx - q_lens + 1 - window, 0) // page if window > 0 else np.zeros_like(ctx)
    counts = last - first
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    pages = int(counts.sum())
    if max_pages is not None and pages > max_pages:
        return None
    if min_reuse > 0 and conversions(ctx - first * page, q_lens) < min_reuse * (ctx - first * page).sum():
        return None
    seq = np.repeat(np.arange(len(ctx)), counts)
    col = first[seq] + np.arange(pages) - starts[seq]
    table = starts[:, None] + np.clip(np.arange(width)[None, :] - first[:, None], 0, counts[:, None] - 1)
    # One upload a step, from pinned memory and asynchronous (a pageable copy would wait for the device's queue),
    # each array on a 64-byte boundary: Triton specialises on pointer alignment, and a new variant compiles mid-run.
    parts = (table.ravel(), seq, col)
    offsets = np.cumsum([0] + [-(-len(a) // 16) * 16 for a in parts])
    host = torch.zeros(int(offsets[-1]), dtype=torch.int32, pin_memory=device.type == "cuda")
    for a, at in zip(parts, offsets):
        host[at:at + len(a)] = torch.from_numpy(a.astype(np.int32))
    flat = host.to(device, non_blocking=True)
    t, sq, cl = (flat[at:at + len(a)] for a, at in zip(parts, offsets))
    return StagePlan(t.view(len(ctx), width), sq, cl, pages)


def conversions(keys: np.ndarray, query_lens: np.ndarray) -> float:
    """How many times a converting prefill kernel converts the staged keys of chunks that see ``keys`` keys each
    (the last ``query_lens`` of them the chunk's own): once per ``BLOCK_M``-row query block that sees a key, so all
    of a chunk's blocks for the keys before it and, causal, half of them on average for its own."""
    blocks = -(-query_lens // BLOCK_M)
    return float((blocks * np.maximum(keys - query_lens, 0) + np.minimum(keys, query_lens) * (blocks + 1) / 2).sum())


@triton.jit
def _stage_page(codes, scales, out, blk, i, e, inside, PAGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                HEAD_DIM: tl.constexpr, KIND: tl.constexpr, ASM: tl.constexpr, EXACT: tl.constexpr,
                MANT: tl.constexpr, EMIN: tl.constexpr, SATURATE: tl.constexpr):
    """Values ``e`` of cache page ``blk`` (contiguous ``[PAGE, Hkv, D]``, scales ``[Hkv, PAGE]``) into scratch page
    ``i``, which has the cache page's layout."""
    PAGE_VALUES: tl.constexpr = PAGE * NUM_KV_HEADS * HEAD_DIM
    token = e // (NUM_KV_HEADS * HEAD_DIM)
    head = (e // HEAD_DIM) % NUM_KV_HEADS
    x = codes_to_f16(tl.load(codes + blk * PAGE_VALUES + e, mask=inside), KIND, ASM, True)
    s = tl.load(scales + (blk * NUM_KV_HEADS + head) * PAGE + token, mask=inside, other=0.0)
    y = x.to(tl.float32) * s.to(tl.float32)
    if SATURATE:
        y = tl.minimum(tl.maximum(y, -65504.0), 65504.0)
    if EXACT:  # the interpreter's conversion rounds ties away and can drop a carry (kv_quant.py)
        y = round_to_float_grid(y, MANT, EMIN)
    tl.store(out + i * PAGE_VALUES + e, y.to(out.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["bt_stride"])
def _stage_kernel(k_codes, v_codes, k_scales, v_scales, k_out, v_out, block_tables, seq_of, col_of, bt_stride,
                  PAGE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                  KIND: tl.constexpr, ASM: tl.constexpr, EXACT: tl.constexpr, MANT: tl.constexpr,
                  EMIN: tl.constexpr, SATURATE: tl.constexpr):
    """One scratch page, K and V, every KV head."""
    i = tl.program_id(0).to(tl.int64)
    seq = tl.load(seq_of + i).to(tl.int64)
    blk = tl.load(block_tables + seq * bt_stride + tl.load(col_of + i)).to(tl.int64)
    PAGE_VALUES: tl.constexpr = PAGE * NUM_KV_HEADS * HEAD_DIM
    for start in tl.static_range(0, PAGE_VALUES, BLOCK):
        e = start + tl.arange(0, BLOCK)
        inside = e < PAGE_VALUES
        _stage_page(k_codes, k_scales, k_out, blk, i, e, inside, PAGE, NUM_KV_HEADS, HEAD_DIM, KIND, ASM, EXACT,
                    MANT, EMIN, SATURATE)
        _stage_page(v_codes, v_scales, v_out, blk, i, e, inside, PAGE, NUM_KV_HEADS, HEAD_DIM, KIND, ASM, EXACT,
                    MANT, EMIN, SATURATE)


def stage_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
             block_tables: torch.Tensor, plan: StagePlan, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's pages of an 8-bit cache (codes ``[num_blocks, page, Hkv, D]``, scales ``[num_blocks, Hkv,
    page]``) as a ``dtype`` cache ``[plan.pages, page, Hkv, D]`` each for K and V; ``block_tables``: the cache's
    rows of the chunks the plan was made for."""
    fmt = check_cache_scales(k_cache, v_cache, k_scale, v_scale)
    if fmt is None:
        raise ValueError(f"staging needs an 8-bit cache, got {k_cache.dtype}")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"the scratch dtype must be bfloat16, float16 or float32, got {dtype}")
    if block_tables.dtype != torch.int32 or block_tables.shape != plan.table.shape:
        raise ValueError(f"block_tables must be int32 {list(plan.table.shape)} (the plan's chunks), got "
                         f"{block_tables.dtype} {list(block_tables.shape)}")
    _, page, num_kv_heads, head_dim = k_cache.shape
    # product_mode's view: fp8 codes as bytes where inline PTX converts them (a 16-bit q: the float16 route).
    probe = torch.empty(0, 1, 1, dtype=torch.float16, device=k_cache.device)
    k_codes, v_codes, _, _, _, asm = product_mode(probe, k_cache, v_cache, fmt)
    shape = (plan.pages, page, num_kv_heads, head_dim)
    k_out = torch.empty(shape, dtype=dtype, device=k_cache.device)
    v_out = torch.empty(shape, dtype=dtype, device=k_cache.device)
    if plan.pages == 0:
        return k_out, v_out
    mant, emin = _GRID.get(dtype, (0, 0))
    params = dict(PAGE=page, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
                  BLOCK=min(STAGE_BLOCK, triton.next_power_of_2(page * num_kv_heads * head_dim)),
                  KIND=fmt.f16_kind, ASM=asm, EXACT=interpreting() and mant > 0, MANT=mant, EMIN=emin,
                  SATURATE=dtype == torch.float16, num_warps=4)
    _stage_kernel[(plan.pages,)](k_codes, v_codes, k_scale, v_scale, k_out, v_out, block_tables, plan.seq, plan.col,
                                 block_tables.stride(0), **params)
    return k_out, v_out


def staged_prefill_attention(prefill: Callable[..., torch.Tensor], q: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                             context_lens: torch.Tensor, max_query_len: int, scale: float,
                             out: torch.Tensor | None = None, *, k_scale: torch.Tensor, v_scale: torch.Tensor,
                             window: int = 0, plan: StagePlan | None = None, **how: Any) -> torch.Tensor:
    """``prefill`` (a 16-bit paged prefill kernel's entry point, same arguments) over an 8-bit cache, staged.
    ``plan``: ``plan_stage``'s for these chunks (None: made here from the device's lengths, which waits for the
    device; the engine plans from its host copies). ``how``: the kernel's other keywords (softcap, sinks)."""
    if plan is None:
        ctx = context_lens.tolist()
        q_lens = query_start_loc.diff().tolist()
        plan = plan_stage(ctx, q_lens, k_cache.shape[1], block_tables.shape[1], window, q.device)
    k16, v16 = stage_kv(k_cache, v_cache, k_scale, v_scale, block_tables, plan, q.dtype)
    return prefill(q, k16, v16, plan.table, query_start_loc, context_lens, max_query_len, scale, out,
                   window=window, **how)
