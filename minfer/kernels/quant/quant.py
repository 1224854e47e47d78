"""Triton helpers of the 8-bit KV cache: quantize in the store kernel, dequantize in attention.

The formats, scaling rules and the torch reference live in ``kv_quant.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_dtype, check_last_dim_contiguous, dot_mode, interpreting
from .kv_quant import KVQuantFormat, format_of, min_scale, scale_grid


# ------------------------------------------------------------------------------------------- triton
@triton.jit
def round_to_float_grid(x, MANT: tl.constexpr, EMIN: tl.constexpr):
    """Round float32 ``x`` to the nearest (ties to even) value with ``MANT`` mantissa bits and
    minimum normal exponent ``EMIN`` (below it: that format's fixed subnormal spacing). The result
    is exactly representable in the target format, so converting it afterwards does not round.
    Used under the interpreter only; magnitudes must already fit the format."""
    bits = x.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)  # exponent of |x| (of the spacing, if subnormal)
    ulp = ((e - MANT + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((127 - e + MANT) << 23).to(tl.float32, bitcast=True)
    # |x / ulp| < 2^(MANT+1): adding and removing 1.5 * 2^23 rounds it to an integer, ties to even.
    r = (x * inv_ulp + 12582912.0) - 12582912.0
    return r * ulp


@triton.jit
def row_scales(x, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr, MAX_SCALE: tl.constexpr,
               S_MANT: tl.constexpr, S_EMIN: tl.constexpr, EXACT: tl.constexpr):
    """float32 scales of rows ``x [R, D]``: ``amax / QMAX`` clamped into the scale dtype's normal range.

    The caller converts them to the scale dtype, stores them and quantizes against the converted
    value. ``EXACT`` (the interpreter): pre-round onto a 16-bit scale dtype's grid (``S_MANT`` > 0).
    """
    amax = tl.max(tl.abs(x.to(tl.float32)), axis=1)
    scale = tl.minimum(tl.maximum(tl.math.div_rn(amax, QMAX), MIN_SCALE), MAX_SCALE)
    if EXACT and S_MANT > 0:
        scale = round_to_float_grid(scale, S_MANT, S_EMIN)
    return scale


@triton.jit
def scaled_codes(x, scale, QMAX: tl.constexpr, IS_INT: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr,
                 EXACT: tl.constexpr):
    """float32 values that convert (``.to(code dtype)``) to the codes of rows ``x [R, D]`` with
    stored scales ``scale [R]`` (float32): int8 gets ``y ± 0.5`` (the conversion truncates, so ties
    go away from zero), float formats ``y`` itself (rounded by hand under ``EXACT``)."""
    inv = tl.math.div_rn(1.0, scale)
    y = tl.minimum(tl.maximum(x.to(tl.float32) * inv[:, None], -QMAX), QMAX)
    if IS_INT:
        y = y + tl.where(y >= 0, 0.5, -0.5)
    elif EXACT:
        y = round_to_float_grid(y, MANT, EMIN)
    return y


# ------------------------------------------------------------------------------------- launch helpers
def check_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                          v_scale: torch.Tensor | None, **int32_args: torch.Tensor) -> KVQuantFormat | None:
    """Check the arguments of the paged attention kernels (q ``[T, Hq, D]``, caches ``[num_blocks,
    block_size, Hkv, D]``, the named int32 index tensors); return the cache's 8-bit format or None."""
    check_dtype("q", q)
    fmt = check_cache_scales(k_cache, v_cache, k_scale, v_scale)
    if fmt is None:
        check_dtype("k_cache", k_cache)
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("expected q [T, Hq, D] and k_cache/v_cache [num_blocks, block_size, Hkv, D]")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    check_last_dim_contiguous("q", q)
    head_dim, page, num_kv_heads = q.shape[-1], k_cache.shape[1], k_cache.shape[2]
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256 or k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim must be a power of two in [16, 256] matching the cache, got {head_dim}")
    if page & (page - 1) or page < 16:
        raise ValueError(f"block_size must be a power of two >= 16, got {page}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    for name, t in int32_args.items():
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    return fmt


def check_cache_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                       v_scale: torch.Tensor | None) -> KVQuantFormat | None:
    """The caches' format (None: plain float), after checking that 8-bit caches come with scales of
    shape ``[num_blocks, num_kv_heads, block_size]`` and float caches without."""
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache and v_cache differ in dtype: {k_cache.dtype} vs {v_cache.dtype}")
    fmt = format_of(k_cache.dtype)
    if fmt is None:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale given for a {k_cache.dtype} cache; scales belong to 8-bit caches")
        return None
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {fmt.name} KV cache needs k_scale and v_scale")
    want = (k_cache.shape[0], k_cache.shape[2], k_cache.shape[1])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if tuple(s.shape) != want or not s.is_contiguous() or s.dtype not in (torch.float32, torch.float16):
            raise ValueError(f"{name} must be a contiguous float32/float16 tensor of shape [num_blocks, "
                             f"num_kv_heads, block_size] = {list(want)}, got {s.dtype} {list(s.shape)}")
    if k_scale.dtype != v_scale.dtype:
        raise TypeError("k_scale and v_scale must share a dtype")
    return fmt


def product_mode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, fmt: KVQuantFormat | None
                 ) -> tuple[torch.Tensor, torch.Tensor, bool, str, bool, bool]:
    """How the attention kernels multiply: ``(k_cache, v_cache, upcast, input_precision, f16, asm)``.

    8-bit caches with a 16-bit q take float16 products on exactly converted codes (``f16``); a
    float32 q keeps float32 products. On an NVIDIA GPU the codes are converted by inline PTX (``asm``;
    elsewhere by Triton's casts), which takes fp8 codes as raw bytes, so those caches are passed as
    uint8 views.
    """
    upcast, prec = dot_mode(q.dtype)
    f16 = fmt is not None and q.dtype != torch.float32
    if f16:
        upcast, prec = dot_mode(torch.float16)
    asm = f16 and q.device.type == "cuda" and torch.version.hip is None and not interpreting()
    if asm and not fmt.is_int:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    return k_cache, v_cache, upcast, prec, f16, asm


def store_constexprs(fmt: KVQuantFormat | None, scale_dtype: torch.dtype | None, exact: bool) -> dict:
    """The store kernel's compile-time quantization parameters (``QUANT=False`` for float caches)."""
    if fmt is None:
        return dict(QUANT=False, QMAX=1.0, MIN_SCALE=1.0, MAX_SCALE=1.0, IS_INT=False, MANT=0, EMIN=0,
                    S_MANT=0, S_EMIN=0, EXACT=False)
    s_mant, s_emin = scale_grid(scale_dtype)
    return dict(QUANT=True, QMAX=fmt.qmax, MIN_SCALE=min_scale(scale_dtype),
                MAX_SCALE=float(torch.finfo(scale_dtype).max), IS_INT=fmt.is_int, MANT=fmt.mantissa_bits,
                EMIN=fmt.min_exponent, S_MANT=s_mant, S_EMIN=s_emin, EXACT=exact)


# ---------------------------------------------------------------------------- dequantizing in registers
# How codes become float16 dot operands, per format (``KVQuantFormat.f16_kind``); every conversion is
# exact (int8 and both fp8 formats fit float16). A conversion instruction (I2F/F2F) runs at a quarter of
# the ALU rate and would hold an 8-bit decode kernel under HBM bandwidth, so on the GPU the kernels use
# inline PTX (``ASM``):
#   int8: fp16 bits 0x6400 | u read as 1024 + u for a byte u, so a code c, its byte XOR 0x80 (= c + 128),
#         becomes 1152 + c by two byte permutes per 4 codes; one fp16 subtraction per pair removes the
#         1152. (Subtracting it after the MMA instead, through a row sum of P, loses ~2.5e-2 on Hopper:
#         the tensor cores' float32 accumulation drops the low bits of 1152 * sum(P), against which the
#         result is a small difference.)
#   e5m2: the top byte of a float16, placed by a byte permute.
#   e4m3: the native sm_89+ ``cvt.rn.f16x2.e4m3x2``.
# Inline PTX is also opaque to Triton's layout passes, which matters for V: V is the B operand of P·V,
# reduced along tokens, and 8-bit data cannot go through the transposing ``ldmatrix``, so a conversion
# Triton is free to move lands after the shared-memory load and gathers V byte by byte (64 ``LDS.U8``
# per 64-token tile). An impure (``PURE=False``) conversion stays on the loaded tile, and V reaches the
# MMA as float16 through the transposing ``ldmatrix``. K (reduced along its contiguous dim) is fine
# either way, and a pure conversion lets Triton convert it after the shared-memory load.
# The interpreter cannot run PTX: there the same values come from plain Triton casts and shifts.


@triton.jit
def codes_to_f16(x, KIND: tl.constexpr, ASM: tl.constexpr, PURE: tl.constexpr):
    """8-bit codes (int8, or fp8/uint8 bytes) → the float16 values they encode (exactly)."""
    if ASM:
        if KIND == 0:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 u, a, b, c; mov.b32 c, 0x64806480; xor.b32 u, $2, 0x80808080; "
                "prmt.b32 a, u, 0x64646464, 0x4140; prmt.b32 b, u, 0x64646464, 0x4342; "
                "sub.f16x2 $0, a, c; sub.f16x2 $1, b, c; }",
                "=r,=r,r", [x], dtype=tl.float16, is_pure=PURE, pack=4)
        elif KIND == 1:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
                "=r,=r,r", [x], dtype=tl.float16, is_pure=PURE, pack=4)
        else:
            return tl.inline_asm_elementwise(
                "{ prmt.b32 $0, 0, $2, 0x5040; prmt.b32 $1, 0, $2, 0x7060; }",
                "=r,=r,r", [x], dtype=tl.float16, is_pure=PURE, pack=4)
    elif KIND == 2:  # a shift: the interpreter converts e5m2 subnormals wrongly
        return (x.to(tl.uint8, bitcast=True).to(tl.uint16) << 8).to(tl.float16, bitcast=True)
    else:
        return x.to(tl.float16)


@triton.jit
def q_to_f16(q):
    """A 16-bit q as the float16 operand of the products with converted codes: bfloat16's range is wider, so
    values past float16's largest finite one saturate there instead of becoming inf."""
    return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


@triton.jit
def split_q_int8(q):
    """float32 rows ``q [R, D]`` → (hi, lo, scale): int8 tensors with ``q ≈ scale * (hi + lo / 256)``.

    Two int8 MMAs against int8 K codes then give Q·Kᵀ with ~15 bits of q (one alone, 7 bits, moves
    decode attention by ~6e-3; bf16 q keeps 8): the products need no K conversion at all."""
    amax = tl.max(tl.abs(q), axis=1)
    scale = tl.where(amax > 0, amax / 127.0, 1.0)
    x = q / scale[:, None]
    hi = (x + tl.where(x >= 0, 0.5, -0.5)).to(tl.int8)
    r = tl.minimum(tl.maximum((x - hi.to(tl.float32)) * 256.0, -127.0), 127.0)
    lo = (r + tl.where(r >= 0, 0.5, -0.5)).to(tl.int8)
    return hi, lo, scale
