"""Matrix-vector product for one-token steps (batch-1 decode): y = x Wᵀ (+ b) with x ``[1, K]``.

At batch 1 every linear layer is a pure weight stream: each weight byte is read once for two
FLOPs. cuBLAS's GEMM kernels for M=1 reach 30-50% of HBM bandwidth on the 8-12 MB matrices of a
1B model (measured on an H200, llama-3.2-1b shape: qkv and o_proj ~5.9 us each, down_proj 11.6 us
plus a split-K reduce), because a few hundred KB per SM is too little to amortise their tiling.
Here each program streams ``BLOCK_N`` whole weight rows with wide loads and keeps a float32
partial sum per column lane, reducing it once at the end: no split-K pass, no shared memory, and
many small programs in flight on every SM. On an H200 the 64 projections of a llama-3.2-1b decode step
take 552 us in one CUDA graph under PDL, 83% of HBM bandwidth (``benchmarks/gemv_chain.py``).

Optional prologues fold the elementwise op before a projection into it, saving that op's launch
(~2 us each at batch 1, three per layer): :func:`gemv_silu_mul` (SwiGLU before down_proj), its GeGLU twin
:func:`gemv_gelu_tanh_mul` (Gemma), :func:`gemv_rms_norm` (residual add + RMSNorm before qkv and gate_up;
a float32 norm weight rounds as Gemma's ``1 + w`` norms), and Qwen3.5's two gated inputs (``gemv_gated.py``). They
are constexpr branches of the one kernel (``gemv_prologue.py``), so the plain :func:`gemv` compiles to what it was.
The torch references are in ``gemv_ref.py``.

Each also takes an FP8 (e4m3) weight with its float32 ``weight_scale`` (the formats of ``fp8_gemm.py``): ``[N]``
per output row ("channel") or row-expanded ``[N, ceil(K/128)]`` per 128x128 block ("block"). The weight is
dequantized in registers: fp8 loads, converted to float32 for the products with the (unquantized) input
vector; a channel scale multiplies each row's sum once at the end, a block scale each 128-column piece's
products before they join the row's accumulator. The input keeps its precision, unlike the batched path,
which quantizes it. Half the weight bytes do not halve the time (``benchmarks/bench_fp8.py``; ``gemv_config.py``).

The launch configs and the rules that choose them per shape are in ``gemv_config.py``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._utils import check_dtype, next_pow2
from ..pdl import launch_options, use_pdl, wait_for_previous
from ..quant.fp8_ref import FP8_DTYPE, FP8_GROUP, num_groups
from .gemv_config import (BLOCK, CHANNEL, GELU_MUL, NO_SCALE, PLAIN, RMS_NORM, SILU_MUL, GemvConfig, default_config,
                          default_fp8_config, lora_shrink_config)
from .gemv_epilogue import RopeStore, rope_rows, rope_store_epilogue
from .gemv_lora import GemvLora, lora_delta, lora_load_rows
from .gemv_prologue import input_chunk, sum_squares


# Widest single block the RMS prologue sums in one tl.sum (like rmsnorm.py's one next_pow2(K) block); wider
# rows are summed block by block, which changes the float32 summation order. Module-level so tests can shrink it.
RMS_MAX_BLOCK = 8192
LORA_SHRINK, LORA_EXPAND = 1, 2  # the kernel's LORA (0: none): what a launch does with an adapter (gemv_lora.py)
LORA_MAX_SPLIT = 4  # a shrink's parts of K at most (its partial sums, which the expand epilogue adds)


@triton.jit
def _weight_tile(w_ptrs, k0, rows, cols, N, K, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    if EVEN_K and EVEN_N:
        return tl.load(w_ptrs + k0)
    return tl.load(w_ptrs + k0, mask=(rows < N)[:, None] & (k0 + cols < K)[None, :], other=0.0)


@triton.jit
def _products(w, x, WS, rows, k0, N, stride_ws, n_groups, SCALE: tl.constexpr, EVEN_N: tl.constexpr,
              EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NSUB: tl.constexpr,
              SUB: tl.constexpr, GROUP: tl.constexpr):
    """float32 products of the weight tile ``w [BLOCK_N, BLOCK_K]`` (columns ``k0..``) with the input chunk ``x``;
    under block scaling each SUB-wide piece (``NSUB`` per tile, SUB = min(BLOCK_K, GROUP)) times its scale.
    An e4m3 tile converts with Triton's cast (cvt to f16x2, then to float32)."""
    p = w.to(tl.float32) * x.to(tl.float32)[None, :]
    if SCALE == 2:
        if NSUB == 1:  # the tile lies inside one group: one scale per row
            s_ptrs = WS + rows.to(tl.int64) * stride_ws + k0 // GROUP
            if EVEN_N:
                s = tl.load(s_ptrs)
            else:
                s = tl.load(s_ptrs, mask=rows < N, other=0.0)
            p = p * s[:, None]
        else:
            g = (k0 + tl.arange(0, NSUB) * SUB) // GROUP
            s_ptrs = WS + rows.to(tl.int64)[:, None] * stride_ws + g[None, :]
            if EVEN_N and EVEN_K:
                s = tl.load(s_ptrs)
            else:
                s = tl.load(s_ptrs, mask=(rows < N)[:, None] & (g < n_groups)[None, :], other=0.0)
            p = tl.reshape(tl.reshape(p, (BLOCK_N, NSUB, SUB)) * s[:, :, None], (BLOCK_N, BLOCK_K))
    return p


@triton.jit
def _gemv_kernel(X, W, B, Y, R, NW, R_OUT, N_OUT, N, K, stride_wn, eps, HAS_BIAS: tl.constexpr,
                 EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PROLOGUE: tl.constexpr = 0,
                 HAS_RESIDUAL: tl.constexpr = False, RMS_BLOCK: tl.constexpr = 1, EVEN_R: tl.constexpr = True,
                 ONE_BLOCK: tl.constexpr = True, PDL: tl.constexpr = False, WS=None, stride_ws=0, n_groups=1,
                 SCALE: tl.constexpr = 0, NSUB: tl.constexpr = 1, SUB: tl.constexpr = 1,
                 GROUP: tl.constexpr = 128, F32_NORM: tl.constexpr = False, stride_r=0, HEAD: tl.constexpr = 1,
                 LORA: tl.constexpr = 0, LORA_SLOT=None, n_loras=0, k_part=0,
                 XA=None, stride_xa=0, LB=None, stride_lb=0, shard_end0=0, shard_end1=0, LORA_RANK: tl.constexpr = 1,
                 LORA_RP: tl.constexpr = 1, LORA_SPLIT: tl.constexpr = 1, LORA_SPLIT_P: tl.constexpr = 1,
                 WRITE_NORMED: tl.constexpr = False, POS=None, CS=None, stride_c=0, KC=None, VC=None, SLOTS=None,
                 ROPE_STORE: tl.constexpr = False, ROT_HEAD: tl.constexpr = 2, ROPE_Q_HEADS: tl.constexpr = 1,
                 ROPE_KV_HEADS: tl.constexpr = 1, STAGES: tl.constexpr = 1):
    pid = tl.program_id(0)
    k_lo = 0
    k_hi = K
    if LORA == 1:  # LORA_SHRINK: the slot's A rows (gemv_lora.py; the slot and A are set before a graph's replay, so
        slot = tl.load(LORA_SLOT)  # both may be read before the PDL wait); an idle slot's programs still wait
        if (slot < 0) | (slot >= n_loras):
            wait_for_previous(PDL)
            return
        W += slot.to(tl.int64) * N * stride_wn
        k_lo = tl.program_id(1) * k_part  # this program's part of K; its partial sums go to its own row of Y
        k_hi = tl.minimum(K, k_lo + k_part)
        Y += tl.program_id(1) * N
    if ROPE_STORE:  # rotation pairs (gemv_epilogue.py)
        rows = rope_rows(pid, ROT_HEAD, BLOCK_N)
    else:
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]
    if PDL:  # the first weight tile streams in while the previous kernel drains (weights never change)
        w_first = _weight_tile(w_ptrs, k_lo, rows, cols, N, K, EVEN_N, EVEN_K)
        wait_for_previous(PDL)
    if LORA == 2:  # LORA_EXPAND: the adapter's operands, in flight during the weight stream
        lora_xa, lora_b = lora_load_rows(rows, N, LORA_SLOT, n_loras, XA, stride_xa, LB, stride_lb, shard_end0,
                                         shard_end1, LORA_RANK, LORA_RP, LORA_SPLIT, LORA_SPLIT_P)
    inv_rms = 1.0
    if PROLOGUE == 2:  # every program needs the whole row's mean square before its first chunk
        ss = sum_squares(X, R, K, HAS_RESIDUAL, RMS_BLOCK, EVEN_R, ONE_BLOCK)
        inv_rms = tl.rsqrt(ss / K + eps)
    if LORA == 1:  # the base launch writes the residual
        write_residual = pid < 0
    else:
        write_residual = pid == 0
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    first = k_lo
    if PDL:  # the first chunk with the prefetched tile
        x = input_chunk(X, R, NW, R_OUT, N_OUT, k_lo + cols, K, inv_rms, write_residual, eps, stride_r, PROLOGUE,
                        HAS_RESIDUAL, not EVEN_K, F32_NORM, HEAD, BLOCK_K, WRITE_NORMED)
        acc += _products(w_first, x, WS, rows, k_lo, N, stride_ws, n_groups, SCALE, EVEN_N, EVEN_K, BLOCK_N, BLOCK_K,
                         NSUB, SUB, GROUP)
        first = k_lo + BLOCK_K
    for k0 in tl.range(first, k_hi, BLOCK_K, num_stages=STAGES):  # gemv_config.STREAM_STAGES
        x = input_chunk(X, R, NW, R_OUT, N_OUT, k0 + cols, K, inv_rms, write_residual, eps, stride_r, PROLOGUE,
                        HAS_RESIDUAL, not EVEN_K, F32_NORM, HEAD, BLOCK_K, WRITE_NORMED)
        w = _weight_tile(w_ptrs, k0, rows, cols, N, K, EVEN_N, EVEN_K)
        acc += _products(w, x, WS, rows, k0, N, stride_ws, n_groups, SCALE, EVEN_N, EVEN_K, BLOCK_N, BLOCK_K,
                         NSUB, SUB, GROUP)
    y = tl.sum(acc, axis=1)
    if SCALE == 1:
        y *= tl.load(WS + rows, mask=rows < N, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=rows < N, other=0.0).to(tl.float32)
    if LORA == 2:
        y += lora_delta(lora_xa, lora_b)
    if ROPE_STORE:
        rope_store_epilogue(y, Y, rows, pid, POS, CS, stride_c, KC, VC, SLOTS, ROPE_Q_HEADS, ROPE_KV_HEADS, ROT_HEAD,
                            BLOCK_N)
    else:
        tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rows < N)


def _check_weight(weight: torch.Tensor, bias: torch.Tensor | None, weight_scale: torch.Tensor | None = None) -> int:
    """Check the weight (and its scale and bias) and return its scaling (``NO_SCALE``, ``CHANNEL``, ``BLOCK``)."""
    if weight.stride(1) != 1:
        raise ValueError("weight rows must be contiguous")
    n, k = weight.shape
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")
    if weight.dtype != FP8_DTYPE:
        if weight_scale is not None:
            raise ValueError(f"weight_scale is for a {FP8_DTYPE} weight, got a {weight.dtype} weight")
        return NO_SCALE
    if weight_scale is None:
        raise ValueError(f"a {FP8_DTYPE} weight needs its weight_scale ([N] or [N, ceil(K/128)] float32)")
    if weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous() or \
            tuple(weight_scale.shape) not in ((n,), (n, num_groups(k))):
        raise ValueError(f"weight_scale must be a contiguous float32 [{n}] (per row) or [{n}, {num_groups(k)}] "
                         f"(per 128x128 block, row-expanded), got {weight_scale.dtype} {list(weight_scale.shape)}")
    return CHANNEL if weight_scale.dim() == 1 else BLOCK


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig | None,
            prologue: int = PLAIN, residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
            new_residual: torch.Tensor | None = None, eps: float = 0.0, weight_scale: torch.Tensor | None = None,
            scale: int = NO_SCALE, gate: torch.Tensor | None = None, lora: GemvLora | None = None,
            normed_out: torch.Tensor | None = None, rope_store: RopeStore | None = None) -> torch.Tensor:
    """One launch (two with ``lora``: its shrink first, over the same prologue); ``gate`` ``[1, H, D]`` (its heads at
    any stride) is the gated prologues' second input; ``normed_out`` receives the RMS prologue's normed row;
    ``rope_store``: the rotary and cache-store epilogue (``gemv_epilogue.py``)."""
    n, k = weight.shape
    cfg = config or (default_config(n, k, prologue) if scale == NO_SCALE else default_fp8_config(n, k, prologue, scale))
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    inputs = dict(prologue=prologue, residual=residual, norm_weight=norm_weight, eps=eps, gate=gate)
    extra: dict = {}
    if lora is not None:
        lora.check(n, k, x.dtype)
        rows = lora.a_stack.shape[1] * lora.a_stack.shape[2]
        shrink = lora_shrink_config(rows, k, prologue)
        split = min(triton.cdiv(k, shrink.block_k), LORA_MAX_SPLIT)
        k_part = triton.cdiv(triton.cdiv(k, split), shrink.block_k) * shrink.block_k  # whole chunks: no overlap
        split = triton.cdiv(k, k_part)  # and no empty part (the first chunk of each is loaded unmasked)
        xa = torch.empty(split, rows, dtype=torch.float32, device=x.device)
        _run(x, lora.shrink_weight(), rows, None, shrink, xa, None, NO_SCALE,
             dict(LORA=LORA_SHRINK, LORA_SLOT=lora.slot, n_loras=lora.a_stack.shape[0], k_part=k_part), split,
             **inputs)
        extra = dict(LORA=LORA_EXPAND, **lora.expand_args(xa))
    if normed_out is not None:
        extra = dict(extra, WRITE_NORMED=True)
    if rope_store is not None:
        if lora is not None:
            raise ValueError("rope_store: not with a LoRA adapter (its rows are not the epilogue's pairs)")
        extra = dict(extra, **rope_store.kernel_args(n, x.dtype, cfg.block_n))
    _run(x, weight, n, bias, cfg, y, weight_scale, scale, extra, new_residual=new_residual,
         normed_out=normed_out, **inputs)
    return y


def _run(x: torch.Tensor, weight: torch.Tensor, n: int, bias: torch.Tensor | None, cfg: GemvConfig, y: torch.Tensor,
         weight_scale: torch.Tensor | None, scale: int, extra: dict, parts: int = 1, *, prologue: int,
         residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float, gate: torch.Tensor | None,
         new_residual: torch.Tensor | None = None, normed_out: torch.Tensor | None = None) -> None:
    """The kernel over ``weight``'s first ``n`` rows (a LoRA shrink: the slot's rows, which the kernel finds, in
    ``parts`` parts of K)."""
    k = weight.shape[1]
    sub = min(cfg.block_k, FP8_GROUP)
    if scale == BLOCK and (cfg.block_k & (cfg.block_k - 1)):
        raise ValueError(f"block-scaled weights need a power-of-two block_k, got {cfg.block_k}")
    rms_block = min(next_pow2(k), RMS_MAX_BLOCK)
    pdl = use_pdl(x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n), parts)](
        x, weight, bias if bias is not None else weight, y,
        residual if residual is not None else gate if gate is not None else x,
        norm_weight if norm_weight is not None else x,
        new_residual if new_residual is not None else y, normed_out if normed_out is not None else y, n, k,
        weight.stride(0), eps,
        HAS_BIAS=bias is not None, EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PROLOGUE=prologue, HAS_RESIDUAL=residual is not None,
        RMS_BLOCK=rms_block, EVEN_R=k % rms_block == 0, ONE_BLOCK=rms_block >= k, PDL=pdl,
        WS=weight_scale if weight_scale is not None else y, stride_ws=weight_scale.stride(0) if scale == BLOCK else 0,
        n_groups=num_groups(k), SCALE=scale, NSUB=cfg.block_k // sub, SUB=sub, GROUP=FP8_GROUP,
        F32_NORM=norm_weight is not None and norm_weight.dtype == torch.float32,
        stride_r=gate.stride(1) if gate is not None else 0, HEAD=gate.shape[2] if gate is not None else 1,
        STAGES=cfg.num_stages, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **extra, **launch_options(pdl),
    )


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, *, weight_scale: torch.Tensor | None = None,
         lora: GemvLora | None = None) -> torch.Tensor:
    """``x`` [1, K] times ``weight`` [N, K] transposed (+ ``bias`` [N]) -> [1, N] in x's dtype.

    Products accumulate in float32 and round once, like a GEMM; only the summation order differs. An e4m3
    ``weight`` comes with ``weight_scale`` (``[N]`` or ``[N, ceil(K/128)]`` float32, see the module docstring).
    ``lora``: the token's adapter added before the rounding (``gemv_lora.py``; also in the fused variants).
    """
    check_dtype("x", x)
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [1, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    scale = _check_weight(weight, bias, weight_scale)
    return _launch(x, weight, bias, config, weight_scale=weight_scale, scale=scale, lora=lora)


def gemv_silu_mul(x_gate_up: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None, *,
                  weight_scale: torch.Tensor | None = None, lora: GemvLora | None = None) -> torch.Tensor:
    """``gemv(silu_and_mul(x_gate_up), weight)`` in one launch: ``x_gate_up`` [1, 2*K] = [gate | up], ``weight``
    [N, K] (the MLP's down projection) -> [1, N].

    Why: at batch 1 the activation is a ~2 us kernel of its own over a few KB, launched once per layer (16 on
    llama-3.2-1b), for a vector the down projection reads next anyway. Here every program recomputes
    ``silu(gate) * up`` for its own K chunk as it streams its weight rows; the vector stays in L2, so the
    recomputation costs a few FLOPs per weight row, while the launch and the [1, K] round trip go away (see
    ``gemv_config.default_config`` for why this variant runs eight warps).

    The roundings are activation.py's (silu in float32 rounded to the dtype, then the product rounded), so the
    vector fed to the products is bit-identical to ``silu_and_mul``'s; ``y`` matches ``gemv`` of it exactly
    under the same ``config``, and up to float32 summation order under the defaults, whose warp counts differ
    (on an H200 bfloat16 outputs still came out identical on the llama/qwen shapes; float32 ones within an ulp).
    """
    return _gated(x_gate_up, weight, config, weight_scale, SILU_MUL, lora)


def gemv_gelu_tanh_mul(x_gate_up: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None = None, *,
                       weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``gemv(gelu_tanh_and_mul(x_gate_up), weight)`` in one launch: :func:`gemv_silu_mul` for Gemma's GeGLU."""
    return _gated(x_gate_up, weight, config, weight_scale, GELU_MUL)


def _gated(x_gate_up: torch.Tensor, weight: torch.Tensor, config: GemvConfig | None,
           weight_scale: torch.Tensor | None, prologue: int, lora: GemvLora | None = None) -> torch.Tensor:
    check_dtype("x_gate_up", x_gate_up)
    if x_gate_up.dim() != 2 or x_gate_up.shape[0] != 1 or weight.dim() != 2:
        raise ValueError(f"expected x_gate_up [1, 2*K] and weight [N, K], got {tuple(x_gate_up.shape)} and "
                         f"{tuple(weight.shape)}")
    width = x_gate_up.shape[1]
    if width % 2:
        raise ValueError(f"x_gate_up width must be even ([gate | up]), got {width}")
    if width != 2 * weight.shape[1]:
        raise ValueError(f"x_gate_up width must be 2*K = {2 * weight.shape[1]} for weight {tuple(weight.shape)}, "
                         f"got {width}")
    if not x_gate_up.is_contiguous():
        raise ValueError("x_gate_up must be contiguous")
    scale = _check_weight(weight, None, weight_scale)
    return _launch(x_gate_up, weight, None, config, prologue=prologue, weight_scale=weight_scale, scale=scale,
                   lora=lora)


def gemv_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None, *,
                  weight_scale: torch.Tensor | None = None, lora: GemvLora | None = None,
                  normed_out: torch.Tensor | None = None, rope_store: RopeStore | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``gemv(fused_add_rms_norm(x, residual, norm_weight, eps), weight, bias)`` in one launch -> ``(y, new_residual)``.

    ``x`` and ``residual`` [1, K] (``residual`` may be None: then plain ``rms_norm(x)``), ``norm_weight`` [K],
    ``weight`` [N, K], ``bias`` [N] or None; ``y`` is [1, N].

    Why: at batch 1 the norm before qkv and before gate_up is a ~2 us launch twice per layer (32 on
    llama-3.2-1b) over a 4 KB row. Folding it into the projection that consumes it removes the launch: each
    program first sums the squares of the whole row (one tl.sum over a next_pow2(K) block, the reduction
    shape of rmsnorm.py, so the result tends to be bit-identical to ``fused_add_rms_norm``; rows wider than
    ``RMS_MAX_BLOCK`` are summed block by block), then normalises each K chunk as it streams its weight rows.
    The row is a few KB and stays in L2, so every program re-reading it is cheap next to its weight rows, but
    the first pass delays each program's weight stream: the fusion saves about the launch on a narrow
    product such as llama-3.2-1b's qkv, and nothing on the widest products, whose thousands of programs each
    pay the first pass. Under programmatic dependent launch (``pdl.py``) the kernel loads
    its first weight tile before that pass, while it waits for the previous kernel.

    Unlike ``fused_add_rms_norm``, ``residual`` is NOT updated in place: other programs are still reading it.
    ``x + residual`` (rounded to the dtype) is written to a fresh ``new_residual`` by program 0 alone; with no
    residual, ``new_residual`` is ``x`` itself. The inputs are left unmodified. ``normed_out`` (a contiguous
    ``[1, K]`` of x's dtype), when given, receives the normed row itself, also from program 0: a MoE router's
    launch keeps it for the experts, which read it next (``ops/one_token.py``). ``rope_store`` (a qkv projection):
    q and k come out rotated and k, v go into the token's cache slot, as ``rope_store_kv`` after this launch would
    leave them (``gemv_epilogue.py``).
    """
    check_dtype("x", x)
    check_dtype("norm_weight", norm_weight)
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [1, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    k = x.shape[1]
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or not residual.is_contiguous()):
        raise ValueError(f"residual must be a contiguous {tuple(x.shape)} {x.dtype} like x, got "
                         f"{tuple(residual.shape)} {residual.dtype}")
    if norm_weight.shape != (k,) or not norm_weight.is_contiguous():
        raise ValueError(f"norm_weight must be a contiguous [{k}], got {tuple(norm_weight.shape)}")
    scale = _check_weight(weight, bias, weight_scale)
    if normed_out is not None and (normed_out.shape != x.shape or normed_out.dtype != x.dtype
                                   or not normed_out.is_contiguous()):
        raise ValueError(f"normed_out must be a contiguous {tuple(x.shape)} {x.dtype} like x, got "
                         f"{tuple(normed_out.shape)} {normed_out.dtype}")
    new_residual = x if residual is None else torch.empty_like(x)
    y = _launch(x, weight, bias, config, prologue=RMS_NORM, residual=residual, norm_weight=norm_weight,
                new_residual=new_residual if residual is not None else None, eps=eps, weight_scale=weight_scale,
                scale=scale, lora=lora, normed_out=normed_out, rope_store=rope_store)
    return y, new_residual
