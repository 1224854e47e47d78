"""8-bit KV cache formats: per-token, per-KV-head symmetric scaling, and its torch reference.

Each token's K (and V) row of one KV head, ``head_dim`` values, is stored as 8-bit codes plus one
scale: ``x ≈ code * scale`` with ``scale = amax(|x|) / qmax``. The scale is fixed when the token
is written and never revisited, so a block's contents depend only on its own tokens: prefix
caching and preemption-recompute see exactly the bytes a fresh run would write.

Why per token and per head: K has a few large channels whose size varies token to token, and
heads differ by orders of magnitude; one scale per (token, head) follows both at the cost of one
scale per ``head_dim`` codes (1.5% of the bytes at head_dim 128 with float16 scales), and needs no
calibration pass. The scale is a divisor chosen from the row itself, so rounding the scale to its
storage dtype costs nothing: the codes are computed against the *stored* scale.

Scales live beside the codes in the paged layout ``[num_blocks, num_kv_heads, block_size]``:
a decode program (one sequence, one KV head) then reads each page's scales as one contiguous run
(32 bytes for 16 tokens), instead of one scattered element per token.

The Triton side (store-kernel quantization, dequantization in the attention kernels) lives in
``quant.py``; this module needs only torch, so the engine's torch path (``minfer/ops``) uses it
without loading Triton.

Triton's CPU interpreter (3.9) converts float32 to 8/16-bit floats with ties rounded away from
zero and, when rounding carries into the exponent, drops the carry (125.0 → e4m3 64.0). Under the
interpreter the kernels therefore round to the target grid themselves (round-to-nearest-even,
exact in float32) so the conversion that follows is exact; GPUs convert in hardware (``cvt.rn``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Measured choice (benchmarks/RESULTS.md, "Quantized KV cache"): float16 scales score the held-out
# perplexity of float32 scales within 0.06% for every format, and give 1.6% (head_dim 128) to 3.0%
# (head_dim 64) more blocks for the same memory.
KV_SCALE_DTYPE = torch.float16

# How the attention kernels turn codes into float16 dot operands (see ``codes_to_f16`` in
# quant.py): int8 by byte permutes, e4m3 by conversion, e5m2 by a bit shift.
F16_INT8, F16_CVT, F16_SHIFT = 0, 1, 2


@dataclass(frozen=True)
class KVQuantFormat:
    """One 8-bit cache format. ``mantissa_bits``/``min_exponent`` describe a float format's grid
    (zero for int8); the kernels round onto that grid exactly under the interpreter."""

    name: str
    dtype: torch.dtype
    qmax: float  # a row's largest magnitude is stored as ±qmax (exactly representable)
    mantissa_bits: int = 0
    min_exponent: int = 0

    @property
    def is_int(self) -> bool:
        return not self.dtype.is_floating_point

    @property
    def f16_kind(self) -> int:
        """How the kernels turn these codes into float16 (see ``codes_to_f16``)."""
        return F16_INT8 if self.is_int else F16_SHIFT if self.mantissa_bits == 2 else F16_CVT


# A float format's relative precision is the same at every magnitude, so where a row's amax lands
# only has to keep the row clear of overflow above and subnormals below. e5m2 maps it to 448 like
# e4m3 rather than to its own max (57344): codes and scales then stay mid-range for float16
# arithmetic (P·V takes ``p * v_scale`` as an fp16 operand in fp16 models), and the row still has
# 22 binades above e5m2's subnormals.
KV_QUANT_FORMATS: dict[str, KVQuantFormat] = {
    "int8": KVQuantFormat("int8", torch.int8, 127.0),  # symmetric: -128 unused
    "fp8_e4m3": KVQuantFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0, 3, -6),
    "fp8_e5m2": KVQuantFormat("fp8_e5m2", torch.float8_e5m2, 448.0, 2, -14),
}
_BY_DTYPE = {f.dtype: f for f in KV_QUANT_FORMATS.values()}
_FLOAT_GRID = {torch.float16: (10, -14)}  # scale dtype -> (mantissa bits, min normal exponent)


def format_of(cache_dtype: torch.dtype) -> KVQuantFormat | None:
    """The quantized format stored in a cache of ``cache_dtype``; None for a plain float cache."""
    return _BY_DTYPE.get(cache_dtype)


def scale_grid(scale_dtype: torch.dtype) -> tuple[int, int]:
    """(mantissa bits, min exponent) to round float32 scales onto; (0, 0) when stored as float32."""
    return _FLOAT_GRID.get(scale_dtype, (0, 0))


def min_scale(scale_dtype: torch.dtype) -> float:
    """Smallest scale: the dtype's smallest normal number. An all-zero row would otherwise get scale 0
    (and 0 * inf codes); a subnormal scale would round so coarsely that the row's max could clip."""
    return float(torch.finfo(scale_dtype).tiny)


# ------------------------------------------------------------------------------------- torch reference
def quantize_ref(x: torch.Tensor, fmt: KVQuantFormat, scale_dtype: torch.dtype = KV_SCALE_DTYPE
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rows ``x[..., D]`` → (codes ``[..., D]`` in ``fmt.dtype``, scales ``[...]``).

    The same arithmetic as the store kernel, step by step (IEEE division, int8 ties away from zero,
    float codes round-to-nearest-even), so the two agree bit for bit.
    """
    xf = x.float()
    fin = torch.finfo(scale_dtype)
    scale = (xf.abs().amax(-1) / fmt.qmax).clamp(min_scale(scale_dtype), fin.max).to(scale_dtype)
    inv = 1.0 / scale.float()
    y = (xf * inv[..., None]).clamp(-fmt.qmax, fmt.qmax)
    if fmt.is_int:
        codes = (y + torch.where(y >= 0, 0.5, -0.5)).trunc().to(fmt.dtype)
    else:
        codes = y.to(fmt.dtype)
    return codes, scale


def dequantize_ref(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes[..., D] * scale[..., None]`` in float32 (float64 if asked), then ``dtype``."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (codes.to(compute) * scale.to(compute)[..., None]).to(dtype)


def gather_scales(scales: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Scales of cache slots: ``scales[num_blocks, H, page]`` at ``slots[...]`` → ``[..., H]``."""
    page = scales.shape[2]
    return scales[slots // page, :, slots % page]




def write_kv_rows(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> None:
    """Write each token's K/V ``[T, Hkv, D]`` into its cache slot (every slot valid); 8-bit caches get
    codes, and scales beside them. The torch path's store and the store kernel's reference: one
    function, so the two backends' caches agree bit for bit."""
    fmt = format_of(k_cache.dtype)
    page = k_cache.shape[1]
    for x, cache, scales in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        rows = cache.view(-1, *cache.shape[2:])
        if fmt is not None:
            x, row_scales = quantize_ref(x, fmt, scales.dtype)
            scales[slot_mapping // page, :, slot_mapping % page] = row_scales
            rows, x = rows.view(torch.uint8), x.view(torch.uint8)  # as bytes: float8 lacks some index kernels
        rows[slot_mapping] = x
