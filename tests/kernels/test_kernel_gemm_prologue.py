"""The few-row GEMM with a norm or SwiGLU prologue (``gemm_prologue.py``) against the unfused torch path: the norm
(with its residual add) or the activation, then ``F.linear``. On the CPU through Triton's interpreter; the gpu twin
runs the engine's shapes compiled."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testlib import EXACT_BF16, REL_TOL, rel_err

from minfer.kernels.activation import silu_and_mul_ref
from minfer.kernels.gemm.gemm_prologue import GemmConfig, gemm_rms_norm, gemm_rows, gemm_silu_mul
from minfer.kernels.rmsnorm import fused_add_rms_norm_ref, rms_norm_ref

CONFIGS = [None, GemmConfig(16, 32, 32), GemmConfig(32, 16, 64, num_stages=1)]


def _linear_ref(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(a.double(), w.double(), None if b is None else b.double())


def _to_bf16_toward_zero(t: torch.Tensor) -> torch.Tensor:
    """float32 -> bfloat16 by dropping the low 16 bits: the interpreter's rounding (kernel_testlib.EXACT_BF16)."""
    return (t.float().contiguous().view(torch.int32) & -65536).view(torch.float32).bfloat16()


def _silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with the kernel's two roundings: torch's on a GPU, toward zero under the interpreter (the
    kernel rounds twice per element before the product, so the interpreter's bias would add up past the
    tolerance against a round-to-nearest reference)."""
    if gate_up.dtype != torch.bfloat16 or EXACT_BF16:
        return silu_and_mul_ref(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = _to_bf16_toward_zero(F.silu(gate)).float()
    return _to_bf16_toward_zero(act * up)


def _norm_ref(x: torch.Tensor, residual: torch.Tensor | None, nw: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rms_norm(x + residual) and the new residual, rounded as rmsnorm.py rounds: torch's rounding on a GPU or
    in float32, toward zero in bfloat16 under the interpreter (three biased roundings per element add up to
    about 0.7% on their own, too near the 1% tolerance against a round-to-nearest reference)."""
    if x.dtype != torch.bfloat16 or EXACT_BF16:
        if residual is None:
            return rms_norm_ref(x, nw, eps), None
        new_res = residual.clone()
        return fused_add_rms_norm_ref(x, new_res, nw, eps), new_res
    h = x if residual is None else _to_bf16_toward_zero(x.float() + residual.float())
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if nw.dtype != torch.float32:  # Gemma's float32 weight multiplies before the one rounding
        normed = _to_bf16_toward_zero(normed).float()
    return _to_bf16_toward_zero(nw.float() * normed), None if residual is None else h


@pytest.mark.parametrize("m,n,k", [(1, 32, 64), (5, 48, 96), (37, 100, 80)])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_rows_matches_linear(m, n, k, config, dtype):
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    b = torch.randn(n, dtype=dtype)
    got = gemm_rows(x, w, b, config)
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel_err(got, _linear_ref(x, w, b)) <= REL_TOL[dtype]


@pytest.mark.parametrize("m,n,k", [(3, 40, 64), (37, 64, 96), (70, 24, 128)])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_gemm_rms_norm_matches_norm_then_linear(m, n, k, config, dtype, with_residual):
    x = torch.randn(m, k, dtype=dtype) * 3
    res = torch.randn(m, k, dtype=dtype) if with_residual else None
    nw = 1 + 0.5 * torch.randn(k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    b = torch.randn(n, dtype=dtype)
    res_before = None if res is None else res.clone()
    got, new_res = gemm_rms_norm(x, res, nw, 1e-6, w, b, config)
    normed, ref_res = _norm_ref(x, res_before, nw, 1e-6)
    if res is None:
        assert new_res is None
    else:
        assert torch.equal(res, res_before), "the residual passed in is left as it was (others still read it)"
        assert torch.equal(new_res, ref_res), "the new residual is x + residual rounded to the dtype"
    assert rel_err(got, _linear_ref(normed, w, b)) <= REL_TOL[dtype]


def test_gemm_rms_norm_takes_a_float32_norm_weight():
    """Gemma's ``1 + w`` kept in float32: the product with the weight in float32, as rmsnorm.py's."""
    x, res = torch.randn(9, 64), torch.randn(9, 64)
    nw = (1 + 0.3 * torch.randn(64)).float()
    w = torch.randn(32, 64) / 8
    got, _ = gemm_rms_norm(x.bfloat16(), res.bfloat16(), nw, 1e-6, w.bfloat16())
    normed, _ = _norm_ref(x.bfloat16(), res.bfloat16(), nw, 1e-6)
    assert rel_err(got, _linear_ref(normed, w.bfloat16(), None)) <= REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("m,n,k", [(4, 32, 64), (37, 40, 96)])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_silu_mul_matches_activation_then_linear(m, n, k, config, dtype):
    gate_up = torch.randn(m, 2 * k, dtype=dtype) * 2
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    got = gemm_silu_mul(gate_up, w, config)
    assert got.shape == (m, n)
    assert rel_err(got, _linear_ref(_silu_mul_ref(gate_up), w, None)) <= REL_TOL[dtype]


def test_bad_arguments_are_refused_by_name():
    x, w = torch.randn(4, 64), torch.randn(8, 64)
    with pytest.raises(ValueError, match="norm_weight"):
        gemm_rms_norm(x, None, torch.ones(32), 1e-6, w)
    with pytest.raises(ValueError, match="residual"):
        gemm_rms_norm(x, torch.randn(4, 32), torch.ones(64), 1e-6, w)
    with pytest.raises(ValueError, match="weight"):
        gemm_rows(x, torch.randn(8, 32))
    with pytest.raises(ValueError, match="x_gate_up"):
        gemm_silu_mul(torch.randn(4, 63), w)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 64, 200, 256])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (6144, 3072), (2048, 8192)])
def test_gemm_prologues_on_gpu(m, n, k):
    """The engine's shapes (qwen3-0.6b's qkv and o, gate_up and down of the 1B-8B models), compiled, in bfloat16."""
    dev, dt = "cuda", torch.bfloat16
    x, res = torch.randn(m, k, device=dev, dtype=dt), torch.randn(m, k, device=dev, dtype=dt)
    nw = 1 + 0.2 * torch.randn(k, device=dev, dtype=dt)
    w = torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5
    got, new_res = gemm_rms_norm(x, res, nw, 1e-6, w)
    ref_res = res.clone()
    normed = fused_add_rms_norm_ref(x, ref_res, nw, 1e-6)
    assert torch.equal(new_res, ref_res)
    assert rel_err(got, _linear_ref(normed, w, None)) <= REL_TOL[dt]
    gate_up = torch.randn(m, 2 * k, device=dev, dtype=dt)
    assert rel_err(gemm_silu_mul(gate_up, w), _linear_ref(_silu_mul_ref(gate_up), w, None)) <= REL_TOL[dt]
    assert rel_err(gemm_rows(x, w), _linear_ref(x, w, None)) <= REL_TOL[dt]

