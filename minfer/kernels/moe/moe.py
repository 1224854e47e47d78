"""Fused mixture-of-experts: route each token to its top-k experts and sum their SwiGLU MLPs, weighted.

``fused_moe(x, router_logits, w_gate_up, w_down, top_k, renormalize)`` is one memset and four kernels (three
at top-k 1), with no host sync and every grid sized from shapes alone, so a CUDA graph captures it:

1. ``_moe_route_kernel``, one program per token: softmax of the logits in float32, the top-k by k rounds
   of argmax (largest first; an exact tie goes to the lower expert index), renormalisation, the weights
   rounded to their dtype (gpt-oss, ``TOPK_SOFTMAX``: the top k of the logits, then a softmax over those k);
   ``moe_common.route_row``, which the decode kernels share.
   Pick j is the token's slot j, as ``torch.topk`` orders them. Each pick takes its rank within its expert
   from one ``atomic_add`` on that expert's counter and stores its row (``token * top_k + slot``) at
   ``expert_rows[expert, rank]``: the grouping by expert happens here. A kernel rather than torch ops because
   torch would need about six launches (softmax, topk, sum, div, a sort and a histogram for the grouping),
   each a few microseconds at batch 1, against one.
2. ``_moe_gate_up_kernel``, the grouped GEMM for gate/up: program (m-block, n-tile) finds its expert from
   the counters (the m-blocks are each expert's ``ceil(count / BLOCK_M)`` blocks laid end to end: a
   cumulative sum over E counters, in registers), gathers its block's x rows through ``expert_rows``,
   multiplies them by the expert's gate and up rows (two dots sharing the A tile) and stores
   ``silu(gate) * up`` from the epilogue, rounded as HF rounds (``activation.py``), at the rows' own
   positions of ``inter [T*top_k, I]``. gpt-oss adds each expert's bias there and its clamped SwiGLU
   (``LIMIT`` > 0), every op rounded as HF's ``_apply_gate``.
3. ``_moe_down_kernel``, the grouped GEMM for down, same blocks: ``inter`` rows times the expert's down
   matrix, rounded to x's dtype (plus the bias, rounded), times the routing weight, stored at the row's
   position of ``contrib [T*top_k, H]`` (in x's dtype, or float32 for float32 weights: HF's type promotion).
   At top-k 1 it writes the output itself.
4. ``_moe_sum_kernel``: each token's top_k rows summed in float32 in slot order and rounded once, as
   HF's ``view(T, top_k, H).sum(1)``. No atomics in the sum: the summation order is the reference's and the
   output deterministic (within an expert the atomic ranks order rows arbitrarily, but a row's products do
   not depend on its place in a tile, and every row lands at its own (token, slot) position).

This is vLLM's ``moe_align_block_size`` + ``fused_moe`` with the alignment folded into the routing: each
expert's row list has capacity T (a token picks an expert at most once) and its padding to BLOCK_M is
implicit, so no sorted, padded copy is built. The padded rows number at most ``T*top_k + min(E, T*top_k) *
(BLOCK_M - 1)`` (only experts with rows are padded); the grids take that bound, and blocks past the real
total exit at once. An expert no token chose has no blocks: at batch 1 only the top_k chosen experts'
weights are read (qwen3-30b-a3b: 8 of 128), which is what bounds a decode step. Built for many tokens an
expert, though: at a few tokens its 16-row tiles are mostly padding and its programs few, and the matrix-vector
kernels of ``moe_decode.py`` take those steps (``moe_args.use_moe_decode``).

MXFP4 experts (gpt-oss's checkpoints) stay packed: both GEMMs read the codes and scales and expand them to x's
dtype in registers before each dot (``moe_mxfp4.py``), half a byte a weight instead of two. The variants (routing,
bias, SwiGLU, weight format) are compile-time constants: the plain path compiles as it did without them.

Launch configs come from a small table by mean rows per expert (``MOE_CONFIGS``), not autotuning.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._utils import dot_mode, next_pow2
from .moe_args import MOE_CONFIGS, MoeConfig, check_moe_args, max_blocks, moe_config  # noqa: F401 (re-exported)
from .moe_common import down_epilogue, route_row, swiglu_epilogue
from .moe_mxfp4 import mxfp4_mainloop


class MoeRouting(NamedTuple):
    """The routing kernel's outputs. ``topk_ids``/``topk_weights`` ``[T, top_k]``: each token's experts,
    largest probability first, with their weights (in the weights dtype); ``expert_counts [E]`` int32: rows per
    expert; ``expert_rows [E, T]`` int32: expert e's rows (``token * top_k + slot``) in its first
    ``expert_counts[e]`` entries, in no particular order (the rest is unwritten)."""

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    expert_counts: torch.Tensor
    expert_rows: torch.Tensor


# ------------------------------------------------------------------------------------------------ triton
@triton.jit
def _moe_route_kernel(L, IDS, WTS, COUNTS, ROWS, E, T, stride_l, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                      E_PAD: tl.constexpr, TOPK_SOFTMAX: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    logits = tl.load(L + t.to(tl.int64) * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    slot, w = route_row(logits, e, E, TOP_K, RENORM, TOPK_SOFTMAX)
    sel = slot >= 0
    row = t * TOP_K + slot
    tl.store(IDS + row, e, mask=sel)
    tl.store(WTS + row, w, mask=sel)  # rounded to the weights dtype here, as HF rounds them
    rank = tl.atomic_add(COUNTS + e, 1, mask=sel)
    tl.store(ROWS + e.to(tl.int64) * T + rank, row, mask=sel)


@triton.jit
def _expert_block(COUNTS, pid_m, E, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """(expert, its first rank in this block, rows left from there) of m-block ``pid_m``; expert >= E past
    the last block. Each expert owns ``ceil(count / BLOCK_M)`` consecutive blocks, in expert order."""
    e = tl.arange(0, E_PAD)
    count = tl.load(COUNTS + e, mask=e < E, other=0)
    blocks = (count + BLOCK_M - 1) // BLOCK_M
    end = tl.cumsum(blocks, axis=0)
    expert = tl.sum((end <= pid_m).to(tl.int32), axis=0)
    first_block = tl.sum(tl.where(e < expert, blocks, 0), axis=0)
    rank0 = (pid_m - first_block) * BLOCK_M
    rows_left = tl.sum(tl.where(e == expert, count, 0), axis=0) - rank0
    return expert, rank0, rows_left


@triton.jit
def _tile_ids(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(m-block, n-tile) of program ``pid``: GROUP_M m-blocks walk the n-tiles together (fp8_gemm.py's order)."""
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % width) % group_rows, (pid % width) // group_rows


@triton.jit
def _moe_gate_up_kernel(X, W, S, B, OUT, COUNTS, ROWS, E, T, H, I, num_pid_m, stride_x, stride_we, stride_wn,
                        stride_se, stride_sn, stride_be, stride_o, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, E_PAD: tl.constexpr,
                        EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr, MXFP4: tl.constexpr,
                        HAS_BIAS: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """OUT[row, c] = act(x[token] · W[e, c] (+ B[e, c]), x[token] · W[e, I + c] (+ B[e, I + c])) for the rows of
    each expert block: SwiGLU, or gpt-oss's clamped one when LIMIT > 0."""
    HALF: tl.constexpr = BLOCK_N // 2
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(I, HALF), GROUP_M)
    expert, rank0, rows_left = _expert_block(COUNTS, pid_m, E, BLOCK_M, E_PAD)
    if expert >= E:
        return
    rm = tl.arange(0, BLOCK_M)
    valid = rm < rows_left
    # Rows past the expert's count read row 0 (a valid address; their results are not stored).
    rows = tl.load(ROWS + expert.to(tl.int64) * T + rank0 + rm, mask=valid, other=0)
    tokens = rows // TOP_K
    cols = pid_n * HALF + tl.arange(0, HALF)
    wcols = (cols % I).to(tl.int64)  # columns past I wrap around (valid addresses, not stored)
    w_base = W + expert.to(tl.int64) * stride_we
    acc_g = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    dtype = OUT.dtype.element_ty
    if MXFP4:  # the codes expanded in registers (moe_mxfp4.py)
        s_base = S + expert.to(tl.int64) * stride_se
        acc_g, acc_u = mxfp4_mainloop(acc_g, acc_u, X + tokens.to(tl.int64) * stride_x, w_base + wcols * stride_wn,
                                      s_base + wcols * stride_sn, w_base + (wcols + I) * stride_wn,
                                      s_base + (wcols + I) * stride_sn, H, BLOCK_K, True, EVEN_K, dtype, UPCAST,
                                      PRECISION)
    else:
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = X + tokens.to(tl.int64)[:, None] * stride_x + rk[None, :]
        g_ptrs = w_base + wcols[None, :] * stride_wn + rk[:, None]  # [BLOCK_K, HALF], K-major: wgmma's B
        u_ptrs = w_base + (wcols + I)[None, :] * stride_wn + rk[:, None]
        for k0 in range(0, H, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                bg = tl.load(g_ptrs)
                bu = tl.load(u_ptrs)
            else:
                k_left = H - k0
                a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
                bg = tl.load(g_ptrs, mask=rk[:, None] < k_left, other=0.0)
                bu = tl.load(u_ptrs, mask=rk[:, None] < k_left, other=0.0)
            if UPCAST:
                a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
            acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
    bias_g = 0.0
    bias_u = 0.0
    if HAS_BIAS:
        b_base = B + expert.to(tl.int64) * stride_be
        bias_g = tl.load(b_base + wcols).to(tl.float32)[None, :]
        bias_u = tl.load(b_base + wcols + I).to(tl.float32)[None, :]
    h = swiglu_epilogue(acc_g, acc_u, bias_g, bias_u, dtype, HAS_BIAS, LIMIT, ALPHA)  # HF's roundings
    o_ptrs = OUT + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(o_ptrs, h, mask=valid[:, None] & (cols < I)[None, :])


@triton.jit
def _moe_down_kernel(A, W, S, B, WTS, OUT, COUNTS, ROWS, E, T, H, I, num_pid_m, stride_a, stride_we, stride_wn,
                     stride_se, stride_sn, stride_be, stride_o, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, E_PAD: tl.constexpr, EVEN_K: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr, MXFP4: tl.constexpr, HAS_BIAS: tl.constexpr):
    """OUT[row, n] = weight[row] * (A[row] · W[e, n] (+ B[e, n])) for the rows of each expert block."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_pid_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    expert, rank0, rows_left = _expert_block(COUNTS, pid_m, E, BLOCK_M, E_PAD)
    if expert >= E:
        return
    rm = tl.arange(0, BLOCK_M)
    valid = rm < rows_left
    rows = tl.load(ROWS + expert.to(tl.int64) * T + rank0 + rm, mask=valid, other=0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wcols = (cols % H).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if MXFP4:
        w_cols = W + expert.to(tl.int64) * stride_we + wcols * stride_wn
        s_cols = S + expert.to(tl.int64) * stride_se + wcols * stride_sn
        acc, _ = mxfp4_mainloop(acc, acc, A + rows.to(tl.int64) * stride_a, w_cols, s_cols, w_cols, s_cols, I, BLOCK_K,
                                False, EVEN_K, A.dtype.element_ty, UPCAST, PRECISION)
    else:
        rk = tl.arange(0, BLOCK_K)
        a_ptrs = A + rows.to(tl.int64)[:, None] * stride_a + rk[None, :]
        b_ptrs = W + expert.to(tl.int64) * stride_we + wcols[None, :] * stride_wn + rk[:, None]
        for k0 in range(0, I, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_left = I - k0
                a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
                b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
    # HF's roundings, the weighted row rounded to OUT's dtype (x's, or float32 for float32 weights: torch's type
    # promotion of ``proj_out * weight``)
    bias = 0.0
    if HAS_BIAS:
        bias = tl.load(B + expert.to(tl.int64) * stride_be + wcols).to(tl.float32)[None, :]
    y = down_epilogue(acc, bias, tl.load(WTS + rows).to(tl.float32)[:, None], A.dtype.element_ty, HAS_BIAS)
    o_ptrs = OUT + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(o_ptrs, y.to(OUT.dtype.element_ty), mask=valid[:, None] & (cols < H)[None, :])


@triton.jit
def _moe_sum_kernel(C, OUT, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """OUT[t] = C[t, 0] + C[t, 1] + ... in slot order (largest weight first), in float32, rounded once."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.load(C + t * TOP_K * H + cols, mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(1, TOP_K):
        acc += tl.load(C + (t * TOP_K + k) * H + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + t * H + cols, acc.to(OUT.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------------ launchers
def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype | None = None,
              topk_softmax: bool = False) -> MoeRouting:
    """Route ``router_logits [T, E]``: each token's top_k experts (ties to the lower index) and their weights, by
    a float32 softmax over the experts then the top k (renormalised to sum to one when ``renormalize``), or with
    ``topk_softmax`` (gpt-oss) the top k of the logits then a softmax over those k (``renormalize`` changes
    nothing there); rounded to ``weights_dtype`` (default ``router_logits.dtype``); and the per-expert row lists
    the grouped GEMMs read (see :class:`MoeRouting`). One memset and one kernel; nothing is read back to the host."""
    t, e = router_logits.shape
    dev = router_logits.device
    ids = torch.empty(t, top_k, dtype=torch.int32, device=dev)
    wts = torch.empty(t, top_k, dtype=weights_dtype or router_logits.dtype, device=dev)
    counts = torch.zeros(e, dtype=torch.int32, device=dev)
    rows = torch.empty(e, t, dtype=torch.int32, device=dev)
    if t:
        e_pad = next_pow2(e)
        _moe_route_kernel[(t,)](router_logits, ids, wts, counts, rows, e, t, router_logits.stride(0), TOP_K=top_k,
                                RENORM=renormalize, E_PAD=e_pad, TOPK_SOFTMAX=topk_softmax,
                                num_warps=4 if e_pad > 256 else 1)
    return MoeRouting(ids, wts, counts, rows)


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
              renormalize: bool, config: MoeConfig | None = None, *, weights_dtype: torch.dtype | None = None,
              topk_softmax: bool = False, bias_gate_up: torch.Tensor | None = None,
              bias_down: torch.Tensor | None = None, scale_gate_up: torch.Tensor | None = None,
              scale_down: torch.Tensor | None = None, swiglu_limit: float = 0.0,
              swiglu_alpha: float = 1.0) -> torch.Tensor:
    """A sparse MoE block after its router -> ``[T, H]`` in x's dtype: ``sum_k weight_k * down_e(act(gate_e(x),
    up_e(x)))`` over each token's top_k experts e.

    ``x [T, H]`` float32/bfloat16/float16, ``router_logits [T, E]`` (any float dtype, softmax in float32),
    ``w_gate_up [E, 2I, H]`` (gate rows, then up rows) and ``w_down [E, H, I]`` in x's dtype, all contiguous; or
    MXFP4 (``scale_gate_up`` / ``scale_down`` given): uint8 codes ``[E, 2I, H // 2]`` / ``[E, H, I // 2]`` and e8m0
    scales ``[E, 2I, H // 32]`` / ``[E, H, I // 32]``, expanded to x's dtype in registers (``moe_mxfp4.py``).
    Optional biases ``bias_gate_up [E, 2I]`` / ``bias_down [E, H]``. ``act``: ``silu(gate) * up``, or with
    ``swiglu_limit`` > 0 gpt-oss's clamped SwiGLU (``moe_ref.swiglu_ref``). Routing as HF's routers
    (:func:`moe_route`; ``topk_softmax``: gpt-oss's), weights rounded to ``weights_dtype``: by default
    ``router_logits.dtype``, Qwen3-MoE's and gpt-oss's rule; Mixtral keeps them float32 (pass ``torch.float32``).
    An exact tie at the k-th place goes to the lower expert index (``torch.topk`` promises no order there). Every
    intermediate is rounded where a loaded HF model's block rounds it (:func:`fused_moe_ref`), and each token's
    weighted rows are summed in float32 in slot order, so only the order of the dot products' sums differs.

    Only the experts some token chose are read: at batch 1, top_k experts' weights. No host sync, grids
    from shapes only (CUDA-graph capturable). ``config`` overrides the ``MOE_CONFIGS`` table (sweeps, tests).
    """
    t, h, e, i = check_moe_args(x, router_logits, w_gate_up, w_down, top_k, scale_gate_up, scale_down,
                                 bias_gate_up, bias_down)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    cfg = config or moe_config(t, top_k, e)
    mxfp4 = scale_gate_up is not None
    if cfg.block_n % 32 or cfg.block_m < 16 or cfg.block_k < (32 if mxfp4 else 16) or (mxfp4 and cfg.block_k % 32):
        raise ValueError(f"block_n must be a multiple of 32, block_m at least 16 and block_k at least 16 (MXFP4: a "
                         f"multiple of 32), got {cfg}")
    routing = moe_route(router_logits, top_k, renormalize, weights_dtype, topk_softmax)
    upcast, precision = dot_mode(x.dtype)
    e_pad = next_pow2(e)
    num_pid_m = max_blocks(t, top_k, e, cfg.block_m)
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, E_PAD=e_pad,
                  UPCAST=upcast, PRECISION=precision, MXFP4=mxfp4, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages if x.element_size() < 4 else min(cfg.num_stages, 2))
    # (float32 tiles take twice the shared memory: the largest tile's 3 stages need 288 KiB, past sm_90's 227)
    # Absent scales and biases: x stands in for the pointer, never read (the variant reads none).
    s_gu, s_d = (scale_gate_up, scale_down) if mxfp4 else (x, x)
    b_gu = x if bias_gate_up is None else bias_gate_up
    b_d = x if bias_down is None else bias_down
    inter = torch.empty(t * top_k, i, dtype=x.dtype, device=x.device)
    grid = (num_pid_m * triton.cdiv(i, cfg.block_n // 2),)
    _moe_gate_up_kernel[grid](x, w_gate_up, s_gu, b_gu, inter, routing.expert_counts, routing.expert_rows, e, t, h, i,
                              num_pid_m, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), s_gu.stride(0),
                              s_gu.stride(1), b_gu.stride(0), inter.stride(0), TOP_K=top_k,
                              EVEN_K=h % cfg.block_k == 0, HAS_BIAS=bias_gate_up is not None,
                              LIMIT=float(swiglu_limit), ALPHA=float(swiglu_alpha), **common)
    # Each (token, slot)'s weighted output, in HF's product dtype; with one slot, the output itself (the same
    # single rounding).
    contrib_dtype = torch.promote_types(x.dtype, routing.topk_weights.dtype)
    contrib = out if top_k == 1 else torch.empty(t * top_k, h, dtype=contrib_dtype, device=x.device)
    grid = (num_pid_m * triton.cdiv(h, cfg.block_n),)
    _moe_down_kernel[grid](inter, w_down, s_d, b_d, routing.topk_weights, contrib, routing.expert_counts,
                           routing.expert_rows, e, t, h, i, num_pid_m, inter.stride(0), w_down.stride(0),
                           w_down.stride(1), s_d.stride(0), s_d.stride(1), b_d.stride(0), contrib.stride(0),
                           EVEN_K=i % cfg.block_k == 0, HAS_BIAS=bias_down is not None, **common)
    if top_k > 1:
        block = min(1024, next_pow2(h))
        _moe_sum_kernel[(t, triton.cdiv(h, block))](contrib, out, h, TOP_K=top_k, BLOCK=block, num_warps=4)
    return out
