"""FP8 (e4m3) activation quantization for the FP8 linear layers: alone, or fused into the op that feeds the GEMM.

Two activation formats, matching the two weight formats of ``fp8_gemm.py``:
- per token (``group_size=None``): one float32 scale per row, ``x_scale [M]``, for the "channel" weights
  (``torch._scaled_mm`` with row-wise scales);
- per token per group (``group_size=128``): one scale per row and 128-column group, ``x_scale [M, ceil(K/128)]``,
  for the "block" weights (``fp8_gemm_block``).

The arithmetic, identical in the kernels and the torch references (so they agree bit for bit off the
interpreter): ``scale = max(amax(|x|) / 448, FP8_MIN_SCALE)`` by IEEE division, ``codes = rne(clamp(x * (1 /
scale), ±448))``. The codes are computed against the stored float32 scale, so ``codes * scale`` is the value
the GEMM sees; the row's largest element lands on ±448 (e4m3's largest finite value, whose conversion would
otherwise overflow to NaN: e4m3fn has no infinity, hence the clamp). ``FP8_MIN_SCALE`` keeps an all-zero row
(padding, a masked token) at codes 0 and a finite scale.

Why fuse: quantizing is a memory-bound pass of its own (read the bf16 row, write the codes and scales), plus
a launch, in front of every FP8 GEMM. RMSNorm and SwiGLU already hold the row in registers, so emitting
codes instead of bf16 costs them nothing extra, and the bf16 intermediate never reaches memory. The fused
kernels round every intermediate to the model dtype exactly as ``rmsnorm.py`` / ``activation.py`` do, so
their codes equal ``quantize_fp8`` of the unfused output: bit for bit for SwiGLU and under the interpreter;
compiled, the fused RMSNorm and ``rmsnorm.py`` do not always round alike (likely the order of the sum of
squares), so now and then a code moves by one step.

Triton's CPU interpreter rounds float32 → e4m3 wrongly (ties away from zero; a carry into the exponent is
dropped, 127.5 → 64; see ``kv_quant.py``): under it the kernels round onto the e4m3 grid by hand first
(``round_to_float_grid``), which makes the conversion exact. GPUs convert with ``cvt.rn.satfinite``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_dtype, check_last_dim_contiguous, interpreting, next_pow2
from ..pdl import launch_options, use_pdl, wait_for_previous
from ..activation import silu_and_mul_ref
from .fp8_ref import FP8_DTYPE, FP8_MIN_SCALE, num_groups, quantize_fp8_ref
from .quant import round_to_float_grid
from ..rmsnorm import norm_launch, norm_row, rms_norm_ref

# A per-token row up to this width is quantized from registers in one pass; wider rows take two passes over
# BLOCK-wide chunks (amax, then codes), the second reading the row back from L2. Wide enough for SwiGLU's
# 14336-wide rows (llama-3.1-8b) to take one pass: reading the row once beats reading it twice.
ROW_MAX_BLOCK = 16384

# What feeds the quantizer in _quant_rows_kernel (its PROLOGUE): x itself or silu(gate) * up.
_PLAIN, _SILU_MUL = 0, 1


# ------------------------------------------------------------------------------------------------ triton
@triton.jit
def _e4m3_codes(x, inv_scale, EXACT: tl.constexpr):
    """e4m3 codes of float32 ``x`` times ``inv_scale`` (broadcast by the caller), saturated at ±448."""
    y = tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)
    if EXACT:
        y = round_to_float_grid(y, 3, -6)
    return y.to(tl.float8e4nv)


@triton.jit
def _scale_of(amax, MIN_SCALE: tl.constexpr):
    """float32 scale(s) of rows (groups) with absolute maximum ``amax``; IEEE division, as torch divides."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), MIN_SCALE)


@triton.jit
def _store_quantized(x, Q, S, row, k0, K, s_col0, n_groups, stride_q, stride_s, BLOCK: tl.constexpr,
                     GROUP: tl.constexpr, MIN_SCALE: tl.constexpr, EXACT: tl.constexpr):
    """Quantize the float32 chunk ``x [BLOCK]`` (columns ``k0..k0+BLOCK`` of ``row``, zero past K) per GROUP-wide
    group and store its codes and its ``BLOCK // GROUP`` scales (from column ``s_col0`` of the scale row)."""
    cols = k0 + tl.arange(0, BLOCK)
    if GROUP == BLOCK:
        scale = _scale_of(tl.max(tl.abs(x), axis=0), MIN_SCALE)
        tl.store(Q + row * stride_q + cols, _e4m3_codes(x, tl.math.div_rn(1.0, scale), EXACT), mask=cols < K)
        tl.store(S + row * stride_s + s_col0, scale)
    else:
        xg = tl.reshape(x, (BLOCK // GROUP, GROUP))
        scale = _scale_of(tl.max(tl.abs(xg), axis=1), MIN_SCALE)
        codes = _e4m3_codes(xg, tl.math.div_rn(1.0, scale)[:, None], EXACT)
        tl.store(Q + row * stride_q + cols, tl.reshape(codes, (BLOCK,)), mask=cols < K)
        g = s_col0 + tl.arange(0, BLOCK // GROUP)
        tl.store(S + row * stride_s + g, scale, mask=g < n_groups)


@triton.jit
def _load_chunk(X, row, cols, K, stride_x, PROLOGUE: tl.constexpr):
    """float32 values of ``x`` (or of ``silu(gate) * up``, rounded as activation.py rounds) at ``cols``, 0 past K."""
    mask = cols < K
    if PROLOGUE == 1:
        gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(X + row * stride_x + K + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
    return tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _quant_rows_kernel(X, Q, S, K, n_groups, stride_x, stride_q, stride_s, PROLOGUE: tl.constexpr,
                       PER_TOKEN: tl.constexpr, ONE_BLOCK: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                       MIN_SCALE: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr = False):
    """Grid (rows, chunks). Per group: each program quantizes one BLOCK-wide chunk (BLOCK a multiple of GROUP).
    Per token: one program per row; ONE_BLOCK keeps the row in registers, else two passes over chunks."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if not PER_TOKEN:
        k0 = tl.program_id(1) * BLOCK
        x = _load_chunk(X, row, k0 + offs, K, stride_x, PROLOGUE)
        _store_quantized(x, Q, S, row, k0, K, k0 // GROUP, n_groups, stride_q, stride_s, BLOCK, GROUP,
                         MIN_SCALE, EXACT)
    elif ONE_BLOCK:
        x = _load_chunk(X, row, offs, K, stride_x, PROLOGUE)
        _store_quantized(x, Q, S, row, 0, K, 0, 1, stride_q, stride_s, BLOCK, BLOCK, MIN_SCALE, EXACT)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            amax = tl.maximum(amax, tl.abs(_load_chunk(X, row, k0 + offs, K, stride_x, PROLOGUE)))
        scale = _scale_of(tl.max(amax, axis=0), MIN_SCALE)
        inv = tl.math.div_rn(1.0, scale)
        for k0 in range(0, K, BLOCK):
            cols = k0 + offs
            x = _load_chunk(X, row, cols, K, stride_x, PROLOGUE)
            tl.store(Q + row * stride_q + cols, _e4m3_codes(x, inv, EXACT), mask=cols < K)
        tl.store(S + row * stride_s, scale)


@triton.jit
def _rms_norm_fp8_kernel(X, R, W, Q, S, hidden, n_groups, stride_x, stride_r, stride_q, stride_s, eps,
                         HAS_RESIDUAL: tl.constexpr, F32_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
                         GROUP: tl.constexpr, MIN_SCALE: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr = False):
    """rmsnorm.py's kernel (its ``norm_row``: same roundings, same one-block reduction) with a quantizing store."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    out = norm_row(x, R, W, row, cols, mask, stride_r, hidden, eps, HAS_RESIDUAL, F32_WEIGHT).to(tl.float32)
    _store_quantized(out, Q, S, row, 0, hidden, 0, n_groups, stride_q, stride_s, BLOCK, GROUP, MIN_SCALE, EXACT)


# ------------------------------------------------------------------------------------------------ launchers
def _check_group(group_size: int | None) -> None:
    if group_size is not None and (group_size < 16 or group_size & (group_size - 1)):
        raise ValueError(f"group_size must be None (per token) or a power of two >= 16, got {group_size}")


def _outputs(m: int, k: int, group_size: int | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=device)
    shape = (m,) if group_size is None else (m, num_groups(k, group_size))
    return q, torch.empty(shape, dtype=torch.float32, device=device)


def _quant_rows(x: torch.Tensor, k: int, group_size: int | None, prologue: int, block: int | None,
                num_warps: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    check_dtype("x", x)
    check_last_dim_contiguous("x", x)
    _check_group(group_size)
    m = x.shape[0]
    q, s = _outputs(m, k, group_size, x.device)
    if m == 0 or k == 0:
        return q, s.fill_(FP8_MIN_SCALE)
    per_token = group_size is None
    if block is None:  # measured on an H200 (bench_fp8.py --sweep --only act)
        block = min(next_pow2(k), ROW_MAX_BLOCK) if per_token else max(group_size, min(2048, next_pow2(k)))
    if not per_token and block % group_size:
        raise ValueError(f"block {block} must be a multiple of group_size {group_size}")
    one_block = per_token and block >= k
    grid = (m, 1 if per_token else triton.cdiv(k, block))
    if num_warps is None:
        num_warps = min(8, max(1, block // 512))
    pdl = use_pdl(x.device)
    _quant_rows_kernel[grid](
        x, q, s, k, 1 if per_token else s.shape[1], x.stride(0), q.stride(0), 1 if per_token else s.stride(0),
        PROLOGUE=prologue, PER_TOKEN=per_token, ONE_BLOCK=one_block, BLOCK=block,
        GROUP=block if per_token else group_size, MIN_SCALE=FP8_MIN_SCALE, EXACT=interpreting(), PDL=pdl,
        num_warps=num_warps, **launch_options(pdl),
    )
    return q, s


def quantize_fp8(x: torch.Tensor, group_size: int | None = None, *, block: int | None = None,
                 num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (float32/bfloat16/float16, last dim contiguous) -> ``(xq, x_scale)``: e4m3 codes ``[M, K]`` and
    float32 scales ``[M]`` (``group_size=None``, per token) or ``[M, ceil(K / group_size)]`` (per token per group)
    with ``x ≈ xq * x_scale`` (broadcast per row or per group).

    Per token, a row of up to ``ROW_MAX_BLOCK`` columns is read once into registers; wider rows are read twice
    (amax pass, codes pass). Per group, each program quantizes ``block`` columns (2048 by default; whole groups,
    so a program never needs another's amax). ``block``/``num_warps`` exist for the benchmark's sweeps.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got shape {tuple(x.shape)}")
    return _quant_rows(x, x.shape[1], group_size, _PLAIN, block, num_warps)


def silu_and_mul_fp8(x_gate_up: torch.Tensor, group_size: int | None = None, *, block: int | None = None,
                     num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8(silu_and_mul(x_gate_up), group_size)`` in one kernel: ``x_gate_up [M, 2I]`` = [gate | up]
    -> ``(xq [M, I] e4m3, x_scale [M] or [M, ceil(I / group_size)] float32)``, the down projection's input.

    ``silu(gate) * up`` is rounded to x's dtype as ``activation.py`` rounds it before quantizing, so the codes
    equal the unfused pair's. The bf16 ``[M, I]`` intermediate (the widest activation of the layer) is never
    written: the kernel reads ``2I`` values per row and writes ``I`` bytes plus the scales."""
    if x_gate_up.dim() != 2 or x_gate_up.shape[1] % 2:
        raise ValueError(f"x_gate_up must be [M, 2*I] (gate | up), got shape {tuple(x_gate_up.shape)}")
    return _quant_rows(x_gate_up, x_gate_up.shape[1] // 2, group_size, _SILU_MUL, block, num_warps)


def _rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                  group_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    check_dtype("x", x)
    check_dtype("weight", weight)
    check_last_dim_contiguous("x", x)
    _check_group(group_size)
    if x.dim() != 2:
        raise ValueError(f"x must be [M, H], got shape {tuple(x.shape)}")
    m, hidden = x.shape
    if weight.shape != (hidden,) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{hidden}], got {tuple(weight.shape)}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("residual must match x in shape and dtype")
        check_last_dim_contiguous("residual", residual)
    q, s = _outputs(m, hidden, group_size, x.device)
    if m == 0:
        return q, s
    base, num_warps = norm_launch(hidden)  # rmsnorm.py's block and warps: the same reduction, the same normed row
    block = base if group_size is None else max(base, group_size)
    res = x if residual is None else residual
    pdl = use_pdl(x.device)
    _rms_norm_fp8_kernel[(m,)](
        x, res, weight, q, s, hidden, 1 if group_size is None else s.shape[1], x.stride(0), res.stride(0),
        q.stride(0), 1 if group_size is None else s.stride(0), eps, HAS_RESIDUAL=residual is not None,
        F32_WEIGHT=weight.dtype == torch.float32, BLOCK=block, GROUP=block if group_size is None else group_size,
        MIN_SCALE=FP8_MIN_SCALE, EXACT=interpreting(), PDL=pdl,
        num_warps=num_warps, **launch_options(pdl),
    )
    return q, s


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8(rms_norm(x, weight, eps), group_size)`` in one kernel: ``x [M, H]`` -> ``(xq, x_scale)``."""
    return _rms_norm_fp8(x, None, weight, eps, group_size)


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fused_add_rms_norm`` emitting e4m3: sets ``residual <- x + residual`` in place (model dtype) and returns
    ``(xq, x_scale, residual)`` with ``(xq, x_scale) = quantize_fp8(rms_norm(residual), group_size)``.

    One program per row holds the whole row (as ``rmsnorm.py``), so the per-token amax and the per-group
    amaxes come from registers; the normed row is rounded to the model dtype before it is quantized, as the
    unfused ``quantize_fp8(fused_add_rms_norm(...))`` rounds it (see the module docstring for how equal)."""
    xq, x_scale = _rms_norm_fp8(x, residual, weight, eps, group_size)
    return xq, x_scale, residual


# ------------------------------------------------------------------------------------------- torch reference
def silu_and_mul_fp8_ref(x_gate_up: torch.Tensor, group_size: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`silu_and_mul_fp8`: HF's SwiGLU rounding, then :func:`quantize_fp8_ref`."""
    return quantize_fp8_ref(silu_and_mul_ref(x_gate_up), group_size)


def rms_norm_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`rms_norm_fp8` (HF's LlamaRMSNorm rounding, then :func:`quantize_fp8_ref`)."""
    return quantize_fp8_ref(rms_norm_ref(x, weight, eps), group_size)


def add_rms_norm_fp8_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`add_rms_norm_fp8` (updates ``residual`` in place)."""
    residual.add_(x)
    xq, x_scale = rms_norm_fp8_ref(residual, weight, eps, group_size)
    return xq, x_scale, residual
