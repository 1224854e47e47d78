"""The channel-scaled FP8 GEMM of decode-sized batches (``M`` up to a few dozen rows), split along K
(:func:`fp8_gemm_splitk`).

Such a product streams its weight, and a GEMM that gives each output tile one program leaves SMs idle while the
others stream: at 16 rows cuBLASLt's row-wise ``_scaled_mm`` tiles llama-3.1-8b's o and down projections 128 x 128,
32 programs for 132 SMs. Splitting K gives every SM a share: program ``(tile, s)`` sums the tile's product over the
``s``-th stretch of K in float32 and writes it to a workspace; the last of a tile's programs to finish (an atomic
ticket per tile) adds the stretches in order 0, 1, ..., applies the scales (and bias) and writes the output. The
order is fixed, so the result does not depend on which program comes last: replays and eager runs agree bit for bit.

Memory order: every thread's partial stores, a CTA barrier, then one ``atomic_add`` with acq_rel semantics at GPU
scope (the split-K semaphore pattern); the last program meets at a barrier after its acquire, loads the partials
with ``.cg`` (from L2, past its own L1) and puts the ticket back to zero, so the counters are ready for the next
launch without a memset. Two launches on one device must not overlap: under PDL the next kernel waits for this
one's grid to finish before it reads anything, and the engine runs its GEMMs on one stream.

The split count and tile come from :func:`splitk_config`, a rule measured on the GPU, not from autotuning.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .._utils import num_sms
from ..pdl import launch_options, use_pdl, wait_for_previous
from .fp8_gemm import _check_fp8_operands

MAX_TILES = 1 << 14  # tickets held per device; a launch with more tiles runs unsplit
_tickets: dict[torch.device, torch.Tensor] = {}


@dataclass(frozen=True)
class SplitKConfig:
    """Tile ``block_m`` x ``block_n`` (``block_k`` deep), ``split`` stretches of K, warps and pipeline depth.
    ``fast_accum``: let the tensor cores accumulate a whole stretch in their reduced-precision adder (sm_90's FP8
    MMA keeps ~14 bits of mantissa); by default each ``block_k``-deep product is added to a float32 accumulator, as
    cuBLAS does by default (sweeps only)."""

    block_m: int
    block_n: int
    split: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    fast_accum: bool = False


MAX_SPLIT = 8
PROGRAMS_PER_SM = 2  # a 64 x 64 tile's four stages take 64 KB of shared memory, a 64 x 128 one's 96 KB
MIN_STRETCH_STEPS = 10  # k-steps (128 bytes of a row each) a split program streams at least: fewer, fixed costs show


def splitk_config(m: int, n: int, k: int, sms: int) -> SplitKConfig:
    """The tile and split of an ``[m, k] x [k, n]`` GEMM on ``sms`` multiprocessors, for decode-sized ``m``.

    Such a GEMM streams its weight: what counts is that every SM has about two programs loading at once. Tiles are
    64 rows by 64 columns, or 128 columns where 64-wide ones alone would pass two programs an SM (llama-3.1-8b's
    gate_up); K is then split into as many stretches as keep the grid within two programs an SM and each stretch at
    least ``MIN_STRETCH_STEPS`` k-steps (128 bytes of a row each) long. On an H100 at M = 4..64 this picked the
    fastest of 15 FP8 candidates or one within 6% at llama-3.1-8b's four projections
    (``benchmarks/bench_decode_gemm.py``; qkv split 2, o 3, down 4, gate_up 1)."""
    block_m, block_k = 64, 128
    slots = PROGRAMS_PER_SM * sms
    block_n = 64 if triton.cdiv(m, block_m) * triton.cdiv(n, 64) <= slots else 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    by_slots = max(1, slots // tiles)
    by_length = max(1, triton.cdiv(k, block_k) // MIN_STRETCH_STEPS)
    split = min(by_slots, by_length, MAX_SPLIT) if tiles <= MAX_TILES else 1
    return SplitKConfig(block_m, block_n, split, block_k)


@triton.jit
def _splitk_kernel(A, AS, B, BS, BIAS, C, WS, TICKETS, M, N, K, K_STRETCH, stride_am, stride_bn, stride_cm,
                   HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PROMOTE: tl.constexpr = False,
                   PDL: tl.constexpr = False):
    """C[M, N] = (A · Bᵀ) * AS[:, None] * BS[None, :] (+ BIAS), K summed in SPLIT stretches of K_STRETCH.
    PROMOTE: each BLOCK_K-deep product is added to the float32 accumulator."""
    pid = tl.program_id(0)
    stretch = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    # The row tiles of one column tile are neighbours in launch order: they read the same weight tile, once
    # from HBM and again from L2.
    pid_m = pid % num_pid_m
    pid_n = pid // num_pid_m
    # Rows and columns past M / N wrap around (valid addresses, no load masks); their results are not stored.
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    k0 = stretch * K_STRETCH
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = A + rm.to(tl.int64)[:, None] * stride_am + (k0 + rk)[None, :]
    b_ptrs = B + rn.to(tl.int64)[None, :] * stride_bn + (k0 + rk)[:, None]  # [BLOCK_K, BLOCK_N], K-major
    wait_for_previous(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for j in range(0, tl.cdiv(tl.minimum(K - k0, K_STRETCH), BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k0 - j * BLOCK_K
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        if PROMOTE:  # each k-step's product promoted to the float32 accumulator (sm_90: fast accumulation by default)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    om = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    on = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (om < M)[:, None] & (on < N)[None, :]
    if SPLIT > 1:
        tile = om.to(tl.int64)[:, None] * N + on[None, :]
        tl.store(WS + (stretch * M).to(tl.int64) * N + tile, acc, mask=inside)
        tl.debug_barrier()  # every thread's partial stores come before the release below
        ticket = tl.atomic_add(TICKETS + pid, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            tl.debug_barrier()  # no thread loads a partial before the acquire
            acc = tl.load(WS + tile, mask=inside, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLIT):
                acc += tl.load(WS + (s * M).to(tl.int64) * N + tile, mask=inside, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(TICKETS + pid, 0, sem="relaxed", scope="gpu")
            _store_scaled(acc, AS, BS, BIAS, C, om, on, rm, rn, stride_cm, inside, HAS_BIAS)
    else:
        _store_scaled(acc, AS, BS, BIAS, C, om, on, rm, rn, stride_cm, inside, HAS_BIAS)


@triton.jit
def _store_scaled(acc, AS, BS, BIAS, C, om, on, rm, rn, stride_cm, inside, HAS_BIAS: tl.constexpr):
    """The float32 product times the token and channel scales, plus bias, rounded once into C."""
    acc = acc * tl.load(AS + rm)[:, None] * tl.load(BS + rn)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + rn).to(tl.float32)[None, :]
    tl.store(C + om.to(tl.int64)[:, None] * stride_cm + on[None, :], acc.to(C.dtype.element_ty), mask=inside)


def _tickets_for(device: torch.device) -> torch.Tensor | None:
    """The device's ticket counters (zeros between launches). Made on first use, which is eager: the engine warms
    each CUDA-graph bucket up before capturing it. None while a capture is running and none exist yet."""
    tickets = _tickets.get(device)
    if tickets is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        tickets = _tickets[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return tickets


def fp8_gemm_splitk(xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                    config: SplitKConfig | None = None) -> torch.Tensor:
    """Channel-scaled FP8 GEMM -> ``[M, N]`` in ``out_dtype``; the operands as :func:`fp8_gemm_channel` takes them
    (``xq [M, K]`` e4m3 with per-token ``x_scale [M]``, ``w [N, K]`` e4m3 with per-row ``w_scale [N]``, float32
    scales, ``bias [N]`` added in float32), both operands with a contiguous last dim. ``config`` overrides
    :func:`splitk_config` (sweeps and tests)."""
    m, k = xq.shape
    n = w.shape[0]
    _check_fp8_operands(xq, x_scale, w, w_scale, bias, ((m,), (n,)))
    if not x_scale.is_contiguous() or not w_scale.is_contiguous():
        raise ValueError("x_scale and w_scale must be contiguous")
    if xq.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("both operands need a contiguous last dim")
    if bias is not None and not bias.is_contiguous():
        raise ValueError("bias must be contiguous")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    cfg = config or splitk_config(m, n, k, num_sms(xq.device))
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    tickets = _tickets_for(xq.device) if cfg.split > 1 and tiles <= MAX_TILES else None
    split = cfg.split if tickets is not None else 1
    stretch = triton.cdiv(triton.cdiv(k, split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, stretch)  # no empty stretch
    ws = torch.empty(split, m, n, dtype=torch.float32, device=xq.device) if split > 1 else out
    pdl = use_pdl(xq.device)
    _splitk_kernel[(tiles, split)](
        xq, x_scale, w, w_scale, bias if bias is not None else out, out, ws,
        tickets if tickets is not None else out, m, n, k, stretch, xq.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT=split, EVEN_K=k % cfg.block_k == 0, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PROMOTE=not cfg.fast_accum, PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **launch_options(pdl),
    )
    return out
