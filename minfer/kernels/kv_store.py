"""Write new K/V rows into the paged KV cache, quantizing them on the way for 8-bit caches.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous, so a slot
(``block * block_size + offset``) addresses one row of ``num_kv_heads * head_dim`` elements. The
engine pads the flat token list; padded rows carry a negative slot and must not be written.

8-bit caches (int8, fp8 e4m3/e5m2; see ``quant.py``) also take ``k_scale``/``v_scale``
``[num_blocks, num_kv_heads, block_size]``: the kernel already holds each (token, head) row in
registers, so its absmax, the scale and the codes cost no extra pass over memory, and the cache
is written once, in 8 bits, with no full-precision copy anywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_dtype, check_last_dim_contiguous, interpreting, next_pow2
from .quant.kv_quant import write_kv_rows
from .quant.quant import KVQuantFormat, check_cache_scales, row_scales, scaled_codes, store_constexprs


@triton.jit
def _quantize_store(x, C, S, row, s_idx, mask, h_mask,
                    QMAX: tl.constexpr, MIN_SCALE: tl.constexpr, MAX_SCALE: tl.constexpr, IS_INT: tl.constexpr,
                    MANT: tl.constexpr, EMIN: tl.constexpr, S_MANT: tl.constexpr, S_EMIN: tl.constexpr,
                    EXACT: tl.constexpr):
    """Quantize rows ``x`` into codes at ``C + row`` and scales at ``S + s_idx`` (float downcasts
    round to nearest even, Triton's default; int conversion truncates)."""
    scale = row_scales(x, QMAX, MIN_SCALE, MAX_SCALE, S_MANT, S_EMIN, EXACT).to(S.dtype.element_ty)
    tl.store(S + s_idx, scale, mask=h_mask)
    y = scaled_codes(x, scale.to(tl.float32), QMAX, IS_INT, MANT, EMIN, EXACT)
    tl.store(C + row, y.to(C.dtype.element_ty), mask=mask)


@triton.jit
def store_token_rows(k, v, KC, VC, KS, VS, slot, heads, row, mask, h_mask, NUM_HEADS: tl.constexpr,
                     PAGE: tl.constexpr, QUANT: tl.constexpr, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                     MAX_SCALE: tl.constexpr, IS_INT: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
                     S_MANT: tl.constexpr, S_EMIN: tl.constexpr, EXACT: tl.constexpr):
    """Write one token's K and V rows ``[heads, D]`` at ``row`` of the caches; 8-bit caches get codes and,
    at ``KS``/``VS``, a scale per head."""
    if QUANT:
        # Scales are [num_blocks, NUM_HEADS, PAGE]: this token's scale of head h sits at h * PAGE + offset.
        s_idx = (slot // PAGE).to(tl.int64) * (NUM_HEADS * PAGE) + heads * PAGE + slot % PAGE
        _quantize_store(k, KC, KS, row, s_idx, mask, h_mask, QMAX, MIN_SCALE, MAX_SCALE, IS_INT, MANT, EMIN,
                        S_MANT, S_EMIN, EXACT)
        _quantize_store(v, VC, VS, row, s_idx, mask, h_mask, QMAX, MIN_SCALE, MAX_SCALE, IS_INT, MANT, EMIN,
                        S_MANT, S_EMIN, EXACT)
    else:
        tl.store(KC + row, k.to(KC.dtype.element_ty), mask=mask)
        tl.store(VC + row, v.to(VC.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_kernel(
    K, V, KC, VC, KS, VS, SLOTS,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr,
    QUANT: tl.constexpr, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr, MAX_SCALE: tl.constexpr,
    IS_INT: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, S_MANT: tl.constexpr, S_EMIN: tl.constexpr,
    EXACT: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t)
    if slot < 0:  # padding row
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    h_mask = heads < NUM_HEADS
    mask = h_mask[:, None] & (dims[None, :] < HEAD_DIM)
    row = slot.to(tl.int64) * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    k = tl.load(K + t.to(tl.int64) * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(V + t.to(tl.int64) * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    store_token_rows(k, v, KC, VC, KS, VS, slot, heads, row, mask, h_mask, NUM_HEADS, PAGE, QUANT, QMAX, MIN_SCALE,
                     MAX_SCALE, IS_INT, MANT, EMIN, S_MANT, S_EMIN, EXACT)


def check_store_args(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                     v_scale: torch.Tensor | None, **rows: torch.Tensor) -> KVQuantFormat | None:
    """Check the token rows (``rows``: name → ``[T, H, D]``, a float dtype, contiguous last dim) and the
    caches (contiguous, scales as their format needs) of a store launch; return the caches' 8-bit format."""
    for name, t in rows.items():
        check_dtype(name, t)
        check_last_dim_contiguous(name, t)
    fmt = check_cache_scales(k_cache, v_cache, k_scale, v_scale)
    if fmt is None:
        check_dtype("k_cache", k_cache)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    return fmt


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    num_warps: int = 4,
) -> None:
    """Scatter ``k``/``v`` ``[T, Hkv, D]`` into the caches at ``slot_mapping`` (int64 ``[T]``; < 0 skips).

    ``k`` and ``v`` may be strided views (e.g. slices of a fused qkv output); only the last
    dimension must be contiguous. One launch writes both caches (and, for 8-bit caches, quantizes
    each (token, head) row and writes its scale into ``k_scale``/``v_scale``).
    """
    fmt = check_store_args(k_cache, v_cache, k_scale, v_scale, k=k, v=v)
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    # ~4K elements per program keeps registers modest while each program still moves whole rows.
    block_h = min(next_pow2(num_heads), max(1, 4096 // head_dim))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    quant = store_constexprs(fmt, None if k_scale is None else k_scale.dtype, interpreting())
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, k_cache if k_scale is None else k_scale, v_cache if v_scale is None else v_scale,
        slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, PAGE=k_cache.shape[1], **quant,
        num_warps=num_warps,
    )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Torch reference of :func:`store_kv` (the tests' oracle): the engine's torch-path store
    (quantizing first for 8-bit caches, bit-identical to the kernel's codes and scales) on the rows
    whose slot is not -1."""
    check_cache_scales(k_cache, v_cache, k_scale, v_scale)
    valid = slot_mapping >= 0
    write_kv_rows(k[valid], v[valid], k_cache, v_cache, slot_mapping[valid], k_scale, v_scale)
