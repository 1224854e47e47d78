"""The gated delta rule over a flat varlen step (Qwen3.5's linear attention), in Triton: a fused recurrent kernel
for decode steps and a chunked (UT-transform) pair of kernels for steps with prompt chunks.

**Decode** (``_recurrent_kernel``, grid: sequence × value head × Dv tile): the state tile [Dk, BV] is read from
the sequence's slot (zeros without a state), each token's q/k L2-normalised and q scaled in registers, then HF's
recurrent step (decay, read k's memory, write β times the error, read q's output), and the tile written back in
place. It walks every token of its sequence, so it is correct for any lengths; a step of decodes alone (T == B,
known from the shapes) takes it, with no host sync: CUDA-graph capturable.

**Prefill** (any step with a prompt chunk), chunk size 64 over the flat token array (not per sequence):
- ``_chunk_prepare_kernel`` (grid: 64-token block × value head, all blocks at once) solves each block's
  UT system. Rows of different sequences do not interact: the block's system is block-diagonal by sequence
  (so are its inverse and everything built on it), and the cumulative decay restarts at each sequence's first
  row. With A the strictly lower ``β_i k_i·k_j exp(c_i - c_j)`` (c the cumulative log decay), it writes
  ``U = (I + A)⁻¹ (β v)`` (the new values), ``W = (I + A)⁻¹ (β exp(c) k)`` (the keys that read the carried
  state) and c, float32, to a workspace. The inverse doubles block-diagonal inverses 1 → 2 → … → 64 with two
  products a level (``[[P, 0], [R, Q]]⁻¹ = [[P⁻¹, 0], [-Q⁻¹ R P⁻¹, Q⁻¹]]``): each product is of true inverse
  blocks, bounded as forward substitution's rows are, unlike a power series of A (whose terms grow with the
  keys' correlation).
- ``_chunk_scan_kernel`` (grid: sequence × value head × Dv tile) carries the state over its sequence's blocks:
  ``v' = U - W S``, ``o = (exp(c) q) S + (q kᵀ ∘ exp(c_i - c_j))_{j ≤ i} v'``,
  ``S ← exp(c_last) S + (exp(c_last - c) k)ᵀ v'``.
Splitting the blocks' solves (parallel over the whole step) from the scan (sequential per sequence) keeps the
sequential part to five small products a block. Mathematically HF's chunked form; the blocks start at other
tokens than HF's, so the two agree to float32 rounding, not bit for bit.

**Gates.** Both kernels read g and β where they need them, each once a token and head, so they can take the
layer's raw projections instead (``A_log`` / ``dt_bias`` given): HF's ``g = -exp(A_log)·softplus(a + dt_bias)`` and
``β = sigmoid(b)`` computed in registers (``_gate_values``), which saves the layer eight elementwise launches a step
(at batch 1 each costs about what the recurrent kernel does).

Products take float32 operands: ``input_precision`` "tf32x3" on the GPU (float32-level error on tensor cores),
"ieee" in the interpreter. Reference: ``gated_delta_ref.gated_delta_rule_ref`` (after ``gdn_gates_ref``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_dtype, interpreting, next_pow2
from .gated_delta_ref import L2NORM_EPS

CHUNK = 64


@triton.jit
def _load_qk(ptr, rows, rmask, stride_t, dk, DK: tl.constexpr, L2NORM: tl.constexpr, eps):
    """[rows, DK] float32 of q or k for ``rows``, L2-normalised over the head dimension when asked."""
    d = tl.arange(0, DK)
    x = tl.load(ptr + rows.to(tl.int64)[:, None] * stride_t + d[None, :], mask=rmask[:, None] & (d < dk)[None, :],
                other=0.0).to(tl.float32)
    if L2NORM:
        x = x * tl.rsqrt(tl.sum(x * x, 1) + eps)[:, None]
    return x


@triton.jit
def _gate_values(a, b, a_log, dt_bias, GATING: tl.constexpr):
    """float32 (g, β) from what the kernel loaded at G and BETA: g and β themselves, or (GATING) the projections a
    and b, gated as HF does: ``g = -exp(A_log) · softplus(a + dt_bias)`` in float32 (torch's softplus: x itself
    past 20, else log1p(exp(x)), its log1p to float32 accuracy as ``log(w) · u / (w - 1)``, w = 1 + u), and
    ``β = sigmoid(b)`` rounded to b's dtype."""
    if GATING:
        x = a.to(tl.float32) + dt_bias.to(tl.float32)
        u = tl.exp(tl.minimum(x, 20.0))
        w = 1.0 + u
        exact = w == 1.0  # u below half an ulp of one: log1p(u) = u
        softplus = tl.where(x > 20.0, x, tl.where(exact, u, tl.log(w) * (u / tl.where(exact, 1.0, w - 1.0))))
        g = -tl.exp(a_log.to(tl.float32)) * softplus
        beta = (1.0 / (1.0 + tl.exp(-b.to(tl.float32)))).to(b.dtype).to(tl.float32)
        return g, beta
    return a.to(tl.float32), b.to(tl.float32)


@triton.jit
def _recurrent_kernel(Q, K, V, G, BETA, STATE, O, QSL, SLOTS, HAS, ALOG, DTB,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                      stride_ot, stride_oh, stride_ss, stride_sh, dk, dv, scale, eps,
                      GROUP: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr, L2NORM: tl.constexpr,
                      GATING: tl.constexpr = False):
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    a_log = 0.0
    dt_bias = 0.0
    if GATING:
        a_log = tl.load(ALOG + h)
        dt_bias = tl.load(DTB + h)
    start = tl.load(QSL + b).to(tl.int64)  # 64-bit offsets: the loop counters inherit it
    end = tl.load(QSL + b + 1).to(tl.int64)
    d = tl.arange(0, DK)
    dmask = d < dk
    c = tl.program_id(2) * BV + tl.arange(0, BV)
    cmask = c < dv
    smask = dmask[:, None] & cmask[None, :]
    s_ptr = STATE + tl.load(SLOTS + b).to(tl.int64) * stride_ss + h * stride_sh + d[:, None] * dv + c[None, :]
    readable = dk * (tl.load(HAS + b) != 0).to(tl.int32)  # no state: nothing of the slot is read
    s = tl.load(s_ptr, mask=smask & (d < readable)[:, None], other=0.0)
    for t in range(start, end):
        q = tl.load(Q + t * stride_qt + hk * stride_qh + d, mask=dmask, other=0.0).to(tl.float32)
        k = tl.load(K + t * stride_kt + hk * stride_kh + d, mask=dmask, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, 0) + eps)
            k = k * tl.rsqrt(tl.sum(k * k, 0) + eps)
        q = q * scale
        v = tl.load(V + t * stride_vt + h * stride_vh + c, mask=cmask, other=0.0).to(tl.float32)
        g, beta = _gate_values(tl.load(G + t * stride_gt + h), tl.load(BETA + t * stride_bt + h), a_log, dt_bias,
                               GATING)
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], 0)
        tl.store(O + t * stride_ot + h * stride_oh + c, o.to(O.dtype.element_ty), mask=cmask)
    tl.store(s_ptr, s, mask=smask)


@triton.jit
def _chunk_prepare_kernel(K, V, G, BETA, QSL, U, W, CUM, ALOG, DTB, num_tokens, num_seqs, search_steps,
                          stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, dk, dv, eps,
                          GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr,
                          LEVELS: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
                          GATING: tl.constexpr = False):
    h = tl.program_id(1)
    hk = h // GROUP
    r = tl.arange(0, BT)
    rows = tl.program_id(0) * BT + r
    rmask = rows < num_tokens
    # Each row's sequence: the last b with query_start_loc[b] <= row (a vectorised binary search)
    lo = tl.zeros((BT,), dtype=tl.int32)
    hi = tl.zeros((BT,), dtype=tl.int32) + num_seqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        right = tl.load(QSL + mid) <= rows
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    same = lo[:, None] == lo[None, :]
    lower = (r[:, None] >= r[None, :]) & same
    strict = (r[:, None] > r[None, :]) & same

    a_log = 0.0
    dt_bias = 0.0
    if GATING:
        a_log = tl.load(ALOG + h)
        dt_bias = tl.load(DTB + h)
    g, beta = _gate_values(tl.load(G + rows.to(tl.int64) * stride_gt + h, mask=rmask, other=0.0),
                           tl.load(BETA + rows.to(tl.int64) * stride_bt + h, mask=rmask, other=0.0), a_log, dt_bias,
                           GATING)
    if GATING:  # rows past the step's tokens neither decay nor write (the gates of a zero projection would)
        g = tl.where(rmask, g, 0.0)
        beta = tl.where(rmask, beta, 0.0)
    cum = tl.sum(tl.where(lower, g[None, :], 0.0), 1)  # log decay from the sequence's first row in the block
    k = _load_qk(K + hk * stride_kh, rows, rmask, stride_kt, dk, DK, L2NORM, eps)
    kb = k * beta[:, None]
    a = tl.dot(kb, tl.trans(k), input_precision=PREC)
    a = tl.where(strict, a * tl.exp(tl.where(strict, cum[:, None] - cum[None, :], 0.0)), 0.0)

    # (I + A)⁻¹ by doubling: x holds the inverse of the block diagonal of size `size`; one level joins pairs
    x = tl.where(r[:, None] == r[None, :], 1.0, 0.0) - tl.where(((r // 2)[:, None] == (r // 2)[None, :]), a, 0.0)
    for level in tl.static_range(1, LEVELS):
        size = 1 << level
        pair, half = r // (2 * size), r // size
        cross = (pair[:, None] == pair[None, :]) & (half[:, None] != half[None, :])  # a pair's off-diagonal block
        x = x - tl.dot(tl.dot(x, tl.where(cross, a, 0.0), input_precision=PREC), x, input_precision=PREC)

    dcol = tl.arange(0, DV)
    v = tl.load(V + rows.to(tl.int64)[:, None] * stride_vt + h * stride_vh + dcol[None, :],
                mask=rmask[:, None] & (dcol < dv)[None, :], other=0.0).to(tl.float32)
    u = tl.dot(x, v * beta[:, None], input_precision=PREC)
    w = tl.dot(x, kb * tl.exp(cum)[:, None], input_precision=PREC)
    heads = tl.num_programs(1)
    base = rows.to(tl.int64) * heads + h
    tl.store(U + base[:, None] * dv + dcol[None, :], u, mask=rmask[:, None] & (dcol < dv)[None, :])
    dk_col = tl.arange(0, DK)
    tl.store(W + base[:, None] * dk + dk_col[None, :], w, mask=rmask[:, None] & (dk_col < dk)[None, :])
    tl.store(CUM + base, cum, mask=rmask)


@triton.jit
def _chunk_scan_kernel(Q, K, U, W, CUM, STATE, O, QSL, SLOTS, HAS,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_ss, stride_sh,
                       dk, dv, scale, eps,
                       GROUP: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                       L2NORM: tl.constexpr, PREC: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    hk = h // GROUP
    start = tl.load(QSL + b).to(tl.int64)  # 64-bit offsets: the loop counters inherit it
    end = tl.load(QSL + b + 1).to(tl.int64)
    d = tl.arange(0, DK)
    dmask = d < dk
    c = tl.program_id(2) * BV + tl.arange(0, BV)
    cmask = c < dv
    smask = dmask[:, None] & cmask[None, :]
    s_ptr = STATE + tl.load(SLOTS + b).to(tl.int64) * stride_ss + h * stride_sh + d[:, None] * dv + c[None, :]
    readable = dk * (tl.load(HAS + b) != 0).to(tl.int32)  # no state: nothing of the slot is read
    s = tl.load(s_ptr, mask=smask & (d < readable)[:, None], other=0.0)
    r = tl.arange(0, BT)

    for b0 in range((start // BT) * BT, end, BT):
        rows = b0 + r
        rmask = (rows >= start) & (rows < end)
        base = rows.to(tl.int64) * heads + h
        q = _load_qk(Q + hk * stride_qh, rows, rmask, stride_qt, dk, DK, L2NORM, eps) * scale
        k = _load_qk(K + hk * stride_kh, rows, rmask, stride_kt, dk, DK, L2NORM, eps)
        cum = tl.load(CUM + base, mask=rmask, other=0.0)
        cum_last = tl.load(CUM + (tl.minimum(end, b0 + BT) - 1).to(tl.int64) * heads + h)
        w = tl.load(W + base[:, None] * dk + d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0)
        u = tl.load(U + base[:, None] * dv + c[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)

        v_new = u - tl.dot(w, s, input_precision=PREC)
        causal = (r[:, None] >= r[None, :]) & rmask[:, None] & rmask[None, :]
        p = tl.dot(q, tl.trans(k), input_precision=PREC)
        p = tl.where(causal, p * tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
        o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision=PREC) + tl.dot(p, v_new, input_precision=PREC)
        tl.store(O + rows.to(tl.int64)[:, None] * stride_ot + h * stride_oh + c[None, :], o.to(O.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])
        k_last = k * tl.exp(tl.where(rmask, cum_last - cum, 0.0))[:, None]
        s = s * tl.exp(cum_last) + tl.dot(tl.trans(k_last), v_new, input_precision=PREC)
    tl.store(s_ptr, s, mask=smask)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           state: torch.Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_dtype(name, x)
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous head dimension, got strides {x.stride()}")
    if q.shape != k.shape or v.shape[1] % q.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)}: q and k must match and the "
                         "value heads be a multiple of the key heads")
    if g.shape != v.shape[:2] or beta.shape != v.shape[:2] or g.stride(1) != 1 or beta.stride(1) != 1:
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [T, Hv] with contiguous heads")
    if state.dtype != torch.float32 or not state.is_contiguous() or state.shape[1:] != (v.shape[1], q.shape[2],
                                                                                          v.shape[2]):
        raise ValueError(f"state must be a contiguous float32 [S, Hv, Dk, Dv], got {tuple(state.shape)} "
                         f"{state.dtype}")


def _value_tile(dv: int, programs: int) -> int:
    """Dv columns per program: 64, or 32 when fewer programs than a GPU's multiprocessors would run."""
    tile = 64 if programs * triton.cdiv(dv, 64) >= 128 else 32
    return min(tile, max(16, next_pow2(dv)))


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, query_start_loc: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor,
                     use_qk_l2norm: bool = True, scale: float | None = None,
                     out: torch.Tensor | None = None, *, A_log: torch.Tensor | None = None,
                     dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``gated_delta_rule_ref`` in Triton: o [T, Hv, Dv] in q's dtype, each sequence's final state written to its
    slot of ``state`` [S, Hv, Dk, Dv] (float32, contiguous). q, k [T, Hk, Dk] and v [T, Hv, Dv] may be strided
    views (contiguous head dimension); g [T, Hv] float32, beta [T, Hv]; ``query_start_loc`` int32 [B + 1],
    ``slots`` [B] (distinct), ``has_state`` bool [B]. With ``A_log`` and ``dt_bias`` ([Hv] each), ``g`` and
    ``beta`` are the layer's projections a and b ([T, Hv], strided rows), gated in the kernels as
    ``gdn_gates_ref`` gates them. A step of decodes alone (T == B) runs the recurrent kernel; any other the chunked
    pair, with a float32 workspace of ``T·Hv·(Dk + Dv + 1)`` values.
    """
    _check(q, k, v, g, beta, state)
    gating = A_log is not None
    if gating != (dt_bias is not None) or gating and (A_log.shape != (v.shape[1],) or dt_bias.shape != A_log.shape):
        raise ValueError(f"A_log and dt_bias come together, [Hv] = [{v.shape[1]}] each")
    gates = (A_log, dt_bias) if gating else (state, state)  # (never read without GATING)
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    b = slots.shape[0]
    scale = dk ** -0.5 if scale is None else scale
    if out is None:
        out = torch.empty(t, hv, dv, dtype=q.dtype, device=q.device)
    if b == 0 or t == 0:
        return out
    group, dk_pad = hv // hk, max(16, next_pow2(dk))
    prec = "ieee" if interpreting() else "tf32x3"
    if t == b:  # decodes only
        bv = _value_tile(dv, b * hv)
        _recurrent_kernel[(b, hv, triton.cdiv(dv, bv))](
            q, k, v, g, beta, state, out, query_start_loc, slots, has_state, *gates, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), out.stride(0),
            out.stride(1), state.stride(0), state.stride(1), dk, dv, scale, L2NORM_EPS, GROUP=group, DK=dk_pad, BV=bv,
            L2NORM=use_qk_l2norm, GATING=gating, num_warps=4)
        return out
    u = torch.empty(t, hv, dv, dtype=torch.float32, device=q.device)
    w = torch.empty(t, hv, dk, dtype=torch.float32, device=q.device)
    cum = torch.empty(t, hv, dtype=torch.float32, device=q.device)
    _chunk_prepare_kernel[(triton.cdiv(t, CHUNK), hv)](
        k, v, g, beta, query_start_loc, u, w, cum, *gates, t, b, b.bit_length(), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), g.stride(0), beta.stride(0), dk, dv, L2NORM_EPS, GROUP=group, DK=dk_pad,
        DV=max(16, next_pow2(dv)), BT=CHUNK, LEVELS=CHUNK.bit_length() - 1, L2NORM=use_qk_l2norm, PREC=prec,
        GATING=gating, num_warps=8)
    bv = _value_tile(dv, b * hv)
    _chunk_scan_kernel[(b, hv, triton.cdiv(dv, bv))](
        q, k, u, w, cum, state, out, query_start_loc, slots, has_state, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), out.stride(0), out.stride(1), state.stride(0), state.stride(1), dk, dv, scale, L2NORM_EPS,
        GROUP=group, DK=dk_pad, BV=bv, BT=CHUNK, L2NORM=use_qk_l2norm, PREC=prec, num_warps=4,
        num_stages=1)  # sm_90 at Dk 128: 160 KB of shared memory; Triton's default 3 stages would need 247 KB
    return out
