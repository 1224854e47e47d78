"""The qkv launch's rope-and-store epilogue (``gemv_rms_norm(rope_store=)``): rotary and the KV-cache store of a
one-token step's q, k and v inside the matrix-vector launch that computes them, one launch fewer a layer than the
separate kernel (``rope_store.py``: 2.5-3.7 µs a layer at batch 1 on an H200).

A program's rows are a permutation away from rotary pairs. With ``BLOCK_N = 2P`` rows, program ``p`` of head ``h``
takes dims ``j0 .. j0 + P`` of the head's first half and their partners ``D / 2`` further on (:func:`rope_rows`), so
its accumulator holds both halves of P rotation pairs. The epilogue rounds them as the projection does (to the
output's dtype), rotates in float32 and rounds once (``rope_store.py``'s arithmetic: ``x1 cos - x2 sin``,
``x2 cos + x1 sin``), writes q and k rotated and v as it is into the output, and k and v into the token's cache
slot. Layers with q/k norms (a norm needs the whole head), a partial rotary or an 8-bit cache (its scale is the
head's absmax) keep the separate kernel: :meth:`RopeStore.kernel_args` refuses them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class RopeStore:
    """What the epilogue reads besides the product: the token's position and cache slot (``[1]`` int64 each, a slot
    below 0 storing nothing), the rotary table ``[max_pos, D]`` float32 (``[cos | sin]``), the layer's 16- or
    32-bit cache ``[blocks, page, Hkv, D]`` and the head counts that split the output ``[q | k | v]``."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    def kernel_args(self, n: int, dtype: torch.dtype, block_n: int) -> dict:
        """The kernel's epilogue arguments for an ``n``-row product in ``dtype`` with ``block_n`` rows a program;
        ValueError naming what does not fit."""
        d, hq, hkv = self.head_dim, self.num_q_heads, self.num_kv_heads
        if n != (hq + 2 * hkv) * d:
            raise ValueError(f"rope_store: the product's {n} rows are not [q | k | v] of {hq} + 2 x {hkv} heads of {d}")
        if d & (d - 1) or block_n % 2 or (d // 2) % (block_n // 2):
            raise ValueError(f"rope_store: head_dim {d} (a power of two) must hold whole pairs of {block_n} // 2 rows")
        if self.cos_sin_cache.dtype != torch.float32 or self.cos_sin_cache.shape[-1] != d:
            raise ValueError(f"rope_store: a float32 [max_pos, {d}] rotary table (a full rotary), got "
                             f"{self.cos_sin_cache.dtype} {tuple(self.cos_sin_cache.shape)}")
        for name, cache in (("k_cache", self.k_cache), ("v_cache", self.v_cache)):
            if cache.dtype != dtype or cache.dim() != 4 or tuple(cache.shape[2:]) != (hkv, d) \
                    or not cache.is_contiguous():
                raise ValueError(f"rope_store: {name} must be a contiguous {dtype} [blocks, page, {hkv}, {d}], got "
                                 f"{cache.dtype} {tuple(cache.shape)}")
        return dict(POS=self.positions, CS=self.cos_sin_cache, stride_c=self.cos_sin_cache.stride(0),
                    KC=self.k_cache, VC=self.v_cache, SLOTS=self.slot_mapping, ROPE_STORE=True, ROT_HEAD=d,
                    ROPE_Q_HEADS=hq, ROPE_KV_HEADS=hkv)


@triton.jit
def rope_rows(pid, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``pid``'s rows: P dims of one head's first half, then their partners ``HEAD_DIM // 2`` further."""
    P: tl.constexpr = BLOCK_N // 2
    PER_HEAD: tl.constexpr = HEAD_DIM // 2 // P
    r = tl.arange(0, BLOCK_N)
    return (pid // PER_HEAD) * HEAD_DIM + (pid % PER_HEAD) * P + (r % P) + (r // P) * (HEAD_DIM // 2)


@triton.jit
def rope_store_epilogue(y, Y, rows, pid, POS, CS, stride_c, KC, VC, SLOTS, NUM_Q_HEADS: tl.constexpr,
                        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """``y`` (float32, bias added) of the rows :func:`rope_rows` gave ``pid``: q and k rotated, the three stored in
    ``Y`` and k, v in the cache slot (see the module docstring)."""
    P: tl.constexpr = BLOCK_N // 2
    HALF: tl.constexpr = HEAD_DIM // 2
    PER_HEAD: tl.constexpr = HALF // P
    KV_ROWS: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    head = pid // PER_HEAD
    dtype = Y.dtype.element_ty
    out = y.to(dtype)  # the projection's rounding
    if head < NUM_Q_HEADS + NUM_KV_HEADS:  # q or k: rotate the pairs
        r = tl.arange(0, BLOCK_N)
        first = (pid % PER_HEAD) * P + r % P  # each row's pair, as a dim of the first half
        pos = tl.load(POS)
        cos = tl.load(CS + pos * stride_c + first)
        sin = tl.load(CS + pos * stride_c + HALF + first)
        pairs = tl.reshape(out.to(tl.float32), (2, P))
        half = tl.arange(0, 2)[:, None]
        lo = tl.sum(tl.where(half == 0, pairs, 0.0), axis=0)
        hi = tl.sum(tl.where(half == 1, pairs, 0.0), axis=0)
        partner = tl.reshape(tl.where(half == 0, hi[None, :], lo[None, :]), (BLOCK_N,))
        out = (out.to(tl.float32) * cos + partner * tl.where(r < P, -sin, sin)).to(dtype)
    tl.store(Y + rows, out)
    if head >= NUM_Q_HEADS:
        slot = tl.load(SLOTS)
        if slot >= 0:  # padding rows carry slot -1
            if head < NUM_Q_HEADS + NUM_KV_HEADS:
                tl.store(KC + slot * KV_ROWS + rows - NUM_Q_HEADS * HEAD_DIM, out)
            else:
                tl.store(VC + slot * KV_ROWS + rows - NUM_Q_HEADS * HEAD_DIM - KV_ROWS, out)
