"""Mixture of experts for a few tokens (decode steps): two matrix-vector kernels, no routing pass, no sum pass.

At one to eight tokens (float experts: one, ``moe_args.use_moe_decode``) each chosen expert multiplies one or two
rows, so the layer is a weight stream: gpt-oss-20b at T=1 reads 4 experts' MXFP4 codes (53 MB, 12.6 µs at the
H200's bandwidth). The grouped GEMMs of ``moe.py`` spend such a step on 16-row tiles holding one real row, few
programs and long K loops. Here every program streams a few weight rows whole, with a float32 partial sum per lane
reduced once at the end (``gemm/gemv.py``'s shape):

1. ``_moe_decode_gate_up_kernel``, grid (T * top_k pairs, I / BLOCK_N): program (pair, n) routes its token
   itself from the router logits row (``moe_common.route_row``: E values, top-k, the softmax; the same code as
   the grouped path's routing kernel), takes slot ``pair % top_k``'s expert, and streams BLOCK_N of its gate rows
   and the same BLOCK_N up rows (one ``[2, BLOCK_N, BLOCK_K]`` tile a K step) against the token's x; the SwiGLU
   (or gpt-oss's biased, clamped one) runs in the epilogue and the row of ``inter [T * top_k, I]`` is stored.
2. ``_moe_decode_down_kernel``, grid (T, H / BLOCK_N): program (token, n) routes the token again, and streams
   BLOCK_N down rows of all its top_k experts, each expert's rows against its own ``inter`` row: at once (one
   ``[top_k, BLOCK_N, BLOCK_K]`` tile a step: MXFP4) or one expert after another (``[BLOCK_N, BLOCK_K]`` tiles:
   float experts, ``MoeDecodeConfig.expert_loop``; at top 8 the one tile ran at a seventh of the bandwidth); the
   epilogue rounds each expert's projection, adds its bias, weights it, and sums the experts in slot order in
   float32: the output row, rounded once. No atomics and no partial rows in memory: the sum is in registers, in
   the reference's order.

Routing twice, and in every program, costs E logits a program (L2-resident) and top_k max-reductions, against a
launch and a round trip through memory for a routing pass. The pair index is the fastest grid dimension, so the
pairs of one row tile run side by side: when two tokens chose one expert, the second read of its rows is an L2
hit, and HBM sees each chosen expert once, as with the grouped GEMMs.

Coalescing: the experts are stored ``[E, 2I, H]`` and ``[E, H, I]`` (MXFP4: ``[E, 2I, H // 2]`` bytes with
``[E, 2I, H // 32]`` scales), each output row contiguous along K, the reduction dimension; a program's tile is
rows x K-chunk, each row a contiguous run of ``BLOCK_K`` values (MXFP4: ``BLOCK_K // 2`` bytes, 16-byte loads),
so the stored layout is the matrix-vector layout and no repacked copy is needed.

MXFP4: a K step holds ``BLOCK_K // 32`` scale groups as a ``[..., G, 16]`` byte tile, so each group's scale
broadcasts along the last axis; both nibbles of a byte expand in registers (``moe_mxfp4.e2m1_pair``, exact) and
meet x's even and odd values. x is read as words of two values (an int32 view of 16-bit x, int64 of float32),
split exactly by bit operations: byte j of a row and word j of x hold the same two K positions, so one offset
tensor addresses both. Float weights (bfloat16, float16, float32) stream as they are.

Everything but the grid is a compile-time constant or a shape; the grids come from T and the shapes: no host sync,
CUDA-graph capturable. Both kernels launch under PDL (``pdl.py``) and wait first: the rows they stream depend on the
routing, so nothing loads before the wait, but each one's launch overlaps the kernel before it (at one token the
chain is the router's matrix-vector launch, gate/up, down, the next layer's qkv: ``ops/one_token.py``).
Roundings are the grouped path's (``moe_common``), so both match ``moe_ref.fused_moe_ref``
up to the order of each dot product's float32 sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import next_pow2
from ..pdl import launch_options, use_pdl, wait_for_previous
from .moe_args import MoeDecodeConfig, check_moe_args, decode_block_k, moe_decode_config
from .moe_common import down_epilogue, route_row, swiglu_epilogue
from .moe_mxfp4 import e2m1_pair, e8m0_factor

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
              torch.float64: tl.float64}


# ------------------------------------------------------------------------------------------------ triton
@triton.jit
def _route(L, t, stride_l, E, TOP_K: tl.constexpr, RENORM: tl.constexpr, TOPK_SOFTMAX: tl.constexpr,
           E_PAD: tl.constexpr):
    """Token t's routing: (lanes, slot, weight) over E_PAD lanes (``moe_common.route_row``)."""
    e = tl.arange(0, E_PAD)
    logits = tl.load(L + t.to(tl.int64) * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    slot, w = route_row(logits, e, E, TOP_K, RENORM, TOPK_SOFTMAX)
    return e, slot, w


@triton.jit
def _unpack_pairs(words, X_DTYPE: tl.constexpr):
    """Words of two consecutive x values (int32 for 16-bit x, int64 for float32; the first value in the low half)
    -> (even, odd) values as float32, exactly."""
    if X_DTYPE == tl.float32:
        even = words.to(tl.int32).to(tl.float32, bitcast=True)
        odd = (words >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    elif X_DTYPE == tl.bfloat16:  # a bfloat16 is the high half of its float32
        even = (words << 16).to(tl.float32, bitcast=True)
        odd = (words & -65536).to(tl.float32, bitcast=True)
    else:
        even = words.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        odd = (words >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return even, odd


@triton.jit
def _load_x(x_rows, off, mask, MASKED: tl.constexpr):
    """x at offsets ``off`` (``[BK]``, or ``[G, 16]``) of each row set's x row, shaped to broadcast against the
    weight tile ``[R, BN, ...]``: ``x_rows`` is one pointer (every row set reads the same x) or ``[R]``. Loaded at
    its own rank and expanded after, so that the load takes the weight tile's layout (sliced) rather than one of
    its own that the products would then be converted to."""
    if len(x_rows.shape) == 0:
        ptrs = x_rows + off
    elif len(off.shape) == 1:
        ptrs = x_rows[:, None] + off[None, :]
    else:
        ptrs = x_rows[:, None, None] + off[None, :, :]
    if MASKED:
        x = tl.load(ptrs, mask=mask, other=0)
    else:
        x = tl.load(ptrs)
    if len(x_rows.shape) == 0:
        x = x[None, None]
    else:
        x = x[:, None]
    return x


@triton.jit
def _float_step(acc, w_rows, x_rows, k0, K, rmask, MASK_K: tl.constexpr, MASK_ROWS: tl.constexpr):
    """``acc [R, BN, BK] +=`` the rows' values ``k0 .. k0 + BK`` times x's, in float32; masked past K (and on
    masked row sets)."""
    BK: tl.constexpr = acc.shape[2]
    rk = k0 + tl.arange(0, BK)
    if MASK_K or MASK_ROWS:
        w = tl.load(w_rows[:, :, None] + rk[None, None, :], mask=(rk < K)[None, None, :] & rmask[:, :, None],
                    other=0.0)
    else:
        w = tl.load(w_rows[:, :, None] + rk[None, None, :])
    x = _load_x(x_rows, rk, rk < K, MASK_K)
    return acc + w.to(tl.float32) * x.to(tl.float32)


@triton.jit
def _mxfp4_step(acc, w_rows, s_rows, x_rows, k0, K, rmask, MASK_K: tl.constexpr, MASK_ROWS: tl.constexpr,
                X_DTYPE: tl.constexpr, ROUND_W: tl.constexpr):
    """``acc [R, BN, G, 16] +=`` G scale groups from K index k0: byte j of group g holds values 32g + 2j (low
    nibble) and 32g + 2j + 1 (high), which x's pair word at the same offset holds too. Each weight is exact in
    float32 (rounded to x's dtype first when ROUND_W: float16, as the reference dequantizes)."""
    G: tl.constexpr = acc.shape[2]
    grp = k0 // 32 + tl.arange(0, G)
    off = grp[:, None] * 16 + tl.arange(0, 16)[None, :]
    gmask = grp * 32 < K
    if MASK_K or MASK_ROWS:
        wmask = gmask[None, None, :] & rmask[:, :, None]
        b = tl.load(w_rows[:, :, None, None] + off[None, None], mask=wmask[:, :, :, None], other=0)
        s = tl.load(s_rows[:, :, None] + grp[None, None, :], mask=wmask, other=0)
    else:
        b = tl.load(w_rows[:, :, None, None] + off[None, None])
        s = tl.load(s_rows[:, :, None] + grp[None, None, :])
    xw = _load_x(x_rows, off, gmask[:, None], MASK_K)
    lo, hi = e2m1_pair(b)
    factor = e8m0_factor(s)[:, :, :, None]
    w_even = lo * factor
    w_odd = hi * factor
    if ROUND_W:
        w_even = w_even.to(X_DTYPE).to(tl.float32)
        w_odd = w_odd.to(X_DTYPE).to(tl.float32)
    x_even, x_odd = _unpack_pairs(xw, X_DTYPE)
    return acc + w_even * x_even + w_odd * x_odd


@triton.jit
def _rows_dot(w_rows, s_rows, x_rows, K, rmask, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr,
              MASK_ROWS: tl.constexpr, X_DTYPE: tl.constexpr, ROUND_W: tl.constexpr, STAGES: tl.constexpr):
    """``[R, BN]`` float32: each weight row (``w_rows``: pointers to row starts; MXFP4: bytes, and ``s_rows`` to
    their scales) dotted with its set's x row (``x_rows``: one pointer for all, or one per set) over K. Whole steps
    unmasked, pipelined ``STAGES`` deep (``gemm/gemv_config.STREAM_STAGES``), then one masked step for a tail."""
    R: tl.constexpr = w_rows.shape[0]
    BN: tl.constexpr = w_rows.shape[1]
    k_main = K - K % BLOCK_K
    if MXFP4:
        acc = tl.zeros([R, BN, BLOCK_K // 32, 16], tl.float32)
        for k0 in tl.range(0, k_main, BLOCK_K, num_stages=STAGES):
            acc = _mxfp4_step(acc, w_rows, s_rows, x_rows, k0, K, rmask, False, MASK_ROWS, X_DTYPE, ROUND_W)
        if k_main < K:
            acc = _mxfp4_step(acc, w_rows, s_rows, x_rows, k_main, K, rmask, True, MASK_ROWS, X_DTYPE, ROUND_W)
        return tl.sum(tl.sum(acc, axis=3), axis=2)
    acc = tl.zeros([R, BN, BLOCK_K], tl.float32)
    for k0 in tl.range(0, k_main, BLOCK_K, num_stages=STAGES):
        acc = _float_step(acc, w_rows, x_rows, k0, K, rmask, False, MASK_ROWS)
    if k_main < K:
        acc = _float_step(acc, w_rows, x_rows, k_main, K, rmask, True, MASK_ROWS)
    return tl.sum(acc, axis=2)


@triton.jit
def _moe_decode_gate_up_kernel(X, XW, L, W, S, B, OUT, E, H, I, stride_x, stride_xw, stride_l, stride_we, stride_wn,
                               stride_se, stride_sn, stride_be, stride_o, TOP_K: tl.constexpr, RENORM: tl.constexpr,
                               TOPK_SOFTMAX: tl.constexpr, E_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, MXFP4: tl.constexpr, ROUND_W: tl.constexpr,
                               HAS_BIAS: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
                               PDL: tl.constexpr = False, STAGES: tl.constexpr = 1):
    """OUT[pair, c] = act(x[t] · W[e, c] (+ B[e, c]), x[t] · W[e, I + c] (+ B[e, I + c])) for pair = t * TOP_K + j,
    e the token's j-th expert."""
    wait_for_previous(PDL)  # which rows to stream depends on the router's logits: nothing to load before
    pair = tl.program_id(0)
    t = pair // TOP_K
    e, slot, _ = _route(L, t, stride_l, E, TOP_K, RENORM, TOPK_SOFTMAX, E_PAD)
    expert = tl.sum(tl.where(slot == pair % TOP_K, e, 0), axis=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    wcols = cols % I  # columns past I wrap around (valid addresses, not stored)
    part = tl.arange(0, 2)[:, None]  # row set 0: the gate rows, 1: the up rows
    rows = (wcols[None, :] + part * I).to(tl.int64)
    w_rows = W + expert * stride_we + rows * stride_wn
    s_rows = S + expert * stride_se + rows * stride_sn
    if MXFP4:
        x_row = XW + t.to(tl.int64) * stride_xw
    else:
        x_row = X + t.to(tl.int64) * stride_x
    acc = _rows_dot(w_rows, s_rows, x_row, H, part >= 0, BLOCK_K, MXFP4, False, X.dtype.element_ty, ROUND_W,
                    STAGES)
    acc_g = tl.sum(tl.where(part == 0, acc, 0.0), axis=0)
    acc_u = tl.sum(tl.where(part == 1, acc, 0.0), axis=0)
    bias_g = 0.0
    bias_u = 0.0
    if HAS_BIAS:
        bias_g = tl.load(B + expert * stride_be + wcols).to(tl.float32)
        bias_u = tl.load(B + expert * stride_be + I + wcols).to(tl.float32)
    h = swiglu_epilogue(acc_g, acc_u, bias_g, bias_u, OUT.dtype.element_ty, HAS_BIAS, LIMIT, ALPHA)
    tl.store(OUT + pair.to(tl.int64) * stride_o + cols, h, mask=cols < I)


@triton.jit
def _moe_decode_down_kernel(A, AW, L, W, S, B, OUT, E, H, I, stride_a, stride_aw, stride_l, stride_we, stride_wn,
                            stride_se, stride_sn, stride_be, stride_o, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr,
                            RENORM: tl.constexpr, TOPK_SOFTMAX: tl.constexpr, E_PAD: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MXFP4: tl.constexpr, ROUND_W: tl.constexpr,
                            HAS_BIAS: tl.constexpr, W_DTYPE: tl.constexpr, C_DTYPE: tl.constexpr,
                            EXPERT_LOOP: tl.constexpr, PDL: tl.constexpr = False, STAGES: tl.constexpr = 1):
    """OUT[t, n] = sum over slots j, in order, of weight_j * (A[t * TOP_K + j] · W[e_j, n] (+ B[e_j, n])).

    EXPERT_LOOP: the slots one after another, each a ``[BLOCK_N, BLOCK_K]`` tile of one expert's rows against one
    ``inter`` row (the gate/up kernel's shape); otherwise all slots at once in one ``[TOP_K_PAD, BLOCK_N, BLOCK_K]``
    tile. Both add the slots' products in slot order."""
    wait_for_previous(PDL)
    t = tl.program_id(0)
    e, slot, w = _route(L, t, stride_l, E, TOP_K, RENORM, TOPK_SOFTMAX, E_PAD)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    wcols = (cols % H).to(tl.int64)
    out = tl.zeros([BLOCK_N], tl.float32)
    if EXPERT_LOOP:
        for j in tl.static_range(TOP_K):
            expert = tl.sum(tl.where(slot == j, e, 0), axis=0).to(tl.int64)
            weight = tl.sum(tl.where(slot == j, w, 0.0), axis=0).to(W_DTYPE).to(tl.float32)  # HF rounds it here
            w_rows = W + expert * stride_we + wcols[None, :] * stride_wn
            s_rows = S + expert * stride_se + wcols[None, :] * stride_sn
            a_row = (t * TOP_K + j).to(tl.int64)
            if MXFP4:
                x_row = AW + a_row * stride_aw
            else:
                x_row = A + a_row * stride_a
            acc = _rows_dot(w_rows, s_rows, x_row, I, wcols[None, :] >= 0, BLOCK_K, MXFP4, False, A.dtype.element_ty,
                            ROUND_W, STAGES)
            bias = 0.0
            if HAS_BIAS:
                bias = tl.load(B + expert * stride_be + wcols[None, :]).to(tl.float32)
            y = down_epilogue(acc, bias, weight, A.dtype.element_ty, HAS_BIAS).to(C_DTYPE).to(tl.float32)
            out += tl.sum(y, axis=0)
    else:
        jj = tl.arange(0, TOP_K_PAD)
        hit = slot[None, :] == jj[:, None]  # [TOP_K_PAD, E_PAD]: slot j's expert lane
        experts = tl.sum(tl.where(hit, e[None, :], 0), axis=1).to(tl.int64)  # padding slots: 0, never read
        weights = tl.sum(tl.where(hit, w[None, :], 0.0), axis=1).to(W_DTYPE).to(tl.float32)
        w_rows = W + experts[:, None] * stride_we + wcols[None, :] * stride_wn
        s_rows = S + experts[:, None] * stride_se + wcols[None, :] * stride_sn
        a_rows = (t * TOP_K + tl.minimum(jj, TOP_K - 1)).to(tl.int64)
        if MXFP4:
            x_rows = AW + a_rows * stride_aw
        else:
            x_rows = A + a_rows * stride_a
        real = (jj < TOP_K)[:, None]
        acc = _rows_dot(w_rows, s_rows, x_rows, I, real, BLOCK_K, MXFP4, TOP_K_PAD != TOP_K, A.dtype.element_ty,
                        ROUND_W, STAGES)
        bias = 0.0
        if HAS_BIAS:
            bias = tl.load(B + experts[:, None] * stride_be + wcols[None, :], mask=real, other=0.0).to(tl.float32)
        y = down_epilogue(acc, bias, weights[:, None], A.dtype.element_ty, HAS_BIAS).to(C_DTYPE).to(tl.float32)
        for j in tl.static_range(TOP_K):  # slot order, as the reference's sum over a token's rows
            out += tl.sum(tl.where(jj[:, None] == j, y, 0.0), axis=0)
    tl.store(OUT + t.to(tl.int64) * stride_o + cols, out.to(OUT.dtype.element_ty), mask=cols < H)


# ------------------------------------------------------------------------------------------------ launcher
def _pair_words(x: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` -> ``[T, K // 2]`` words of two values (int32 for 16-bit x, int64 for float32), a view of x when
    its offset allows (a copy otherwise)."""
    word = torch.int32 if x.element_size() == 2 else torch.int64
    try:
        return x.view(word)
    except RuntimeError:  # a view starting at an odd element
        return x.clone().view(word)


def fused_moe_decode(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                     top_k: int, renormalize: bool, config: MoeDecodeConfig | None = None, *,
                     weights_dtype: torch.dtype | None = None, topk_softmax: bool = False,
                     bias_gate_up: torch.Tensor | None = None, bias_down: torch.Tensor | None = None,
                     scale_gate_up: torch.Tensor | None = None, scale_down: torch.Tensor | None = None,
                     swiglu_limit: float = 0.0, swiglu_alpha: float = 1.0) -> torch.Tensor:
    """``moe.fused_moe`` for a few tokens (the arguments and the result are the same; see there), as two
    matrix-vector kernels (the module docstring). Any T runs, but each (token, expert) pair streams its own weight
    rows: the op takes this path up to ``moe_args.DECODE_MAX_TOKENS``. ``config`` overrides
    ``moe_decode_config``'s (sweeps, tests)."""
    t, h, e, i = check_moe_args(x, router_logits, w_gate_up, w_down, top_k, scale_gate_up, scale_down,
                                 bias_gate_up, bias_down)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    mxfp4 = scale_gate_up is not None
    cfg = config or moe_decode_config(0.5 if mxfp4 else x.element_size(), h, i, x.device)
    wdt = weights_dtype or router_logits.dtype
    inter = torch.empty(t * top_k, i, dtype=x.dtype, device=x.device)
    # Absent scales and biases: another tensor stands in for the pointer, never read (the variant reads none).
    s_gu, s_d = (scale_gate_up, scale_down) if mxfp4 else (w_gate_up, w_down)
    b_gu = x if bias_gate_up is None else bias_gate_up
    b_d = x if bias_down is None else bias_down
    xw, aw = (_pair_words(x), _pair_words(inter)) if mxfp4 else (x, inter)
    pdl = use_pdl(x.device)
    common = dict(RENORM=renormalize, TOPK_SOFTMAX=topk_softmax, E_PAD=next_pow2(e), MXFP4=mxfp4,
                  ROUND_W=mxfp4 and x.dtype == torch.float16, PDL=pdl, STAGES=cfg.num_stages,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl))
    bn = cfg.block_n_gate_up
    _moe_decode_gate_up_kernel[(t * top_k, triton.cdiv(i, bn))](
        x, xw, router_logits, w_gate_up, s_gu, b_gu, inter, e, h, i, x.stride(0), xw.stride(0),
        router_logits.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), s_gu.stride(0), s_gu.stride(1),
        b_gu.stride(0), inter.stride(0), TOP_K=top_k, BLOCK_N=bn, BLOCK_K=decode_block_k(h, 2 * bn, cfg.tile, mxfp4),
        HAS_BIAS=bias_gate_up is not None, LIMIT=float(swiglu_limit), ALPHA=float(swiglu_alpha), **common)
    bn, top_k_pad = cfg.block_n_down, next_pow2(top_k)
    _moe_decode_down_kernel[(t, triton.cdiv(h, bn))](
        inter, aw, router_logits, w_down, s_d, b_d, out, e, h, i, inter.stride(0), aw.stride(0),
        router_logits.stride(0), w_down.stride(0), w_down.stride(1), s_d.stride(0), s_d.stride(1), b_d.stride(0),
        out.stride(0), TOP_K=top_k, TOP_K_PAD=top_k_pad, BLOCK_N=bn,
        BLOCK_K=decode_block_k(i, bn if cfg.expert_loop else top_k_pad * bn, cfg.tile, mxfp4),
        HAS_BIAS=bias_down is not None, W_DTYPE=_TL_DTYPES[wdt], C_DTYPE=_TL_DTYPES[torch.promote_types(x.dtype, wdt)],
        EXPERT_LOOP=cfg.expert_loop, **common)
    return out
