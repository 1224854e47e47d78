"""Batched multi-LoRA (Punica's SGMV, S-LoRA): every token of a step through its own adapter, two launches a layer.

``out[t, shard s] += (x[t] · A[slot_t, s]ᵀ) · B[slot_t, shard s rows]ᵀ`` (stack layouts: ``lora_meta.py``).

Grouping by slot. ``lora_meta.build_lora_meta`` sorts a step's tokens by slot once (torch ops, no host sync) and
both kernels walk the groups in blocks of BLOCK_M tokens: each slot owns ``ceil(count / BLOCK_M)`` consecutive
blocks, and program m finds its slot, and its rows in the sorted list, from a cumulative sum of the max_loras counts
in registers. An adapter's A and B tiles are then read once per block of its tokens, not once per token (a gather
kernel's way): at prefill (thousands of tokens, a few adapters) an adapter is read once per 64 tokens; at decode (a
few tokens an adapter) each adapter in use is read once, and the mostly empty 16-row blocks cost only arithmetic
that these memory-bound products have to spare. A token without an adapter sorts last and is in no block: it costs
nothing and its output is not touched. The grid takes the bound ``cdiv(T, BLOCK_M) + min(max_loras, T)`` (each slot
in use adds at most one partial block), fixed by shapes alone, so a CUDA graph captures both kernels; programs past
the real blocks exit at once.

Shrink: ``buf[k, s, t] = x[t, part k of in_features] · A[slot, s, :, part k]ᵀ``, program (m-block, shard and rank
tile, part k). At decode a layer has one block per adapter in use and one to three shards, a few programs to stream
all of in_features: split-K spreads it over more of the GPU, and its parts stay partial sums, which the expand
kernel adds as it loads them (deterministic, no atomics, no zeroed buffer). The buffer is float32: it is tiny
(``split_k × shards × T × rank``), the parts meet in it, and the expand multiplies it in float32, so the whole delta
is rounded once, when it is added to the output (PEFT rounds the intermediate to the model dtype; the difference is
within that dtype's own error).

Expand: ``out[t, cols] = round(out[t, cols] + Σ_k buf[k, s, t] · B[slot, rows]ᵀ)``, program (m-block, column tile of
one shard). The shards' column tiles lie end to end along the grid's second axis and the shard geometry is a
compile-time constant (a layer's is fixed), so one launch covers q, k and v. A token is in one block only: the
read-modify-write of its output has no race. The product runs in float32 (B upcast in registers): its inner
dimension is the rank, so its cost is nothing beside moving the output tile.

Tile sizes: 16-row blocks up to 256 tokens, then 64 (a rule of thumb); the expand's columns as
:func:`default_block_n` says (timed in graph replays on an H200).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .._utils import dot_mode, next_pow2, num_sms
from .lora_meta import LoraMeta, check_expand_args, check_shrink_args, shard_layout, stacked_rows

MAX_SPLIT_K = 16


# ------------------------------------------------------------------------------------------------ triton
@triton.jit
def _slot_block(COUNTS, pid_m, L, BLOCK_M: tl.constexpr, L_PAD: tl.constexpr):
    """(slot, first position in the sorted tokens, rows left from there) of m-block ``pid_m``; slot == L past the
    last block."""
    lo = tl.arange(0, L_PAD)
    count = tl.load(COUNTS + lo, mask=lo < L, other=0)
    blocks = (count + BLOCK_M - 1) // BLOCK_M
    slot = tl.sum((tl.cumsum(blocks, axis=0) <= pid_m).to(tl.int32), axis=0)
    before = lo < slot
    first = (pid_m - tl.sum(tl.where(before, blocks, 0), axis=0)) * BLOCK_M  # this block's first rank in its slot
    start = tl.sum(tl.where(before, count, 0), axis=0) + first
    rows_left = tl.sum(tl.where(lo == slot, count, 0), axis=0) - first
    return slot, start, rows_left


@triton.jit
def _lora_shrink_kernel(X, A, BUF, SORTED, COUNTS, L, K, k_part, stride_xt, stride_al, stride_as, stride_ar,
                        stride_bk, stride_bs, stride_bt, RANK: tl.constexpr, R_TILES: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, L_PAD: tl.constexpr,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """BUF[part, shard, token, r] = X[token, part's columns] · A[slot, shard, r, part's columns] for a block."""
    slot, start, rows_left = _slot_block(COUNTS, tl.program_id(0), L, BLOCK_M, L_PAD)
    if slot >= L:
        return
    shard = tl.program_id(1) // R_TILES
    rr = (tl.program_id(1) % R_TILES) * BLOCK_R + tl.arange(0, BLOCK_R)
    part = tl.program_id(2)
    rm = tl.arange(0, BLOCK_M)
    valid = rm < rows_left
    tokens = tl.load(SORTED + start + rm, mask=valid, other=0).to(tl.int64)
    r_ok = rr < RANK
    a_rows = A + slot.to(tl.int64) * stride_al + shard * stride_as + rr.to(tl.int64)[:, None] * stride_ar
    x_rows = X + tokens[:, None] * stride_xt
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    k_lo = part * k_part
    k_hi = tl.minimum(k_lo + k_part, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k_hi
        xt = tl.load(x_rows + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_rows + ks[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            xt, at = xt.to(tl.float32), at.to(tl.float32)
        acc = tl.dot(xt, tl.trans(at), acc, input_precision=PRECISION)
    b_ptrs = BUF + part * stride_bk + shard * stride_bs + tokens[:, None] * stride_bt + rr[None, :]
    tl.store(b_ptrs, acc, mask=valid[:, None] & r_ok[None, :])


@triton.jit
def _expand_tile(BUF, B, OUT, tokens, valid, slot, tile, stride_bk, stride_bs, stride_bt, stride_wl, stride_wn,
                 stride_ot, SHARD: tl.constexpr, B_ROW: tl.constexpr, OUT_COL: tl.constexpr, SIZE: tl.constexpr,
                 RANK: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_R: tl.constexpr, PRECISION: tl.constexpr):
    """One column tile of one shard: OUT[token, OUT_COL + c] += Σ_part BUF[part, SHARD, token] · B[slot, B_ROW + c]
    (the parts summed in order, then one product)."""
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = cols < SIZE
    w_rows = B + slot.to(tl.int64) * stride_wl + (B_ROW + cols).to(tl.int64)[:, None] * stride_wn
    lhs_rows = BUF + SHARD * stride_bs + tokens[:, None] * stride_bt
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in tl.static_range(0, RANK, BLOCK_R):
        rr = r0 + tl.arange(0, BLOCK_R)
        r_ok = rr < RANK
        lhs = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for part in tl.static_range(SPLIT_K):  # the shrink's partial sums, in order
            lhs += tl.load(lhs_rows + part * stride_bk + rr[None, :], mask=valid[:, None] & r_ok[None, :], other=0.0)
        w = tl.load(w_rows + rr[None, :], mask=c_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(lhs, tl.trans(w), acc, input_precision=PRECISION)
    o_ptrs = OUT + tokens[:, None] * stride_ot + (OUT_COL + cols)[None, :]
    o_mask = valid[:, None] & c_ok[None, :]
    base = tl.load(o_ptrs, mask=o_mask, other=0.0)
    tl.store(o_ptrs, (base.to(tl.float32) + acc).to(OUT.dtype.element_ty), mask=o_mask)


@triton.jit
def _lora_expand_kernel(BUF, B, OUT, SORTED, COUNTS, L, stride_bk, stride_bs, stride_bt, stride_wl, stride_wn,
                        stride_ot, N_SHARDS: tl.constexpr, TILE_STARTS: tl.constexpr, B_ROWS: tl.constexpr,
                        OUT_COLS: tl.constexpr, SIZES: tl.constexpr, RANK: tl.constexpr, SPLIT_K: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, L_PAD: tl.constexpr,
                        PRECISION: tl.constexpr):
    """Program (m-block, tile): the tile's shard is the one whose range of TILE_STARTS holds it."""
    slot, start, rows_left = _slot_block(COUNTS, tl.program_id(0), L, BLOCK_M, L_PAD)
    if slot >= L:
        return
    pid_n = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    valid = rm < rows_left
    tokens = tl.load(SORTED + start + rm, mask=valid, other=0).to(tl.int64)
    for i in tl.static_range(N_SHARDS):
        if (pid_n >= TILE_STARTS[i]) & (pid_n < TILE_STARTS[i + 1]):
            _expand_tile(BUF, B, OUT, tokens, valid, slot, pid_n - TILE_STARTS[i], stride_bk, stride_bs, stride_bt,
                         stride_wl, stride_wn, stride_ot, i, B_ROWS[i], OUT_COLS[i], SIZES[i], RANK, SPLIT_K,
                         BLOCK_M, BLOCK_N, BLOCK_R, PRECISION)


# ------------------------------------------------------------------------------------------------ launchers
def default_block_m(num_tokens: int) -> int:
    """Rows per block: 16 (tl.dot's least) for decode-sized steps, whose blocks are mostly one adapter's few
    tokens; 64 past 256 tokens, where prefill chunks make long groups and a bigger block reads A and B less."""
    return 16 if num_tokens <= 256 else 64


def max_blocks(num_tokens: int, max_loras: int, block_m: int) -> int:
    """The grid's first axis: at most ``cdiv(T, block_m)`` full blocks plus one partial block a slot in use."""
    return triton.cdiv(num_tokens, block_m) + min(max_loras, num_tokens)


def default_block_n(num_tokens: int, shard_sizes: Sequence[int]) -> int:
    """The expand's output columns a program, from graph-replayed timings on an H200 (llama-3.1-8b's layers, rank
    16, ``dev/lora_tiles.py``): 64 for the narrow layers' decode steps below 64 tokens, 128 from there; 256 for a
    layer with a shard of 8192 columns or more (gate/up) from 8 tokens, whose narrow tiles make hundreds of programs
    a block (the figures: RESULTS.md)."""
    if max(shard_sizes) >= 8192 and num_tokens >= 8:
        return 256
    return 128 if num_tokens >= 64 else 64


def _rank_tile(rank: int) -> int:
    return min(max(16, next_pow2(rank)), 64)


def default_split_k(num_tokens: int, max_loras: int, n_shards: int, rank: int, in_features: int, block_m: int,
                    block_k: int, device: torch.device) -> int:
    """Parts of in_features for the shrink: enough programs for two a multiprocessor, each part at least four
    K tiles, a power of two up to 16. From shapes alone (the grid of a captured graph cannot follow the counts)."""
    programs = max_blocks(num_tokens, max_loras, block_m) * n_shards * triton.cdiv(rank, _rank_tile(rank))
    split = min(2 * num_sms(device) // programs, in_features // (4 * block_k), MAX_SPLIT_K)
    return 1 << (split.bit_length() - 1) if split > 1 else 1


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, meta: LoraMeta, split_k: int | None = None,
                block_m: int | None = None) -> torch.Tensor:
    """``buf [split_k, n_shards, T, max_rank]`` float32 whose sum over the first axis is ``x[t] · A[slot_t, s]ᵀ``;
    the rows of tokens without an adapter are left unwritten (no kernel reads them).

    x ``[T, in_features]``, ``a_stack [max_loras, n_shards, max_rank, in_features]``, one dtype (float32,
    bfloat16, float16). ``split_k``, ``block_m``: the launch's, by default :func:`default_split_k`'s and
    :func:`default_block_m`'s."""
    check_shrink_args(x, a_stack, meta)
    num_tokens, in_features = x.shape
    max_loras, n_shards, rank, _ = a_stack.shape
    block_m = block_m or default_block_m(num_tokens)
    block_k = 128 if block_m == 16 else 64
    if split_k is None:
        split_k = default_split_k(num_tokens, max_loras, n_shards, rank, in_features, block_m, block_k, x.device)
    if not 1 <= split_k <= MAX_SPLIT_K:
        raise ValueError(f"split_k must be in [1, {MAX_SPLIT_K}], got {split_k}")
    buf = torch.empty(split_k, n_shards, num_tokens, rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return buf
    block_r = _rank_tile(rank)
    r_tiles = triton.cdiv(rank, block_r)
    k_part = triton.cdiv(triton.cdiv(in_features, split_k), block_k) * block_k  # whole K tiles: parts never overlap
    upcast, precision = dot_mode(x.dtype)
    grid = (max_blocks(num_tokens, max_loras, block_m), n_shards * r_tiles, split_k)
    _lora_shrink_kernel[grid](
        x, a_stack, buf, meta.sorted_tokens, meta.slot_counts, max_loras, in_features, k_part, x.stride(0),
        a_stack.stride(0), a_stack.stride(1), a_stack.stride(2), buf.stride(0), buf.stride(1), buf.stride(2),
        RANK=rank, R_TILES=r_tiles, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        L_PAD=next_pow2(max_loras), UPCAST=upcast, PRECISION=precision)
    return buf


def lora_expand(buf: torch.Tensor, b_stack: torch.Tensor, meta: LoraMeta, out: torch.Tensor,
                shard_sizes: Sequence[int], shard_offsets: Sequence[int] | None = None,
                block_m: int | None = None, block_n: int | None = None) -> None:
    """``out[t, shard s columns] = round(out + Σ_k buf[k, s, t] · B[slot_t, shard s rows]ᵀ)``, in place.

    buf: :func:`lora_shrink`'s. ``b_stack [max_loras, sum(shard_sizes), max_rank]`` (the shards' B rows stacked),
    out ``[T, N_out]`` of its dtype. Shard s lands in columns ``[shard_offsets[s], + shard_sizes[s])``, by default
    the shards side by side from column 0. Outputs of tokens without an adapter are not touched."""
    sizes, cols = shard_layout(shard_sizes, shard_offsets)
    check_expand_args(buf, b_stack, meta, out, sizes, cols)
    split_k, n_shards, num_tokens, rank = buf.shape
    if num_tokens == 0:
        return
    block_m = block_m or default_block_m(num_tokens)
    block_n = block_n or default_block_n(num_tokens, sizes)
    tile_starts = tuple(sum(triton.cdiv(s, block_n) for s in sizes[:i]) for i in range(n_shards + 1))
    _, precision = dot_mode(torch.float32)
    grid = (max_blocks(num_tokens, meta.max_loras, block_m), tile_starts[-1])
    _lora_expand_kernel[grid](
        buf, b_stack, out, meta.sorted_tokens, meta.slot_counts, meta.max_loras, buf.stride(0), buf.stride(1),
        buf.stride(2), b_stack.stride(0), b_stack.stride(1), out.stride(0), N_SHARDS=n_shards,
        TILE_STARTS=tile_starts, B_ROWS=stacked_rows(sizes), OUT_COLS=cols, SIZES=sizes, RANK=rank, SPLIT_K=split_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=_rank_tile(rank), L_PAD=next_pow2(max(meta.max_loras, 1)),
        PRECISION=precision)
