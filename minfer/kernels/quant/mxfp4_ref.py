"""MXFP4 (OCP Microscaling, e2m1 elements with an e8m0 scale per 32): the format's constants and its quantize /
dequantize references, torch only (the torch MoE op dequantizes the experts it runs with them; the kernels that
expand the codes in registers are held to them).

The layout is the released gpt-oss checkpoints' (``*_blocks`` / ``*_scales``), flattened: a matrix ``[N, K]`` is
``blocks [N, K // 2]`` uint8, two 4-bit codes a byte, the low nibble the even column and the high nibble the odd
one, and ``scales [N, K // 32]`` uint8, element ``k`` worth ``e2m1(code) * 2 ** (scales[k // 32] - 127)``. A code
is sign (bit 3), a 2-bit exponent and a 1-bit mantissa: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. (A checkpoint's
``[N, K // 32, 16]`` blocks are this ``[N, K // 2]`` reshaped.)
"""
from __future__ import annotations

import torch

MXFP4_BLOCK = 32  # elements that share one scale
CODES_PER_BYTE = 2
E8M0_BIAS = 127  # a scale byte s is 2 ** (s - 127)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # codes 0..7; codes 8..15 are their negatives
E2M1_MAX = 6.0
E2M1_EMAX = 2  # exponent of the largest normal magnitude (6 = 1.5 * 2 ** 2): the OCP shared-exponent rule's emax


def e2m1_values(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 codes' float32 values (code 8 is -0.0)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def unpack_e2m1(blocks: torch.Tensor) -> torch.Tensor:
    """``[..., K // 2]`` packed bytes -> ``[..., K]`` int64 codes (low nibble first)."""
    b = blocks.to(torch.int64)
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``blocks [..., K // 2]`` uint8 and ``scales [..., K // 32]`` uint8 -> ``[..., K]`` in ``dtype``.

    The product is exact in float32 (a power of two times a 3-bit significand; a scale byte 0 is 2 ** -127, a
    float32 subnormal) and rounds once to ``dtype``, as HF's ``ldexp`` into its output dtype does."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    k = blocks.shape[-1] * CODES_PER_BYTE
    if blocks.shape[:-1] != scales.shape[:-1] or scales.shape[-1] * MXFP4_BLOCK != k:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} need scales [..., {k // MXFP4_BLOCK}] (one per "
                         f"{MXFP4_BLOCK} elements), got {list(scales.shape)}")
    values = e2m1_values(blocks.device)[unpack_e2m1(blocks)]
    exponents = (scales.to(torch.int32) - E8M0_BIAS).repeat_interleave(MXFP4_BLOCK, dim=-1)
    return torch.ldexp(values, exponents).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [..., K]`` (K a multiple of 32) -> ``(blocks [..., K // 2] uint8, scales [..., K // 32] uint8)``, the
    OCP MX rule: each block's scale is ``2 ** (floor(log2(amax)) - 2)`` (so its largest element lands in
    [4, 8)), each element ``w / scale`` rounded to the nearest e2m1 value (a tie to the even code), saturating at
    6. An all-zero block takes scale byte 0. Values already of the form e2m1 * 2 ** s (one s a block) come back
    exactly through :func:`dequantize_mxfp4`."""
    if w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the last dimension a multiple of {MXFP4_BLOCK}, got {list(w.shape)}")
    wf = w.float().unflatten(-1, (-1, MXFP4_BLOCK))
    amax = wf.abs().amax(-1)
    _, e = torch.frexp(amax)  # amax = m * 2 ** e, m in [0.5, 1): floor(log2(amax)) = e - 1
    shared = torch.where(amax > 0, e - 1 - E2M1_EMAX, -E8M0_BIAS).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = (wf.abs() / torch.ldexp(torch.ones_like(amax), shared)[..., None]).clamp(max=E2M1_MAX)
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=w.device)
    mids = (mags[1:] + mags[:-1]) / 2
    code = torch.bucketize(scaled, mids)  # a value on a midpoint goes to the lower code ...
    on_mid = scaled == mids[code.clamp(max=len(mids) - 1)]
    code = code + (on_mid & (code % 2 == 1)).to(code.dtype)  # ... unless that code is odd: ties to even
    code = (code | torch.signbit(wf).to(code.dtype) << 3).flatten(-2)
    blocks = (code[..., 0::2] | code[..., 1::2] << 4).to(torch.uint8)
    return blocks, (shared + E8M0_BIAS).to(torch.uint8)
