"""Matrix-vector product for one-token steps (batch-1 decode): y = x Wᵀ (+ b) with x ``[1, K]``.

At batch 1 every linear layer is a pure weight stream: each weight byte is read once for two
FLOPs. cuBLAS's GEMM kernels for M=1 reach 30-50% of HBM bandwidth on the 8-12 MB matrices of a
1B model (measured on an H200, llama-3.2-1b shape: qkv and o_proj ~5.9 us each, down_proj 11.6 us
plus a split-K reduce), because a few hundred KB per SM is too little to amortise their tiling.
Here each program streams ``BLOCK_N`` whole weight rows with wide loads and keeps a float32
partial sum per column lane, reducing it once at the end: no split-K pass, no shared memory, and
many small programs in flight on every SM. Measured in the engine (llama-3.2-1b shape, batch 1,
``benchmarks/profile_steps.py --batch1``): 580 us of linear layers per step against cuBLAS's 697 us,
~70% of bandwidth, the rest being each kernel's ramp-up (``bench_kernels.py --only gemv --sweep``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._utils import check_dtype, next_pow2


@dataclass(frozen=True)
class GemvConfig:
    """Rows per program, columns per step, warps. Four rows won on every layer shape of the 0.6B and 1B
    models on an H200 (sweep of 4/8/16 rows x 512/1024/2048 columns x 4/8 warps; the column width
    moved results by under 5%)."""

    block_n: int = 4
    block_k: int = 1024
    num_warps: int = 4


@triton.jit
def _gemv_kernel(X, W, B, Y, N, K, stride_wn, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr,
                 EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_ptrs = W + rows.to(tl.int64)[:, None] * stride_wn + cols[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K and EVEN_N:
            x = tl.load(X + k0 + cols)
            w = tl.load(w_ptrs + k0)
        else:
            k_mask = k0 + cols < K
            x = tl.load(X + k0 + cols, mask=k_mask, other=0.0)
            w = tl.load(w_ptrs + k0, mask=(rows < N)[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rows < N)


def default_config(k: int) -> GemvConfig:
    return GemvConfig(block_k=min(1024, next_pow2(k)))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """``x`` [1, K] times ``weight`` [N, K] transposed (+ ``bias`` [N]) -> [1, N] in x's dtype.

    Products accumulate in float32 and round once, like a GEMM; only the summation order differs.
    """
    check_dtype("x", x)
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"expected x [1, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.stride(1) != 1 or not x.is_contiguous():
        raise ValueError("weight rows and x must be contiguous")
    n, k = weight.shape
    cfg = config or default_config(k)
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else weight, y, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, EVEN_N=n % cfg.block_n == 0, EVEN_K=k % cfg.block_k == 0,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
    )
    return y


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 products and sums, rounded once to x's dtype (the tests' oracle)."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
