"""The e4m3 -> float32 conversion of the batch-1 matrix-vector kernel's weight tiles (``gemv.py``), in three forms.

Why: an FP8 weight halves the bytes a batch-1 product streams, yet the kernel reached a far lower share of HBM
bandwidth on e4m3 weights than on bf16 ones (``bench_fp8.py``): the conversion, not the bytes, bounds it. Triton's
cast turns each pair of codes into two f16 with ``cvt.rn.f16x2.e4m3x2``, a conversion-unit instruction on sm_89+
(fewer per clock than the ALU's), and each f16 into float32. The forms (the kernel's ``CVT``):

- ``CAST`` (0): Triton's cast. The reference, and the form off CUDA.
- ``PAIRS`` (1): inline PTX over the four codes a thread holds in one 32-bit word: two ``cvt.rn.f16x2.e4m3x2``
  (sm_89+; e4m3 -> f16 is exact) and four f16 -> float32. Compiled for sm_90 (Triton 3.9) it gives the cast's very
  SASS (two F2FP.F16.E4M3.UNPACK_B a word, read straight from the loaded registers): the A/B's control.
- ``BITS`` (2): no conversion instruction: each code's bits are moved into an f16 with shifts and masks (sign to bit
  15, exponent and mantissa one bit right of the byte's top), which reads as ``code * 2^-8`` exactly (e4m3's
  exponent bias is 7, f16's 15; e4m3's subnormals land on f16's), then f16 -> float32. The kernel multiplies each
  row's sum by ``2^8`` once (:func:`fp8_rescale`): a power of two commutes with every float32 rounding short of
  underflow, so the result is bit-identical to the cast's. About seven ALU ops (LOP3, shifts) a word replace the
  two conversion-unit F2FPs. The NaN codes (0x7F, 0xFF) read as +-480, not NaN: a quantized weight never holds
  them.

Each form maps each code to its own value: the asm takes the four codes in the register the thread's 16-byte load
already filled (``inline_asm_elementwise``'s ``pack=4``; byte ``i`` of the word is element ``i``) and returns them in
the tile's order, so the input vector lines up with no reordering and every load stays a 16-byte vector.

The CPU interpreter runs no PTX: there ``PAIRS`` is the cast and ``BITS`` the same bit placement written in Triton,
one code at a time, so the CPU tests run BITS' arithmetic and the kernel's ``2^8`` against the reference; the PTX
runs in the tests marked ``gpu``. ``MINFER_FP8_PACKED_CVT`` = 0 / 1 / 2 picks the form on sm_89+ (default 2).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .._utils import interpreting

CAST, PAIRS, BITS = 0, 1, 2
FP8_CVT_NAMES = {"cast": CAST, "pairs": PAIRS, "bits": BITS}
DEFAULT_PACKED_CVT = BITS


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def can_run_ptx(device: torch.device) -> bool:
    """Whether the kernel's inline PTX runs on ``device``: NVIDIA CUDA, compiled (not the interpreter)."""
    return device.type == "cuda" and not interpreting() and torch.version.hip is None


def fp8_cvt(device: torch.device) -> int:
    """The conversion an e4m3 weight takes on ``device`` by default: ``MINFER_FP8_PACKED_CVT`` (0 cast, 1 pairs,
    2 bits; unset: 2) on NVIDIA sm_89+, the cast elsewhere (and in the interpreter)."""
    if not can_run_ptx(device):
        return CAST
    if _capability(device.index if device.index is not None else torch.cuda.current_device()) < (8, 9):
        return CAST
    value = os.environ.get("MINFER_FP8_PACKED_CVT", str(DEFAULT_PACKED_CVT))
    if value not in ("0", "1", "2"):
        raise ValueError(f"MINFER_FP8_PACKED_CVT must be 0 (cast), 1 (pairs) or 2 (bits), got {value!r}")
    return int(value)


@triton.jit
def fp8_to_f32(w, CVT: tl.constexpr, ASM: tl.constexpr):
    """float32 values of the e4m3 tile ``w``, times ``2^-8`` under ``BITS``; ``ASM``: inline PTX (else Triton)."""
    if CVT == 0:
        y = w.to(tl.float32)
    elif not ASM:
        if CVT == 1:  # the same values as the PTX pairs
            y = w.to(tl.float32)
        else:  # BITS' bit placement, one code at a time
            c = w.to(tl.uint8, bitcast=True).to(tl.int32)
            h = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
            y = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    elif CVT == 1:
        # $4: four codes, byte i = element i. Pairs (0, 1) and (2, 3) convert to f16x2 (low byte -> low half).
        y = tl.inline_asm_elementwise(
            """
            {
            .reg .b16 c01, c23;
            .reg .b32 f01, f23;
            .reg .f16 h<4>;
            mov.b32 {c01, c23}, $4;
            cvt.rn.f16x2.e4m3x2 f01, c01;
            cvt.rn.f16x2.e4m3x2 f23, c23;
            mov.b32 {h0, h1}, f01;
            mov.b32 {h2, h3}, f23;
            cvt.f32.f16 $0, h0;
            cvt.f32.f16 $1, h1;
            cvt.f32.f16 $2, h2;
            cvt.f32.f16 $3, h3;
            }
            """,
            "=r,=r,=r,=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.float32, is_pure=True, pack=4)
    else:
        # BITS. Odd bytes (1, 3) already sit in the high byte of their 16-bit lane: keep the sign bit, shift the
        # rest right by one (exponent to f16 bits 13-10, mantissa to 9-7). Even bytes (0, 2) move up a byte first.
        y = tl.inline_asm_elementwise(
            """
            {
            .reg .b32 po, pe, ts, tm;
            .reg .f16 h<4>;
            and.b32 ts, $4, 0x80008000;
            shr.b32 tm, $4, 1;
            and.b32 tm, tm, 0x3F803F80;
            or.b32 po, ts, tm;
            shl.b32 pe, $4, 8;
            and.b32 ts, pe, 0x80008000;
            shr.b32 tm, pe, 1;
            and.b32 tm, tm, 0x3F803F80;
            or.b32 pe, ts, tm;
            mov.b32 {h0, h2}, pe;
            mov.b32 {h1, h3}, po;
            cvt.f32.f16 $0, h0;
            cvt.f32.f16 $1, h1;
            cvt.f32.f16 $2, h2;
            cvt.f32.f16 $3, h3;
            }
            """,
            "=r,=r,=r,=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.float32, is_pure=True, pack=4)
    return y


@triton.jit
def fp8_rescale(y, CVT: tl.constexpr):
    """A row's float32 sum of :func:`fp8_to_f32` products back to the weight's scale (``2^8`` under BITS)."""
    if CVT == 2:
        y = y * 256.0
    return y
