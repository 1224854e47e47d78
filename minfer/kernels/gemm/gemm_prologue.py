"""A GEMM for the decode step's few rows (M <= 256) that computes its input from the layer before's outputs:
``rms_norm(x + residual) Wᵀ`` (qkv, gate_up) and ``silu(gate) * up Wᵀ`` (down) in one launch each.

Why: at M = 64-256 the projections of a 0.6B-1B model are a few microseconds each (cuBLAS ran them at ~1 TB/s on
an H200), and each one follows a norm or an activation kernel of its own over a few hundred KB: three launches a
layer that only reshape the input. Here each program streams its ``BLOCK_M`` input rows tile by tile along K,
turns them into the product's operand in registers (``gemv_prologue``'s roundings), and multiplies them with its
``BLOCK_N`` weight rows with ``tl.dot``.

The RMS prologue cannot know a row's norm before it has read the row, so it multiplies ``round(h * w)`` (``h = x +
residual`` rounded as the residual stream is, ``w`` the norm's weight) and scales the float32 accumulator by
``rsqrt(mean(h²) + eps)`` at the end, the mean square summed from the same tiles: one pass over the input. HF
rounds ``h * rsqrt`` first and then the product with ``w``: the operands differ from HF's by an ulp here and
there, as a different summation order differs (a test holds both to the torch reference, and the engine's tests
hold greedy decoding to HF in float32, where the product is exact). The programs of the first column tile also
store ``h`` (the new residual stream) to ``R_OUT``, a tensor of its own: the others still read the old one.

``MINFER_GEMM_PROLOGUE=1`` turns the layout on (``model/quantization/prologue.py``); the configs are
``benchmarks/bench_gemm_prologue.py``'s.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._utils import check_dtype, check_last_dim_contiguous, dot_mode, next_pow2
from ..pdl import launch_options, use_pdl, wait_for_previous

PLAIN, RMS_NORM, SILU_MUL = 0, 1, 2  # what feeds the product: x, rms_norm(x (+ residual)), silu(gate) * up
MAX_ROWS = 256  # the largest M this kernel is chosen for: past it cuBLAS's large tiles fill the GPU


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def default_config(m: int, n: int, k: int, prologue: int) -> GemmConfig:
    """Rows per program up to 64 (wgmma's M), 64 weight rows per program so that a 1024-2048-wide projection still
    spreads over most of the SMs, 64 columns a step. Overridden by the sweep's table where one is measured."""
    block_m = max(16, min(64, next_pow2(m)))
    return GemmConfig(block_m=block_m, block_n=64, block_k=64 if k >= 64 else max(16, next_pow2(k)))


@triton.jit
def _input_tile(X, R, NW, R_OUT, rows, cols, row_ok, col_ok, K, stride_x, stride_r, write_residual,
                PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The operand tile ``[BLOCK_M, BLOCK_K]`` in x's dtype, and its float32 ``h²`` row sums ``[BLOCK_M]`` (zeros but
    for the RMS prologue: every branch returns the same types, which the compiler checks and the interpreter not)."""
    no_ss = tl.zeros(rows.shape, dtype=tl.float32)
    mask = row_ok[:, None] & col_ok[None, :]
    ptrs = X + rows[:, None] * stride_x + cols[None, :]
    if PROLOGUE == 2:  # silu(gate) * up over [gate | up], activation.py's roundings
        gate = tl.load(ptrs, mask=mask, other=0.0)
        up = tl.load(ptrs + K, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), no_ss
    x = tl.load(ptrs, mask=mask, other=0.0)
    if PROLOGUE == 1:
        dtype = x.dtype
        if HAS_RESIDUAL:
            res = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
            if write_residual:
                tl.store(R_OUT + rows[:, None] * K + cols[None, :], x, mask=mask)  # a new [M, K] tensor
        xf = x.to(tl.float32)
        w = tl.load(NW + cols, mask=col_ok, other=0.0)
        return (xf * w.to(tl.float32)[None, :]).to(dtype), tl.sum(xf * xf, axis=1)
    return x, no_ss


@triton.jit
def _gemm_prologue_kernel(X, R, NW, W, B, Y, R_OUT, M, N, K, stride_x, stride_r, stride_w, stride_y, eps,
                          PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          UPCAST: tl.constexpr, DOT_PREC: tl.constexpr, PDL: tl.constexpr):
    # The row tiles of one column tile are neighbours in launch order: they read the same weight rows, so all but
    # the first find them in L2 (M <= 256: at most 16 row tiles).
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = pid % m_tiles
    pid_n = pid // m_tiles
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    wrows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    wrow_ok = wrows < N
    ks = tl.arange(0, BLOCK_K)
    wait_for_previous(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + ks
        col_ok = cols < K
        a, a_ss = _input_tile(X, R, NW, R_OUT, rows, cols, row_ok, col_ok, K, stride_x, stride_r, pid_n == 0,
                              PROLOGUE, HAS_RESIDUAL)
        if PROLOGUE == 1:
            ss += a_ss
        b = tl.load(W + wrows[:, None] * stride_w + cols[None, :], mask=wrow_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bfloat16 dot (_utils.dot_mode)
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
    if PROLOGUE == 1:
        acc = acc * tl.rsqrt(ss / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(B + wrows, mask=wrow_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + wrows[None, :], acc.to(Y.dtype.element_ty),
             mask=row_ok[:, None] & wrow_ok[None, :])


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, prologue: int,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            config: GemmConfig | None = None,
            residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_dtype("x", x)
    check_last_dim_contiguous("x", x)
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != k or weight.dtype != x.dtype:
        raise ValueError(f"expected x [M, {k}] and weight [N, {k}] of one dtype, got {tuple(x.shape)} {x.dtype} and "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if weight.stride(1) != 1:
        raise ValueError("weight rows must be contiguous")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    m, n = x.shape[0], weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    new_residual = None
    if residual is not None:
        new_residual = torch.empty(m, k, dtype=x.dtype, device=x.device) if residual_out is None else residual_out
        if new_residual.shape != (m, k) or new_residual.dtype != x.dtype or not new_residual.is_contiguous():
            raise ValueError(f"residual_out must be a contiguous [{m}, {k}] {x.dtype} tensor")
    if m == 0:
        return y, new_residual
    cfg = config or default_config(m, n, k, prologue)
    pdl = use_pdl(x.device)
    upcast, prec = dot_mode(x.dtype)
    res = residual if residual is not None else x
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _gemm_prologue_kernel[grid](
        x, res, norm_weight if norm_weight is not None else x, weight, bias if bias is not None else weight, y,
        new_residual if new_residual is not None else y, m, n, k, x.stride(0), res.stride(0), weight.stride(0),
        y.stride(0), eps, PROLOGUE=prologue, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, UPCAST=upcast, DOT_PREC=prec, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl))
    return y, new_residual


def gemm_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              config: GemmConfig | None = None) -> torch.Tensor:
    """``x Wᵀ (+ b)``: x ``[M, K]``, weight ``[N, K]`` -> ``[M, N]``, float32 accumulation, one rounding."""
    return _launch(x, weight, bias, x.shape[-1], PLAIN, config=config)[0]


def gemm_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemmConfig | None = None, *,
                  residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rms_norm(x + residual) Wᵀ (+ b)`` and the new residual stream ``x + residual``, written to
    ``residual_out`` (a new tensor when None; never ``residual`` itself, which other programs still read; None
    without a residual). ``norm_weight`` ``[K]`` in x's dtype, or float32 (Gemma's ``1 + w``)."""
    if norm_weight.shape != (x.shape[-1],) or norm_weight.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"norm_weight must be [{x.shape[-1]}] in x's dtype or float32, got "
                         f"{tuple(norm_weight.shape)} {norm_weight.dtype}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("residual must match x in shape and dtype")
        check_last_dim_contiguous("residual", residual)
    if residual_out is not None and residual is not None and residual_out.data_ptr() == residual.data_ptr():
        raise ValueError("residual_out must not be residual: the kernel's other programs still read it")
    return _launch(x, weight, bias, x.shape[-1], RMS_NORM, residual, norm_weight, eps, config, residual_out)


def gemm_silu_mul(x_gate_up: torch.Tensor, weight: torch.Tensor, config: GemmConfig | None = None) -> torch.Tensor:
    """``silu(gate) * up Wᵀ``: ``x_gate_up`` ``[M, 2K]`` = [gate | up], weight ``[N, K]`` (the down projection)."""
    if x_gate_up.shape[-1] % 2:
        raise ValueError(f"x_gate_up's last dim must be even ([gate | up]), got {x_gate_up.shape[-1]}")
    return _launch(x_gate_up, weight, None, x_gate_up.shape[-1] // 2, SILU_MUL, config=config)[0]
