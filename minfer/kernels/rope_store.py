"""Per-head q/k RMSNorm (Qwen3), rotary embedding and the KV-cache store in one launch.

Between the qkv projection and attention sit up to four small steps: q norm, k norm, rotary,
store. Each reads and writes rows a few KB long, so as separate kernels each would cost mostly its
launch and ramp-up (1.5-3 us on an H200), 4 x 28 of them in a Qwen3-0.6B decode step. Here
program ``(t, 0)`` normalises and rotates token t's q heads in place (attention reads q through
the same strided view), and program ``(t, 1)`` normalises and rotates its k heads and
writes k and v into the paged cache, quantizing them for 8-bit caches. ``rope_q`` launches only the
q programs (``STORE=False``): a layer that attends over another layer's cache (Gemma 4's shared-KV
layers) finishes its q and writes nothing.

Rotation pairs dimension d with d ± R/2, R the table's width: the head dimension, or fewer for a partial
rotary (Qwen3.5's first quarter, pairs within it; the other dims pass unrotated, as a cos of 1 and a sin of 0).
Rather than split the head into halves, each program loads the whole head twice, once in order and once
partner-permuted (the second load hits L1), so the rotated rows come out as full ``[heads, D]`` tiles and the
store's quantizer (a per-row absmax) applies unchanged. Rounding is that of the separate steps: the norm rounds
as HF's RMSNorm does (``rmsnorm.py``), rotary computes in float32 and rounds once (``apply_rotary_ref``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_dtype, check_last_dim_contiguous, interpreting, next_pow2
from .kv_store import check_store_args, store_kv_ref, store_token_rows
from .pdl import launch_options, use_pdl, wait_for_previous
from .quant.quant import store_constexprs
from .rmsnorm import rms_norm_ref


@triton.jit
def _norm_rope(X, stride_h, W, cos, sin, eps, NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
               HEAD_DIM: tl.constexpr, NORM: tl.constexpr, ROT_DIM: tl.constexpr):
    """Rows of heads at ``X`` (``[BLOCK_H, HEAD_DIM]``, masked to ``NUM_HEADS``), optionally RMS-normed
    with weight ``W`` (``NORM``: 0 none, 1 Llama's rounding, 2 a float32 weight's), then their first ``ROT_DIM``
    dims rotated: returns them in X's dtype, and the mask."""
    HALF: tl.constexpr = ROT_DIM // 2
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    if ROT_DIM == HEAD_DIM:
        partner = (dims + HALF) % HEAD_DIM
    else:  # a dim past the rotated ones is its own partner (its cos is 1, its sin 0)
        partner = tl.where(dims < ROT_DIM, (dims + HALF) % ROT_DIM, dims)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    rows = X + heads[:, None] * stride_h
    x = tl.load(rows + dims[None, :], mask=mask, other=0.0)
    xp = tl.load(rows + partner[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    if NORM:
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.load(W + dims).to(tl.float32)[None, :]
        wp = tl.load(W + partner).to(tl.float32)[None, :]
        if NORM == 2:  # a float32 weight (Gemma's): one rounding, after the weight, as rmsnorm.py's norm_row
            x = (w * (xf * rstd)).to(dtype)
            xp = (wp * (xp.to(tl.float32) * rstd)).to(dtype)
        else:  # Llama's: the normed row rounded before the weight multiplies it
            x = (w * (xf * rstd).to(dtype).to(tl.float32)).to(dtype)
            xp = (wp * (xp.to(tl.float32) * rstd).to(dtype).to(tl.float32)).to(dtype)
    # first half: x1 cos - x2 sin; second half: x2 cos + x1 sin
    signed_sin = tl.where(dims < HALF, -sin, sin)[None, :]
    out = x.to(tl.float32) * cos[None, :] + xp.to(tl.float32) * signed_sin
    return out.to(dtype), mask


@triton.jit
def _rope_store_kernel(
    Q, K, V, POS, CACHE, QW, KW, KC, VC, KS, VS, SLOTS, eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_c,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, NORM: tl.constexpr, ROT_DIM: tl.constexpr,
    QUANT: tl.constexpr, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr, MAX_SCALE: tl.constexpr,
    IS_INT: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, S_MANT: tl.constexpr, S_EMIN: tl.constexpr,
    EXACT: tl.constexpr, STORE: tl.constexpr = True, PDL: tl.constexpr = False,
):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = ROT_DIM // 2
    dims = tl.arange(0, HEAD_DIM)
    pos = tl.load(POS + t)
    if ROT_DIM == HEAD_DIM:
        cos = tl.load(CACHE + pos * stride_c + dims % HALF)
        sin = tl.load(CACHE + pos * stride_c + HALF + dims % HALF)
    else:
        cos = tl.load(CACHE + pos * stride_c + dims % HALF, mask=dims < ROT_DIM, other=1.0)
        sin = tl.load(CACHE + pos * stride_c + HALF + dims % HALF, mask=dims < ROT_DIM, other=0.0)
    if tl.program_id(1) == 0:
        q, mask = _norm_rope(Q + t * stride_qt, stride_qh, QW, cos, sin, eps, NUM_Q_HEADS, BLOCK_HQ, HEAD_DIM, NORM,
                             ROT_DIM)
        heads = tl.arange(0, BLOCK_HQ)
        tl.store(Q + t * stride_qt + heads[:, None] * stride_qh + dims[None, :], q, mask=mask)
    elif STORE:
        slot = tl.load(SLOTS + t)
        if slot >= 0:  # padding rows carry slot -1
            k, mask = _norm_rope(K + t * stride_kt, stride_kh, KW, cos, sin, eps, NUM_KV_HEADS, BLOCK_HK,
                                 HEAD_DIM, NORM, ROT_DIM)
            heads = tl.arange(0, BLOCK_HK)
            v = tl.load(V + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
            row = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
            store_token_rows(k, v, KC, VC, KS, VS, slot, heads, row, mask, heads < NUM_KV_HEADS, NUM_KV_HEADS, PAGE,
                             QUANT, QMAX, MIN_SCALE, MAX_SCALE, IS_INT, MANT, EMIN, S_MANT, S_EMIN, EXACT)


def rope_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    """Rotate ``q`` ``[T, Hq, D]`` in place and store rotated ``k`` and ``v`` ``[T, Hkv, D]`` at
    ``slot_mapping`` (int64, < 0 skips), after per-head RMSNorms when the norm weights are given. A
    ``cos_sin_cache`` narrower than the head (``[max_pos, R]``) rotates only the first R dims of each head.

    The same as ``rms_norm`` on q and k (Qwen3), ``apply_rotary_ref`` and ``store_kv`` in sequence,
    except that ``k`` itself is left as it was (only its cache rows are written). q, k, v may be
    strided views of the fused qkv output; only their last dimension must be contiguous.
    """
    fmt = check_store_args(k_cache, v_cache, k_scale, v_scale, q=q, k=k, v=v)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    _check_rotary(head_dim, cos_sin_cache)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight come together (Qwen3) or not at all")
    if num_tokens == 0:
        return
    norm = _norm_code(q_norm_weight)
    quant = store_constexprs(fmt, None if k_scale is None else k_scale.dtype, interpreting())
    block_hq = next_pow2(num_q_heads)
    pdl = use_pdl(q.device)
    _rope_store_kernel[(num_tokens, 2)](
        q, k, v, positions, cos_sin_cache, q_norm_weight if norm else q, k_norm_weight if norm else k,
        k_cache, v_cache, k_cache if k_scale is None else k_scale, v_cache if v_scale is None else v_scale,
        slot_mapping, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, BLOCK_HQ=block_hq, BLOCK_HK=next_pow2(num_kv_heads),
        HEAD_DIM=head_dim, PAGE=k_cache.shape[1], NORM=norm, ROT_DIM=cos_sin_cache.shape[-1], **quant, PDL=pdl,
        num_warps=min(8, max(1, block_hq * head_dim // 1024)), **launch_options(pdl),
    )


def rope_q(q: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
           q_norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> None:
    """Rotate ``q`` ``[T, Hq, D]`` in place, after its per-head RMSNorm when ``q_norm_weight`` is given:
    :func:`rope_store_kv`'s q programs alone (the same arithmetic), no cache touched."""
    check_dtype("q", q)
    check_last_dim_contiguous("q", q)
    num_tokens, num_q_heads, head_dim = q.shape
    _check_rotary(head_dim, cos_sin_cache)
    if num_tokens == 0:
        return
    norm = _norm_code(q_norm_weight)
    block_hq = next_pow2(num_q_heads)
    pdl = use_pdl(q.device)
    # the k/v arguments are never read (STORE=False): q and positions stand in for them
    _rope_store_kernel[(num_tokens, 1)](
        q, q, q, positions, cos_sin_cache, q_norm_weight if norm else q, q, q, q, q, q, positions, eps,
        q.stride(0), q.stride(1), q.stride(0), q.stride(1), q.stride(0), q.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=1, BLOCK_HQ=block_hq, BLOCK_HK=1, HEAD_DIM=head_dim, PAGE=1,
        NORM=norm, ROT_DIM=cos_sin_cache.shape[-1], **store_constexprs(None, None, False), STORE=False, PDL=pdl,
        num_warps=min(8, max(1, block_hq * head_dim // 1024)), **launch_options(pdl),
    )


def _check_rotary(head_dim: int, cos_sin_cache: torch.Tensor) -> None:
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 2, got {head_dim}")
    width = cos_sin_cache.shape[-1]
    if cos_sin_cache.dtype != torch.float32 or width % 2 or not 2 <= width <= head_dim:
        raise ValueError(f"cos_sin_cache must be float32 [max_pos, R], R even and at most {head_dim}, got "
                         f"{cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}")


def _norm_code(weight: torch.Tensor | None) -> int:
    """The kernels' NORM code: no q/k norm, Llama's rounding, or a float32 weight's (Gemma's ``1 + w``)."""
    return 0 if weight is None else 2 if weight.dtype == torch.float32 else 1


def rope_store_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, q_norm_weight: torch.Tensor | None = None,
                      k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> None:
    """Torch reference of :func:`rope_store_kv`: the separate references in sequence."""
    if q_norm_weight is not None:
        q.copy_(rms_norm_ref(q, q_norm_weight, eps))
        k = rms_norm_ref(k, k_norm_weight, eps)
    else:
        k = k.clone()
    apply_rotary_ref(q, k, positions, cos_sin_cache)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def apply_rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` in place by ``positions``, non-interleaved
    ("rotate half"), from a float32 ``cos_sin_cache`` ``[max_pos, R]`` of ``[cos | sin]`` (R = D, or fewer: the
    first R dims rotate, pairing within them): float32 math (float64 for float64 inputs) with one rounding, the
    kernel's arithmetic."""
    width = cos_sin_cache.shape[-1]
    half = width // 2
    cs = cos_sin_cache[positions]
    for x in (q, k):
        cos = cs[:, None, :half].to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        sin = cs[:, None, half:].to(cos.dtype)
        xf = x[..., :width].to(cos.dtype)
        x1, x2 = xf[..., :half], xf[..., half:]
        x[..., :width] = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
