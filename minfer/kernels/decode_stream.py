"""Paged decode attention with the work cut in equal shares ("stream-K" decoding).

The split kernel (``decode_attention.py``) runs one program per (sequence, KV head, split). Workload A's
decode steps mix contexts of 100 to 2,000 tokens, and there a program streams 2 to 30 tiles: each one pays
its pipeline's fill and drain, and the SMs that drew long programs finish last. Measured on an H200
(``benchmarks/bench_decode_splits.py``): 81-85% of bandwidth on those mixes with the best split count, 89-91%
with the same bytes in equal lengths, ~100% at 4k tokens each.

Here the host lists every (sequence, tile) of the step once (``plan_decode``: sequences in batch order, tiles
of ``BLOCK_N`` tokens in order), and program ``p`` of every KV head takes the tiles ``[p*T, (p+1)*T)`` of that
list, ``T = ceil(tiles / programs)``: one unbroken loop, so the pipeline fills once per program, and every
program moves the same bytes. Inside the loop a new sequence starts by resetting the running max (which zeroes
the softmax state through the usual rescale) and a sequence's last tile writes its output. A sequence cut by
a program boundary leaves normalised partials (at most two per program: the piece its first tile belongs to,
slot 0, and the piece its last tile belongs to, slot 1), which a small second kernel merges by log-sum-exp.

Everything else (GQA grouping padded to 16 rows for ``tl.dot``, the online softmax in the log2 domain,
8-bit caches converted in registers with scales on the score and probability columns) is the split kernel's.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from ._utils import dot_mode, next_pow2, num_sms
from .decode_attention import LOG2E, default_config
from .pdl import launch_options, use_pdl, wait_for_previous
from .quant import F16_INT8_BIASED, INT8_F16_BIAS, check_paged_attention, codes_to_f16

# Programs per KV head: about PROGRAMS_PER_SM * SMs programs in all, one resident wave or two.
PROGRAMS_PER_SM = 2
TILE_BITS = 16  # a plan entry is (sequence << 16) | tile: up to 65,535 tiles (4M tokens at 64) per sequence


@dataclass(frozen=True)
class DecodePlan:
    """The step's tile list (host-built, on the device): ``tiles`` [>= num_tiles, 2 + pages per tile] int32
    records (``plan_arrays``); ``seq_starts`` [num_seqs + 1] int32, sequence s's first record, the last value
    the number of tiles. ``block_n`` is the tile the plan was cut for."""

    tiles: torch.Tensor
    seq_starts: torch.Tensor
    block_n: int


def pages_per_tile(block_n: int, page: int) -> int:
    return max(1, block_n // page)


def plan_arrays(context_lens: np.ndarray, block_tables: np.ndarray, block_n: int, page: int) -> tuple[np.ndarray, ...]:
    """(tiles, seq_starts) for ``context_lens`` [B] and ``block_tables`` [B, blocks] (host arrays), in tiles of
    ``block_n`` tokens over pages of ``page``.

    A tile's record holds everything the kernel's loop needs, so that its K/V addresses are one load away from
    the loop counter (as in the split kernel) and the pipeline can fetch them stages ahead: ``(seq << 16) |
    tile``, ``valid tokens | (last tile of its sequence) << 16``, then the tile's page ids."""
    ctx = np.asarray(context_lens, dtype=np.int64)
    n_tiles = -(-ctx // block_n)
    if len(n_tiles) and n_tiles.max() >= 1 << TILE_BITS:
        raise ValueError(f"a context of {int(ctx.max())} tokens exceeds the plan's tile field")
    starts = np.zeros(len(n_tiles) + 1, dtype=np.int64)
    np.cumsum(n_tiles, out=starts[1:])
    seq = np.repeat(np.arange(len(n_tiles), dtype=np.int64), n_tiles)
    tile = np.arange(int(starts[-1]), dtype=np.int64) - starts[seq]
    ppt = pages_per_tile(block_n, page)
    rec = np.empty((len(seq), 2 + ppt), dtype=np.int64)
    rec[:, 0] = (seq << TILE_BITS) | tile
    first_tok = tile * block_n
    rec[:, 1] = np.minimum(ctx[seq] - first_tok, block_n) | ((tile == n_tiles[seq] - 1).astype(np.int64) << 16)
    cols = np.minimum(first_tok[:, None] // page + np.arange(ppt), block_tables.shape[1] - 1)
    rec[:, 2:] = block_tables[seq[:, None], cols]
    return rec.astype(np.int32), starts.astype(np.int32)


def decode_programs(num_kv_heads: int, device: torch.device) -> int:
    """Programs per KV head: fixed per model and device (CUDA graphs capture the grid), whatever the batch."""
    return max(1, triton.cdiv(PROGRAMS_PER_SM * num_sms(device), num_kv_heads))


@triton.jit
def _load_q(Q, b, stride_qb, heads, stride_qh, dims, row_mask, UPCAST: tl.constexpr, F16_DOT: tl.constexpr):
    """Sequence b's query rows of this program's head group, in the dtype the products take."""
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if F16_DOT:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


@triton.jit
def _decode_stream_kernel(
    Q, K, V, KS, VS, TILES, SEQ_STARTS, O, MID_O, MID_LSE, scale_log2e, num_seqs,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_ob, stride_oh, REC: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    QUANT: tl.constexpr, F16_DOT: tl.constexpr, F16_KIND: tl.constexpr, BIASED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    p = tl.program_id(0)
    kvh = tl.program_id(1)
    num_heads = GROUP * tl.num_programs(1)
    total = tl.load(SEQ_STARTS + num_seqs)
    per_prog = tl.cdiv(total, tl.num_programs(0))
    g_start = p * per_prog
    g_end = tl.minimum(g_start + per_prog, total)

    rows = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    kv_base = kvh.to(tl.int64) * stride_kh
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    q = _load_q(Q, kvh * 0, stride_qb, heads, stride_qh, dims, row_mask, UPCAST, F16_DOT)  # row 0: sets q's type
    if BIASED:
        q_bias = tl.zeros([GROUP_PAD], tl.float32)
        v_bias = tl.zeros([GROUP_PAD], tl.float32)  # sum of the P·V weights, rescaled like acc
    seg_from_seq_start = 0  # does the current piece start at its sequence's first tile?
    seg_is_first = 1  # is the current piece this program's first?
    for g in range(g_start, g_end):
        rec = TILES + g * REC
        entry = tl.load(rec)
        b = entry >> 16
        t = entry & 0xFFFF
        fill = tl.load(rec + 1)
        seq_last = (fill >> 16) != 0
        first = (t == 0) | (g == g_start)
        seg_from_seq_start = tl.where(first, (t == 0).to(tl.int32), seg_from_seq_start)
        seg_is_first = tl.where(first, (g == g_start).to(tl.int32), seg_is_first)
        last = seq_last | (g == g_end - 1)

        if first:  # a new sequence's query (in registers until the next one)
            q = _load_q(Q, b, stride_qb, heads, stride_qh, dims, row_mask, UPCAST, F16_DOT)
            if BIASED:  # int8 codes arrive as float16 1152 + code: the bias's share of every score
                q_bias = INT8_F16_BIAS * tl.sum(q.to(tl.float32), axis=1)
        offs = t * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = tl.arange(0, BLOCK_N) < (fill & 0xFFFF)
        page = tl.load(rec + 2 + offs // PAGE - (t * BLOCK_N) // PAGE).to(tl.int64)
        tok = kv_base + page * stride_kb + (offs % PAGE) * stride_kt
        k = tl.load(K + tok[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(V + tok[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        if QUANT:
            s_off = page * (tl.num_programs(1) * PAGE) + kvh * PAGE + offs % PAGE
            k_scale = tl.load(KS + s_off, mask=valid, other=0.0).to(tl.float32)
            v_scale = tl.load(VS + s_off, mask=valid, other=0.0).to(tl.float32)
            if F16_DOT:
                k = codes_to_f16(k, F16_KIND)
                v = codes_to_f16(v, F16_KIND)
            else:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
            if BIASED:
                s = s - q_bias[:, None]
            s = s * (k_scale * scale_log2e)[None, :]
        else:
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2e
        s = tl.where(valid[None, :], s, float("-inf"))
        # A new sequence: a running max of -inf makes alpha 0, which zeroes l_i and acc below.
        m_old = tl.where(first, float("-inf"), m_i)
        m_i = tl.maximum(m_old, tl.max(s, axis=1))
        p_tile = tl.exp2(s - m_i[:, None])
        alpha = tl.exp2(m_old - m_i)
        l_i = l_i * alpha + tl.sum(p_tile, axis=1)
        if QUANT:
            pv = (p_tile * v_scale[None, :]).to(v.dtype)
            acc = tl.dot(pv, v, acc * alpha[:, None], input_precision=DOT_PREC)
            if BIASED:
                v_bias = v_bias * alpha + tl.sum(pv.to(tl.float32), axis=1)
        else:
            acc = tl.dot(p_tile.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)

        if last:  # the piece ends: the sequence's output, or a partial for the merge
            res = acc
            if BIASED:
                res = acc - INT8_F16_BIAS * v_bias[:, None]
            out = res / l_i[:, None]
            if (seg_from_seq_start != 0) & seq_last:
                tl.store(O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                         out.to(O.dtype.element_ty), mask=row_mask[:, None])
            else:
                slot = (p * num_heads + heads).to(tl.int64) * 2 + 1 - seg_is_first
                tl.store(MID_O + slot[:, None] * HEAD_DIM + dims[None, :], out, mask=row_mask[:, None])
                tl.store(MID_LSE + slot, m_i + tl.log2(l_i), mask=row_mask)


@triton.jit
def _decode_merge_kernel(SEQ_STARTS, MID_O, MID_LSE, O, stride_ob, stride_oh, num_seqs, num_programs,
                         HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """Program (sequence, head): merge the pieces of a sequence that program boundaries cut; others return."""
    wait_for_previous(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    per_prog = tl.cdiv(tl.load(SEQ_STARTS + num_seqs), num_programs)
    start = tl.load(SEQ_STARTS + b)
    end = tl.load(SEQ_STARTS + b + 1)
    p0 = start // per_prog
    p1 = (end - 1) // per_prog
    if p1 > p0:
        dims = tl.arange(0, HEAD_DIM)
        # Piece k of the sequence lies in program p0 + k: in p0 it is the last piece (slot 1) unless the
        # sequence starts that program (slot 0); in every later program it is the first piece (slot 0).
        first_slot = tl.where(start == p0 * per_prog, 0, 1)
        m = tl.full((), float("-inf"), tl.float32)
        total = tl.zeros((), tl.float32)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for k0 in range(0, p1 - p0 + 1, CHUNK):
            k = k0 + tl.arange(0, CHUNK)
            valid = k <= p1 - p0
            slot = ((p0 + k) * num_heads + h).to(tl.int64) * 2 + tl.where(k == 0, first_slot, 0)
            lse = tl.load(MID_LSE + slot, mask=valid, other=float("-inf"))
            m_new = tl.maximum(m, tl.max(lse, axis=0))
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            parts = tl.load(MID_O + slot[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha + tl.sum(parts * w[:, None], axis=0)
            total = total * alpha + tl.sum(w, axis=0)
            m = m_new
        tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + dims, (acc / total).to(O.dtype.element_ty))


def decode_block_n(device: torch.device, head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> int:
    """Tokens per tile of the kernel's default config: what a ``DecodePlan`` for it must be cut in."""
    return default_config(device, head_dim, dtype, cache_dtype).block_n


def make_plan(context_lens: torch.Tensor, block_tables: torch.Tensor, block_n: int, page: int) -> DecodePlan:
    """A plan for ``context_lens`` and ``block_tables`` on their device, read back to the host (a sync: tests and
    one-off calls; the engine builds plans from its host-side arrays, ``plan_arrays``)."""
    tiles, starts = plan_arrays(context_lens.cpu().numpy(), block_tables.cpu().numpy(), block_n, page)
    dev = context_lens.device
    return DecodePlan(torch.from_numpy(tiles).to(dev), torch.from_numpy(starts).to(dev), block_n)


def paged_decode_attention_stream(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, *,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, plan: DecodePlan | None = None,
    programs: int | None = None, config=None,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, Hq, D]`` (the token at ``context_lens[b] - 1``) over its paged context, the
    step's tiles cut in equal shares over ``programs`` programs per KV head (default ``decode_programs``).

    ``plan`` lists the tiles (``plan_arrays`` on the host's lengths, cut in the config's ``block_n``); without
    one it is built here from ``context_lens``, which reads them back to the host. 8-bit caches need
    ``k_scale``/``v_scale`` ``[num_blocks, Hkv, block_size]``. Returns ``out`` (allocated if None).
    """
    fmt = check_paged_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables=block_tables,
                                context_lens=context_lens)
    quant = fmt is not None
    batch, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    cfg = config or default_config(q.device, head_dim, q.dtype, k_cache.dtype if quant else None)
    if plan is None:
        plan = make_plan(context_lens, block_tables, cfg.block_n, page)
    if plan.block_n != cfg.block_n or plan.tiles.shape[1] != 2 + pages_per_tile(cfg.block_n, page):
        raise ValueError(f"the plan was cut in tiles of {plan.block_n} tokens, the kernel's are {cfg.block_n}")
    if plan.seq_starts.shape != (batch + 1,):
        raise ValueError(f"plan.seq_starts must be [{batch + 1}], got {tuple(plan.seq_starts.shape)}")
    num_programs = programs or decode_programs(num_kv_heads, q.device)
    mid_o = torch.empty((num_programs, num_heads, 2, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((num_programs, num_heads, 2), dtype=torch.float32, device=q.device)
    upcast, prec = dot_mode(q.dtype)
    f16_dot = quant and q.dtype != torch.float32 and (cfg.f16_dot if cfg.f16_dot is not None else not fmt.is_int)
    if f16_dot:
        upcast, prec = dot_mode(torch.float16)
    f16_kind = fmt.f16_kind if f16_dot else -1
    pdl = use_pdl(q.device)
    _decode_stream_kernel[(num_programs, num_kv_heads)](
        q, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache,
        plan.tiles, plan.seq_starts, out, mid_o, mid_lse, scale * LOG2E, batch,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), REC=plan.tiles.shape[1],
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim, PAGE=page, BLOCK_N=cfg.block_n,
        DOT_PREC=prec, UPCAST=upcast, QUANT=quant, F16_DOT=f16_dot, F16_KIND=f16_kind,
        BIASED=f16_kind == F16_INT8_BIASED, PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **launch_options(pdl),
    )
    _decode_merge_kernel[(batch, num_heads)](
        plan.seq_starts, mid_o, mid_lse, out, out.stride(0), out.stride(1), batch, num_programs,
        HEAD_DIM=head_dim, CHUNK=16, PDL=pdl, num_warps=4, **launch_options(pdl),
    )
    return out
