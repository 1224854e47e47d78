"""Write new K/V rows into the paged KV cache.

Cache layout per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous, so a slot
(``block * block_size + offset``) addresses one row of ``num_kv_heads * head_dim`` elements. The
engine pads the flat token list; padded rows carry a negative slot and must not be written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_dtype, check_last_dim_contiguous, next_pow2


@triton.jit
def _store_kv_kernel(
    K, V, KC, VC, SLOTS,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t)
    if slot < 0:  # padding row
        return
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM)
    row = slot.to(tl.int64) * (NUM_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
    k = tl.load(K + t.to(tl.int64) * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(V + t.to(tl.int64) * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(KC + row, k.to(KC.dtype.element_ty), mask=mask)
    tl.store(VC + row, v.to(VC.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_warps: int = 4,
) -> None:
    """Scatter ``k``/``v`` ``[T, Hkv, D]`` into the caches at ``slot_mapping`` (int64 ``[T]``; < 0 skips).

    ``k`` and ``v`` may be strided views (e.g. slices of a fused qkv output); only the last
    dimension must be contiguous. One launch writes both caches.
    """
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_dtype(name, t)
    check_last_dim_contiguous("k", k)
    check_last_dim_contiguous("v", v)
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    # ~4K elements per program keeps registers modest while each program still moves whole rows.
    block_h = min(next_pow2(num_heads), max(1, 4096 // head_dim))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_H=block_h, num_warps=num_warps,
    )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Torch reference of :func:`store_kv` (also the CPU fallback): an indexed copy of the valid rows."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    num_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_heads, head_dim).index_copy_(0, slots, k[valid].to(k_cache.dtype))
    v_cache.view(-1, num_heads, head_dim).index_copy_(0, slots, v[valid].to(v_cache.dtype))
