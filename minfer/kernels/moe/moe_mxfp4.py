"""MXFP4 expert weights in the MoE GEMMs: the codes are expanded in registers, tile by tile, never to a
dequantized copy in memory (the format: ``kernels/quant/mxfp4_ref.py``).

A weight tile arrives as ``[BLOCK_K // 2, N]`` bytes (K-major, as the float kernels load ``[BLOCK_K, N]``) and
its scales as ``[BLOCK_K // 32, N]``. Byte j holds elements 2j (low nibble) and 2j + 1 (high nibble), so rather
than interleave the two halves back into K order (a register shuffle), the product splits the other operand:
``a[:, 0::2] · W_low + a[:, 1::2] · W_high``, two dots half as deep over the same sum.

A code becomes a float16 bit pattern by placing it: sign at bit 15, its 2-bit exponent and 1-bit mantissa at
bits 11..9. That float16 is exactly the e2m1 value times 2 ** -14 (code 1, 0.5, lands on a float16 subnormal,
which the conversion to float32 keeps exactly), so one float32 multiply by ``2 ** (scale - 127 + 14)``, a bit
pattern too, gives the exact value; it rounds to the activations' dtype only for the tensor-core dot (bfloat16:
exact, the same bits as the reference's dequantized weight). Scale bytes up to 240 (2 ** 113) stay exact; past
that the factor's bit pattern overflows (no trained weight is that large; byte 255 is e8m0's NaN). The decode
kernels (``moe_decode.py``) use the same two element-wise steps, :func:`e2m1_pair` and :func:`e8m0_factor`.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e2m1_pair(w_bytes):
    """Packed bytes (any shape) -> (low-nibble codes, high-nibble codes) as float32, each the e2m1 value times
    2 ** -14, exactly (the float16 placement above)."""
    b = w_bytes.to(tl.uint16)
    lo = (((b & 0x8) << 12) | ((b & 0x7) << 9)).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (((b & 0x80) << 8) | ((b & 0x70) << 5)).to(tl.uint16).to(tl.float16, bitcast=True)
    return lo.to(tl.float32), hi.to(tl.float32)


@triton.jit
def e8m0_factor(scales):
    """e8m0 scale bytes -> float32 ``2 ** (s - 127) * 2 ** 14``, the factor that turns :func:`e2m1_pair`'s values
    into the weights (a bit pattern: exponent field s + 14)."""
    return ((scales.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_expand(w_bytes, scales, DTYPE: tl.constexpr):
    """``[BKH, N]`` packed bytes and their ``[BKH // 16, N]`` e8m0 scales -> (even elements, odd elements), each
    ``[BKH, N]`` in ``DTYPE``: row j of the pair is K index 2j and 2j + 1."""
    BKH: tl.constexpr = w_bytes.shape[0]
    N: tl.constexpr = w_bytes.shape[1]
    G: tl.constexpr = scales.shape[0]
    factor = tl.reshape(tl.broadcast_to(e8m0_factor(scales)[:, None, :], (G, BKH // G, N)), (BKH, N))
    lo, hi = e2m1_pair(w_bytes)
    return (lo * factor).to(DTYPE), (hi * factor).to(DTYPE)


@triton.jit
def mxfp4_load(w_ptrs, s_ptrs, k_left, EVEN_K: tl.constexpr):
    """One K step's weight bytes ``[BKH, N]`` and scales ``[BKH // 16, N]``; past ``k_left`` elements, code 0
    (zero)."""
    BKH: tl.constexpr = w_ptrs.shape[0]
    if EVEN_K:
        return tl.load(w_ptrs), tl.load(s_ptrs)
    rk = tl.arange(0, BKH)
    rs = tl.arange(0, BKH // 16)
    return (tl.load(w_ptrs, mask=(2 * rk < k_left)[:, None], other=0),
            tl.load(s_ptrs, mask=(32 * rs < k_left)[:, None], other=0))


@triton.jit
def mxfp4_dot(acc, a_even, a_odd, w_bytes, scales, DTYPE: tl.constexpr, UPCAST: tl.constexpr,
              PRECISION: tl.constexpr):
    """``acc + a · W`` for a ``[BLOCK_M, BLOCK_K]`` activation tile given as its even and odd columns and the
    packed weight tile (:func:`e2m1_expand`)."""
    lo, hi = e2m1_expand(w_bytes, scales, DTYPE)
    if UPCAST:
        a_even, a_odd, lo, hi = a_even.to(tl.float32), a_odd.to(tl.float32), lo.to(tl.float32), hi.to(tl.float32)
    acc = tl.dot(a_even, lo, acc, input_precision=PRECISION)
    return tl.dot(a_odd, hi, acc, input_precision=PRECISION)


@triton.jit
def mxfp4_mainloop(acc1, acc2, a_rows, w1_cols, s1_cols, w2_cols, s2_cols, K, BLOCK_K: tl.constexpr,
                   TWO: tl.constexpr, EVEN_K: tl.constexpr, DTYPE: tl.constexpr, UPCAST: tl.constexpr,
                   PRECISION: tl.constexpr):
    """A grouped GEMM's K loop over MXFP4 weights: ``acc1 += a · W1`` (and ``acc2 += a · W2`` when ``TWO``: gate and
    up, sharing the activation tile). ``a_rows [BLOCK_M]``: pointers to the activation rows; ``w*_cols [N]`` /
    ``s*_cols [N]``: to the weight rows' bytes and scales (one row of ``[N, K // 2]`` / ``[N, K // 32]`` per output
    column). K is a multiple of 32; past it (``EVEN_K`` false: BLOCK_K does not divide K) everything reads 0."""
    rk = tl.arange(0, BLOCK_K // 2)
    rs = tl.arange(0, BLOCK_K // 32)
    w1_ptrs = w1_cols[None, :] + rk[:, None]  # [BLOCK_K // 2, N]: K-major, as the float kernels' B
    w2_ptrs = w2_cols[None, :] + rk[:, None]
    a_ptrs = a_rows[:, None] + 2 * rk[None, :]  # x's even columns (the odd ones one element on)
    s1_ptrs = s1_cols[None, :] + rs[:, None]
    s2_ptrs = s2_cols[None, :] + rs[:, None]
    for k0 in range(0, K, BLOCK_K):
        k_left = K - k0
        w1, s1 = mxfp4_load(w1_ptrs, s1_ptrs, k_left, EVEN_K)
        a_even = tl.load(a_ptrs, mask=2 * rk[None, :] < k_left, other=0.0)
        a_odd = tl.load(a_ptrs + 1, mask=2 * rk[None, :] < k_left, other=0.0)
        acc1 = mxfp4_dot(acc1, a_even, a_odd, w1, s1, DTYPE, UPCAST, PRECISION)
        if TWO:
            w2, s2 = mxfp4_load(w2_ptrs, s2_ptrs, k_left, EVEN_K)
            acc2 = mxfp4_dot(acc2, a_even, a_odd, w2, s2, DTYPE, UPCAST, PRECISION)
        a_ptrs += BLOCK_K
        w1_ptrs += BLOCK_K // 2
        w2_ptrs += BLOCK_K // 2
        s1_ptrs += BLOCK_K // 32
        s2_ptrs += BLOCK_K // 32
    return acc1, acc2
