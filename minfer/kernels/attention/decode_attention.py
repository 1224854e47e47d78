"""Paged decode attention: one query token per sequence against its paged K/V context.

Decode attention is a pure bandwidth problem: every K/V byte of the context is read once and
used for a handful of FLOPs. Two choices follow from that:

* GQA grouping: one program serves all ``Hq / Hkv`` query heads that share a KV head, so each K/V
  tile is loaded once per group rather than once per query head. The group is padded to 16 rows
  so the score and value products run on ``tl.dot`` (tensor cores), keeping the arithmetic off
  the critical path.
* Split-K ("flash-decoding"): when ``B * Hkv`` programs cannot fill the GPU (small batch, long
  context), each sequence's context is cut into ``num_splits`` equal ranges processed in parallel;
  each writes a normalised partial output and its log-sum-exp, and a second small kernel merges
  them. The ranges are cut from each sequence's *own* length inside the kernel, so a short
  sequence in a batch with a long one is not left with empty splits, and the host never needs
  ``context_lens.max()`` (no device sync; safe under CUDA graph capture).

* Program order: the grid is (KV head, sequence, split) with the KV head fastest, so the hardware
  starts a sequence's programs together and the sequences in row order. The scheduler puts decodes
  longest context first, so the long programs start first and short ones fill the gaps at the end
  (H200, one layer over workload A's context mixes at 96-192 live sequences: 78-88% of bandwidth in
  arrival order, 88-93% longest first; ``benchmarks/bench_decode_splits.py --mixes``).

Softmax is online, in float32, in the log2 domain (``exp2`` with ``scale * log2(e)`` folded in).

8-bit caches (``quant.py``): K/V tiles are loaded as 8-bit codes and never dequantized into memory,
so the kernel moves half the bytes of a bf16 cache (plus 2 bytes of scale per token-head). The
per-token scales are applied where they cost ``BLOCK_N`` multiplies instead of ``BLOCK_N * D``: K's
scale multiplies the score column, V's scale the probability column before ``P @ V``. Half the bytes
per element means the per-element work must cost less than the load saved. With a 16-bit q:

* int8 Q·Kᵀ runs on the integer MMA: q is split into two int8 parts per row (``split_q_int8``, ~15
  bits of q), so K codes go to the tensor cores unconverted.
* fp8 Q·Kᵀ and every P·V run in float16, with codes converted exactly by inline PTX (``codes_to_f16``,
  which also explains why V's conversion must be opaque to Triton).
* Scales load one tile ahead; tiles are 128 tokens (``default_config``).

H200, B=64 x 4k, llama-3.1-8b heads: int8 193 us / fp8_e4m3 198 us against bf16's 258 us (1.34x / 1.30x).
A float32 q keeps float32 products (codes converted by casts), exact under the interpreter.

Sliding windows and logit soft-capping are compile-time constants (``WINDOW``, ``SOFTCAP_LOG2``; 0 = none, the
defaults): a model without them compiles the kernel it compiled before, argument list included, and one with them
one variant per (window, cap) pair its layers use (Gemma 2: two). A window's keys are ``[max(0, ctx - window), ctx)``:
the splits divide that range alone and the key loop starts there, so a block wholly before the window is never
looked up (a hybrid cache frees those, leaving stale or -1 table entries) and a long context costs O(window) (H200,
B=32 x 32k, window 4096: 143 us, as at 4k without a window; 967 us without). The cap is applied in the log2 domain,
with the cap scaled by log2(e): ``c * tanh(s / c)`` scales with s and c together; decode does not notice its cost.

Sinks (gpt-oss: a logit per head in the softmax's denominator, no value) are one more variant (``HAS_SINKS``; ``SINKS``
None without). Split 0 alone counts them, so the merge weighs each in once: its running max starts at the sink, whose
term joins the denominator at the end (at most 1: no overflow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._utils import interpreting, next_pow2, num_sms
from ..pdl import launch_options, use_pdl, wait_for_previous
from ..quant.quant import check_paged_attention, codes_to_f16, product_mode, q_to_f16, split_q_int8
from .attention_ref import paged_decode_attention_ref  # noqa: F401 (re-exported for this module's importers)

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the split kernel (tuned on an H200; see benchmarks/RESULTS.md)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    # Softmax denominators kept per (row, column) and summed once at the end, instead of a row sum per
    # tile: one cross-warp reduction (shared memory and barriers) fewer per tile, more registers.
    column_sums: bool = False


@triton.jit
def soft_cap(s, cap):
    """``cap * tanh(s / cap)`` in float32, tanh through exp2 as ``1 - 2 / (e^2x + 1)``: it saturates to +-1
    without overflow (e^2x = inf gives 1, 0 gives -1) and needs no libdevice call, so the interpreter runs it.
    The absolute error near 0 (cancellation in ``1 - ...``) is a few float32 ulps of ``cap``."""
    return cap - (2.0 * cap) / (tl.exp2(s * (2.8853900817779268 / cap)) + 1.0)  # 2 * log2(e)


# Ints that change from step to step are not specialised on (Triton would compile a variant for
# values of 1 and multiples of 16): the block-table width and the split count.
@triton.jit(do_not_specialize=["stride_btb", "num_splits"])
def _decode_split_kernel(
    Q, K, V, KS, VS, BT, CL, O, MID_O, MID_LSE, scale_log2e,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_btb, stride_ob, stride_oh,
    num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
    QUANT: tl.constexpr, F16: tl.constexpr, F16_KIND: tl.constexpr, Q8: tl.constexpr, ASM: tl.constexpr,
    COLUMN_SUMS: tl.constexpr, PDL: tl.constexpr = False, WINDOW: tl.constexpr = 0, SOFTCAP_LOG2: tl.constexpr = 0.0,
    SINKS=None, HAS_SINKS: tl.constexpr = False,
):
    wait_for_previous(PDL)
    kvh = tl.program_id(0)  # fastest: a sequence's heads start together, in the batch's order
    b = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CL + b)
    # Equal ranges of this sequence's own keys, rounded up to whole tiles. Every position from `lo` on is in
    # the window, so no key needs a window mask and no table entry before lo // PAGE is loaded.
    if WINDOW > 0:
        lo = tl.maximum(ctx - WINDOW, 0)
    else:
        lo = 0
    per_split = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx)

    rows = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if Q8:  # int8 K codes meet an int8 split of q on the integer MMA
        q_hi, q_lo, q_scale = split_q_int8(q.to(tl.float32))
        row_scale = q_scale * (scale_log2e / 256.0)
    elif F16:
        q = q_to_f16(q)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    if HAS_SINKS:  # log2-domain sinks; split 0's running max starts at its sink
        sink = tl.load(SINKS + heads, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, m_i)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    if COLUMN_SUMS:
        l_cols = tl.zeros([GROUP_PAD, BLOCK_N], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_btb
    kv_base = kvh.to(tl.int64) * stride_kh
    # Scales [num_blocks, Hkv, PAGE]: a page's scales of this head are one contiguous run. They are
    # loaded one tile ahead (Triton pipelines only the loads that feed the MMAs; waiting on these in
    # the tile that uses them cost 12% at B=64 x 4k).
    s_page = tl.num_programs(0) * PAGE
    if QUANT:
        offs = start + tl.arange(0, BLOCK_N)
        valid = offs < end
        first = tl.load(bt_row + offs // PAGE, mask=valid, other=0).to(tl.int64)
        k_scale_next = tl.load(KS + first * s_page + kvh * PAGE + offs % PAGE, mask=valid, other=0.0)
        v_scale_next = tl.load(VS + first * s_page + kvh * PAGE + offs % PAGE, mask=valid, other=0.0)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < end
        page = tl.load(bt_row + offs // PAGE, mask=valid, other=0).to(tl.int64)
        tok = kv_base + page * stride_kb + (offs % PAGE) * stride_kt
        k = tl.load(K + tok[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(V + tok[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        if QUANT:
            k_scale = k_scale_next.to(tl.float32)
            v_scale = v_scale_next.to(tl.float32)
            offs_next = offs + BLOCK_N
            valid_next = offs_next < end
            page_next = tl.load(bt_row + offs_next // PAGE, mask=valid_next, other=0).to(tl.int64)
            s_next = page_next * s_page + kvh * PAGE + offs_next % PAGE
            k_scale_next = tl.load(KS + s_next, mask=valid_next, other=0.0)
            v_scale_next = tl.load(VS + s_next, mask=valid_next, other=0.0)
            if Q8:
                kt = tl.trans(k)
                s = (tl.dot(q_hi, kt, out_dtype=tl.int32) * 256 + tl.dot(q_lo, kt, out_dtype=tl.int32)).to(tl.float32)
                s = s * row_scale[:, None] * k_scale[None, :]
            else:
                if F16:
                    k = codes_to_f16(k, F16_KIND, ASM, True)
                else:
                    k = k.to(q.dtype)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * (k_scale * scale_log2e)[None, :]
        else:
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2e
        if SOFTCAP_LOG2 > 0:  # s is log2(e) * scale * q.k here, so the cap comes scaled the same way
            s = soft_cap(s, SOFTCAP_LOG2)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        if COLUMN_SUMS:
            l_cols = l_cols * alpha[:, None] + p
        else:
            l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT:  # V's scale multiplies the probability column: BLOCK_N products instead of BLOCK_N * D
            if F16:
                v = codes_to_f16(v, F16_KIND, ASM, False)
            else:
                v = v.to(q.dtype)
            acc = tl.dot((p * v_scale[None, :]).to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
        m_i = m_new
    if COLUMN_SUMS:
        l_i = tl.sum(l_cols, axis=1)
    if HAS_SINKS:  # the sink's term, once (split 0): at most 1, as m_i >= sink
        l_i += tl.where(split == 0, tl.exp2(sink - m_i), 0.0)

    if DIRECT:
        out = acc / l_i[:, None]
        tl.store(O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 out.to(O.dtype.element_ty), mask=row_mask[:, None])
    else:
        # Partials: [B, Hq, num_splits, D] normalised outputs and [B, Hq, num_splits] log2-sum-exp2.
        # An empty split (start >= ctx) leaves l_i = 0 and writes lse = -inf, which the merge ignores.
        nonempty = l_i > 0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        idx = (b * (GROUP * tl.num_programs(0)) + heads).to(tl.int64) * num_splits + split
        tl.store(MID_O + idx[:, None] * HEAD_DIM + dims[None, :], out, mask=row_mask[:, None])
        tl.store(MID_LSE + idx, lse, mask=row_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    MID_O, MID_LSE, O, stride_ob, stride_oh, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b * num_heads + h).to(tl.int64) * num_splits
    dims = tl.arange(0, HEAD_DIM)
    # One online pass, CHUNK partials at a time: registers stay bounded for any split count, and
    # one compiled variant serves them all. Split 0 always holds a token, so m is finite after the
    # first chunk and later all-empty chunks add exp2(-inf) = 0.
    m = tl.full((), float("-inf"), tl.float32)
    total = tl.zeros((), tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, num_splits, CHUNK):
        idx = s0 + tl.arange(0, CHUNK)
        valid = idx < num_splits
        lse = tl.load(MID_LSE + base + idx, mask=valid, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        parts = tl.load(MID_O + (base + idx)[:, None] * HEAD_DIM + dims[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha + tl.sum(parts * w[:, None], axis=0)
        total = total * alpha + tl.sum(w, axis=0)
        m = m_new
    tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + dims, (acc / total).to(O.dtype.element_ty))


# Split heuristic (tuned on an H200, see benchmarks/RESULTS.md): at least ENOUGH_PER_SM programs per
# multiprocessor need no split; below that, split until about SPLIT_TARGET_PER_SM programs per SM exist.
# Measured at batch 1 x 32k, 8 KV heads: 32 or 64 splits ~52 us, 128 splits 59 us, 256 splits 68 us.
ENOUGH_PER_SM = 2
SPLIT_TARGET_PER_SM = 2
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 256


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device,
                      per_sm: int = SPLIT_TARGET_PER_SM) -> int:
    """Splits per sequence for ``batch * num_kv_heads`` (sequence, KV head) programs.

    With two or more programs per SM every SM streams K/V already and a split only adds the merge (batch 64 x 4k:
    1 split 256 us, 2 splits 266 us). Below that, split as far as the grid fits ``per_sm`` programs an SM (rounding
    down: a few programs past it run as a tail, and the Hopper kernel keeps its deeper ring only for at most one an
    SM), each split still streaming ~1k tokens so its fixed costs (q load, partial write, merge) stay small.
    No split gets under ``MIN_SPLIT_TOKENS`` of the widest context (``max_context``, from the
    block table width so the host never reads the lengths), where the merge would cost more.
    8-bit caches measured best with the same rule (1 split at B=64 x 4k; 32 at B=1 x 32k). ``per_sm``: the
    programs per SM to split toward (the Hopper kernel's deep TMA pipeline wants fewer, longer ones).
    """
    programs = batch * num_kv_heads
    sms = num_sms(device)
    if programs >= ENOUGH_PER_SM * sms:
        return 1
    by_occupancy = max(1, per_sm * sms // programs)
    by_length = max(1, max_context // MIN_SPLIT_TOKENS)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, Hq, D]`` (the token at ``context_lens[b] - 1``) over its paged context.

    8-bit caches (int8 / fp8) need their ``k_scale``/``v_scale`` ``[num_blocks, Hkv, block_size]``.
    ``window`` > 0: only the last ``window`` keys (HF's ``sliding_window``); table entries of blocks wholly
    before them are never read. ``softcap`` > 0: scores become ``softcap * tanh(score / softcap)``. ``sinks``
    ``[Hq]``: each head's logit joins the softmax's denominator (uncapped), with no value.

    ``num_splits`` overrides the split-K heuristic (tests, tuning); by default it is derived from
    the batch, the KV heads, the widest possible context (``block_tables.shape[1] * block_size``,
    known on the host) and the multiprocessor count. Returns ``out`` (allocated if None) in q's dtype.
    """
    fmt = check_paged_attention(q, k_cache, v_cache, k_scale, v_scale, block_tables=block_tables,
                                context_lens=context_lens)
    check_window_softcap(window, softcap, sinks, q)
    quant = fmt is not None
    batch, num_heads, head_dim = q.shape
    page, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if batch == 0:
        return out
    cfg = config or default_config(q.device, head_dim, q.dtype, k_cache.dtype if quant else None)
    if num_splits is None:
        width = block_tables.shape[1] * page
        num_splits = choose_num_splits(batch, num_kv_heads, min(window, width) if window else width, q.device)
    mid_o, mid_lse = split_partials(q, out, num_splits)
    direct = num_splits == 1
    # 8-bit caches with a 16-bit q: P·V (and fp8's Q·Kᵀ) in float16, int8's Q·Kᵀ on the integer MMA.
    k_cache, v_cache, upcast, prec, f16, asm = product_mode(q, k_cache, v_cache, fmt)
    pdl = use_pdl(q.device)
    _decode_split_kernel[(num_kv_heads, batch, num_splits)](
        q, k_cache, v_cache, k_scale if quant else k_cache, v_scale if quant else v_cache, block_tables,
        context_lens, out, mid_o, mid_lse, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), num_splits,
        GROUP=group, GROUP_PAD=max(16, next_pow2(group)), HEAD_DIM=head_dim, PAGE=page,
        BLOCK_N=cfg.block_n, DIRECT=direct, DOT_PREC=prec, UPCAST=upcast, QUANT=quant, F16=f16,
        F16_KIND=fmt.f16_kind if f16 else -1, Q8=f16 and fmt.is_int, ASM=asm, COLUMN_SUMS=cfg.column_sums,
        PDL=pdl, WINDOW=int(window), SOFTCAP_LOG2=float(softcap) * LOG2E, SINKS=sinks, HAS_SINKS=sinks is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl),
    )
    if not direct:
        merge_partials(mid_o, mid_lse, out)
    return out


def check_window_softcap(window: int, softcap: float, sinks: torch.Tensor | None = None,
                         q: torch.Tensor | None = None) -> None:
    """A window: a key count (0: none); a cap: a positive bound (0: none); sinks: a float per head of ``q`` (None:
    none). Anything else is a caller's bug."""
    if int(window) != window or window < 0:
        raise ValueError(f"window must be an int >= 0 (0: no window), got {window!r}")
    if not 0 <= softcap < float("inf"):
        raise ValueError(f"softcap must be a finite float >= 0 (0: no cap), got {softcap!r}")
    if sinks is not None and (sinks.shape != q.shape[1:2] or sinks.stride(0) != 1 or sinks.device != q.device
                              or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be [{q.shape[1]}] floats on {q.device}, got {list(sinks.shape)} {sinks.dtype}")


def split_partials(q: torch.Tensor, out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split kernels' partial outputs ``[B, Hq, num_splits, D]`` and log2-sum-exp2 ``[B, Hq, num_splits]``
    (float32), after checking ``num_splits``; with one split the kernel writes ``out`` directly (both are ``out``,
    unused)."""
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    if num_splits == 1:
        return out, out
    batch, num_heads, head_dim = q.shape
    return (torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device),
            torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device))


def merge_partials(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Merge the splits' partials (``split_partials``) into ``out`` ``[B, Hq, D]``."""
    batch, num_heads, num_splits, head_dim = mid_o.shape
    pdl = use_pdl(out.device)
    _decode_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, out.stride(0), out.stride(1), num_heads, num_splits,
        HEAD_DIM=head_dim, CHUNK=16, PDL=pdl, num_warps=4, **launch_options(pdl),
    )


def default_config(device: torch.device, head_dim: int, dtype: torch.dtype,
                   cache_dtype: torch.dtype | None = None) -> DecodeConfig:
    """Tile and pipeline depth per device (GPU values from the H200 sweeps in bench_kernels.py and
    bench_decode_splits.py).

    Head dim 256 and float32 halve the tile so K/V stages stay in shared memory without spills.
    8-bit caches with a 16-bit q (``cache_dtype``, head dim <= 128) take 128-token tiles with column
    sums: half the bytes per token, so twice the tokens per tile keep as many bytes in flight, and the
    per-tile barriers are paid half as often (B=64 x 4k int8: 193 us against 205 with (64, 4, 2);
    B=1 x 32k, 33 splits: int8 47 against 56 us, fp8_e4m3 41 against 58).
    """
    if device.type != "cuda" or interpreting():
        return DecodeConfig(block_n=32, num_warps=4, num_stages=1)
    if head_dim > 128:
        return DecodeConfig(block_n=32, num_warps=8 if dtype == torch.float32 else 4, num_stages=2)
    if cache_dtype is not None and dtype != torch.float32:
        return DecodeConfig(block_n=128, num_warps=4, num_stages=2, column_sums=True)
    return DecodeConfig(block_n=64, num_warps=4, num_stages=3 if dtype != torch.float32 else 2)

