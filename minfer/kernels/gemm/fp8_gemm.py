"""FP8 (e4m3) GEMMs of the FP8 linear layers: ``y = dequant(xq) · dequant(w)ᵀ (+ bias)``.

Two weight formats, each with its activation format (``fp8_quant.py`` makes the activations):
- "channel": ``w [N, K]`` e4m3 with one float32 scale per output row, ``w_scale [N]``; activations per token,
  ``x_scale [M]``. The scales factor out of the K sum, so cuBLAS's row-wise scaled GEMM does it
  (``torch._scaled_mm``, see :func:`fp8_gemm_channel`); only its reference lives here.
- "block": ``w [N, K]`` e4m3 with one scale per 128x128 block, stored ROW-EXPANDED as ``w_scale [N, ceil(K/128)]``
  (row n's scale of k-block j), so a tensor-parallel shard or a fused qkv / gate_up stack of any row count
  is a plain row slice or concatenation; activations per token per 128 columns, ``x_scale [M, ceil(K/128)]``.
  The scales vary along K, so they cannot leave the sum: :func:`fp8_gemm_block` multiplies each 128-deep
  k-step's fp8 tensor-core product (float32) by ``x_scale[m, j] * w_scale[n, j]`` before adding it to the
  float32 accumulator. The expanded scales cost 4 bytes per 128 weight bytes (3%) of extra reads, from L2.

Launch configs come from a small table by M (``BLOCK_CONFIGS``), not from autotuning, so start-up compiles one
variant per bucket and nothing is timed at run time. The table was chosen on an H200 from the sweep in
``benchmarks/bench_fp8.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._utils import check_last_dim_contiguous
from ..quant.fp8_ref import FP8_DTYPE, FP8_GROUP, dequantize_fp8, num_groups
from ..pdl import launch_options, use_pdl, wait_for_previous


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Tile (``block_m`` x ``block_n``, ``block_k`` deep: must be the 128 of the scale groups), ``group_m`` rows
    of tiles swept together for L2 reuse of the weight tiles, warps, pipelining depth."""

    block_m: int
    block_n: int
    block_k: int = FP8_GROUP
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4


# (largest M, config), first match wins; the fastest summed over llama-3.1-8b's four projections on an H200
# (``bench_fp8.py --sweep``, 16 candidates). Small M is a weight stream: narrow N tiles give enough programs
# to keep every SM loading (16-row tiles run on mma.sync, 64-row ones on wgmma). Large M is bound by the
# tensor cores, which wait for each k-step's product before it is scaled: 64x128 on one warpgroup beat
# 128x128 on two by 25% (~510 TFLOP/s at M=8192, against cuBLAS's blockwise ~1100: see benchmarks/bench_fp8.py).
BLOCK_CONFIGS: tuple[tuple[int, Fp8GemmConfig], ...] = (
    (1, Fp8GemmConfig(16, 64, group_m=1, num_warps=4, num_stages=5)),
    (16, Fp8GemmConfig(16, 32, group_m=1, num_warps=4, num_stages=4)),
    (64, Fp8GemmConfig(64, 32, num_warps=4, num_stages=4)),
    (1024, Fp8GemmConfig(64, 128, num_warps=4, num_stages=3)),
    (1 << 62, Fp8GemmConfig(64, 128, num_warps=4, num_stages=4)),
)


def block_config(m: int) -> Fp8GemmConfig:
    """The launch config of an ``m``-row GEMM: the first ``BLOCK_CONFIGS`` bucket that holds ``m``."""
    return next(cfg for max_m, cfg in BLOCK_CONFIGS if m <= max_m)


@triton.jit
def _fp8_gemm_block_kernel(A, AS, B, BS, BIAS, C, M, N, K, stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
                           HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                           PDL: tl.constexpr = False):
    """C[M, N] = sum over k-blocks j of (A[:, j] · B[:, j]ᵀ) * AS[:, j, None] * BS[None, :, j] (+ BIAS)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M tile rows walk the N tiles together, so each weight tile is read from HBM
    # once per group rather than once per tile row.
    width = GROUP_M * num_pid_n
    first_m = (pid // width) * GROUP_M
    group_rows = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_rows
    pid_n = (pid % width) // group_rows
    # Rows and columns past M / N wrap around (valid addresses, no load masks); their results are not stored.
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = A + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
    b_ptrs = B + rn.to(tl.int64)[None, :] * stride_bn + rk[:, None]  # [BLOCK_K, BLOCK_N], K-major: wgmma's B
    as_ptrs = AS + rm * stride_asm
    bs_ptrs = BS + rn * stride_bsn
    wait_for_previous(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - j * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        a_s = tl.load(as_ptrs + j)
        b_s = tl.load(bs_ptrs + j)
        acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(BIAS + rn).to(tl.float32)[None, :]
    om = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = C + om.to(tl.int64)[:, None] * stride_cm + on[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(om < M)[:, None] & (on < N)[None, :])


def _check_fp8_operands(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                        bias: torch.Tensor | None, scale_shape: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    if xq.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE:
        raise TypeError(f"xq and w must be {FP8_DTYPE}, got {xq.dtype} and {w.dtype}")
    if xq.dim() != 2 or w.dim() != 2 or xq.shape[1] != w.shape[1]:
        raise ValueError(f"expected xq [M, K] and w [N, K], got {tuple(xq.shape)} and {tuple(w.shape)}")
    for name, s, want in (("x_scale", x_scale, scale_shape[0]), ("w_scale", w_scale, scale_shape[1])):
        if s.dtype != torch.float32 or tuple(s.shape) != want:
            raise ValueError(f"{name} must be float32 of shape {list(want)}, got {s.dtype} {list(s.shape)}")
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"bias must be [{w.shape[0]}], got {tuple(bias.shape)}")


def fp8_gemm_block(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                   config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """Block-scaled FP8 GEMM -> ``[M, N]`` in ``out_dtype``.

    ``xq [M, K]`` e4m3 with ``x_scale [M, ceil(K/128)]`` float32 (``quantize_fp8(x, 128)`` or a fused variant),
    ``w [N, K]`` e4m3 with row-expanded ``w_scale [N, ceil(K/128)]`` float32, ``bias [N]`` (any float dtype,
    added in float32). Both operands need a contiguous last dim (K-major: what fp8 wgmma takes for A and B);
    the scale tensors need their last dim contiguous. ``config`` overrides the M-bucket table (sweeps only).
    """
    m, k = xq.shape
    n = w.shape[0]
    g = num_groups(k)
    _check_fp8_operands(xq, x_scale, w, w_scale, bias, ((m, g), (n, g)))
    for name, t in (("xq", xq), ("w", w), ("x_scale", x_scale), ("w_scale", w_scale)):
        check_last_dim_contiguous(name, t)
    if bias is not None and not bias.is_contiguous():
        raise ValueError("bias must be contiguous")
    cfg = config or block_config(m)
    if cfg.block_k != FP8_GROUP:
        raise ValueError(f"block_k must equal the scale group {FP8_GROUP}, got {cfg.block_k}")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    pdl = use_pdl(xq.device)
    _fp8_gemm_block_kernel[grid](
        xq, x_scale, w, w_scale, bias if bias is not None else w_scale, out, m, n, k, xq.stride(0),
        x_scale.stride(0), w.stride(0), w_scale.stride(0), out.stride(0), HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, PDL=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl),
    )
    return out


def fp8_gemm_channel(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Channel-scaled FP8 GEMM through ``torch._scaled_mm`` (cuBLASLt row-wise scaling on sm90) -> ``[M, N]``.

    ``xq [M, K]`` with per-token ``x_scale [M]``, ``w [N, K]`` with per-row ``w_scale [N]``, all as stored. The
    layout ``_scaled_mm`` wants: ``b`` column-major (``w.t()``, a view of the row-major weight), ``scale_a
    [M, 1]`` and ``scale_b [1, N]`` float32 (views too). cuBLASLt needs K and N to be multiples of 16.
    """
    m, k = xq.shape
    _check_fp8_operands(xq, x_scale, w, w_scale, bias, ((m,), (w.shape[0],)))
    return torch._scaled_mm(xq, w.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :],
                            bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype)


# ------------------------------------------------------------------------------------------- torch reference
def fp8_gemm_block_ref(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Torch reference of :func:`fp8_gemm_block`: both operands dequantized, one float32 matmul (the kernel sums
    the same products in another order), bias in float32, one rounding to ``out_dtype``."""
    y = dequantize_fp8(xq, x_scale) @ dequantize_fp8(w, w_scale).T
    if bias is not None:
        y += bias.float()
    return y.to(out_dtype)


def fp8_gemm_channel_ref(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Reference of the channel format (:func:`fp8_gemm_channel`): the codes' float32 product, then the row and
    column scales (exact to factor out: they are constant along K), bias in float32, one rounding."""
    y = (xq.float() @ w.float().T) * x_scale.float()[:, None] * w_scale.float()[None, :]
    if bias is not None:
        y += bias.float()
    return y.to(out_dtype)
