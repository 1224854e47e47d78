"""Batch-1 matrix-vector kernel (interpreter on CPU) against a float32 reference and torch's linear, and its fused
SwiGLU / GeGLU, residual-add + RMSNorm (Llama's and Gemma's float32-weight rounding) and Qwen3.5's sigmoid-gate and
gated-RMSNorm prologues against the unfused kernels they replace."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_testlib import EXACT_BF16, REL_TOL, rel_err

from minfer.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from minfer.kernels.gemm import gemv as gemv_module
from minfer.kernels.gemm.gemv import gemv, gemv_gelu_tanh_mul, gemv_rms_norm, gemv_silu_mul
from minfer.kernels.gemm.gemv_gated import gemv_gated_rms_norm, gemv_sigmoid_gate
from minfer.kernels.gemm.gemv_ref import (gemv_gated_rms_norm_ref, gemv_gelu_tanh_mul_ref, gemv_ref, gemv_rms_norm_ref,
                                         gemv_sigmoid_gate_ref, gemv_silu_mul_ref)
from minfer.kernels.gemm.gemv_config import GemvConfig
from minfer.kernels.linear_attention.gated_delta_ref import gated_rms_norm_ref
from minfer.kernels.linear_attention.gated_norm import gated_rms_norm
from minfer.kernels.rmsnorm import fused_add_rms_norm, rms_norm


@pytest.mark.parametrize("n,k,bias,config", [
    (64, 128, False, None),
    (50, 200, True, None),                       # ragged rows and columns: the masked path
    (96, 256, False, GemvConfig(16, 64, 4)),     # several K iterations, even shapes
    (33, 1024, True, GemvConfig(4, 256, 4)),
    (96, 256, True, GemvConfig(4, 64, 4, num_stages=1)),  # an unpipelined K loop
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_reference(n, k, bias, config, dtype):
    torch.manual_seed(n * k)
    x = torch.randn(1, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    b = torch.randn(n, dtype=dtype) if bias else None
    got = gemv(x, w, b, config)
    ref = gemv_ref(x, w, b)
    assert got.shape == (1, n) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the same float32 sum
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(got.float(), torch.nn.functional.linear(x.float(), w.float(), None if b is None
                                                                       else b.float()), rtol=2e-2, atol=2e-2)


def test_gemv_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        gemv(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        gemv(torch.randn(1, 8), torch.randn(4, 9))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (4096, 1024), (1000, 3000)])
@pytest.mark.parametrize("config", [None, GemvConfig(8, 512, 8, num_stages=1), GemvConfig(2, 2048, 2, num_stages=4)])
def test_gemv_on_gpu_matches_reference(n, k, config):
    torch.manual_seed(0)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    torch.testing.assert_close(gemv(x, w, config=config), gemv_ref(x, w), rtol=1e-2, atol=1e-2)


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


def _assert_near_ref(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Relative error against a torch reference. The interpreter rounds float32 -> bfloat16 toward zero where
    torch rounds to nearest, a bias that two or three intermediate roundings add up to ~1%: 3e-2 there."""
    tol = 3e-2 if out.dtype == torch.bfloat16 and not EXACT_BF16 else REL_TOL[out.dtype]
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: rel err {err:.2e} > {tol:.0e}"


def _unfused_rms(x: torch.Tensor, residual: torch.Tensor | None, nw: torch.Tensor, eps: float, w: torch.Tensor,
                 b: torch.Tensor | None, config: GemvConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two launches gemv_rms_norm replaces: (y, the residual fused_add_rms_norm leaves in a clone)."""
    if residual is None:
        return gemv(rms_norm(x, nw, eps), w, b, config), x
    new_res = residual.clone()
    return gemv(fused_add_rms_norm(x, new_res, nw, eps), w, b, config), new_res


FUSED_SHAPES = [
    (64, 128, None),
    (50, 200, None),                       # ragged rows and columns: the masked path
    (96, 256, GemvConfig(16, 64, 4)),      # several K chunks per program, even shapes
    (33, 300, GemvConfig(4, 128, 2)),      # several K chunks, ragged both ways
]


@pytest.mark.parametrize("n,k,config", FUSED_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_silu_mul_matches_unfused(n, k, config, dtype):
    torch.manual_seed(n + k)
    xgu = torch.randn(1, 2 * k, dtype=dtype) * 2
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    xgu0 = xgu.clone()
    got = gemv_silu_mul(xgu, w, config)
    assert got.shape == (1, n) and got.dtype == dtype
    assert torch.equal(xgu, xgu0)
    tol = _tol(dtype)
    unfused = gemv(silu_and_mul(xgu), w, config=config)
    torch.testing.assert_close(got, unfused, rtol=tol, atol=tol)
    # Same roundings, same float32 summation order (the interpreter's): bit-identical. A missing intermediate
    # rounding would hide inside the bf16 tolerance above, not here.
    assert torch.equal(got, unfused)
    _assert_near_ref(got, gemv_silu_mul_ref(xgu, w), "gemv_silu_mul vs reference")


@pytest.mark.parametrize("n,k,config", FUSED_SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_rms_norm_matches_unfused(n, k, config, bias, with_residual, dtype):
    torch.manual_seed(n * k + bias)
    eps = 1e-5
    x = torch.randn(1, k, dtype=dtype)
    res = torch.randn(1, k, dtype=dtype) * 3 if with_residual else None
    nw = 1 + 0.1 * torch.randn(k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    b = torch.randn(n, dtype=dtype) if bias else None
    x0, res0 = x.clone(), None if res is None else res.clone()
    y, new_res = gemv_rms_norm(x, res, nw, eps, w, b, config)
    assert y.shape == (1, n) and y.dtype == dtype and new_res.shape == (1, k) and new_res.dtype == dtype
    assert torch.equal(x, x0), "x was modified"
    if res is None:
        assert new_res is x
    else:
        assert torch.equal(res, res0), "residual was updated in place"
        assert new_res.data_ptr() not in (x.data_ptr(), res.data_ptr())
    y_unfused, res_unfused = _unfused_rms(x, res0, nw, eps, w, b, config)
    assert torch.equal(new_res, res_unfused)  # x + residual, rounded exactly as fused_add_rms_norm rounds it
    tol = _tol(dtype)
    torch.testing.assert_close(y, y_unfused, rtol=tol, atol=tol)
    assert torch.equal(y, y_unfused)  # one tl.sum over the same next_pow2(K) block as rmsnorm.py: bit-identical
    y_ref, res_ref = gemv_rms_norm_ref(x, res, nw, eps, w, b)
    _assert_near_ref(y, y_ref, "gemv_rms_norm vs reference")
    if dtype != torch.bfloat16 or EXACT_BF16:  # the interpreter rounds float32 -> bfloat16 toward zero
        assert torch.equal(new_res, res_ref)
    else:
        torch.testing.assert_close(new_res, res_ref, rtol=1e-2, atol=1e-2)
    if res is not None:
        assert torch.equal(res, res0), "gemv_rms_norm_ref updated residual in place"


@pytest.mark.parametrize("n,k,config", FUSED_SHAPES)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("f32_norm", [False, True])
def test_gemv_rms_norm_keeps_the_normed_row(n, k, config, with_residual, f32_norm):
    """``normed_out`` (a MoE router's launch, which the experts read next): exactly the row the unfused norm
    writes, whatever the chunking (ragged K: the masked store), and the product unchanged by keeping it."""
    torch.manual_seed(n + k)
    dtype = torch.bfloat16
    x = torch.randn(1, k, dtype=dtype)
    res = torch.randn(1, k, dtype=dtype) * 3 if with_residual else None
    nw = (1 + 0.1 * torch.randn(k)).to(torch.float32 if f32_norm else dtype)  # float32: gpt-oss's / Gemma's
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    normed = torch.full_like(x, float("nan"))
    y, new_res = gemv_rms_norm(x, res, nw, 1e-6, w, None, config, normed_out=normed)
    y_plain, res_plain = gemv_rms_norm(x, res, nw, 1e-6, w, None, config)
    assert torch.equal(y, y_plain) and torch.equal(new_res, res_plain)
    unfused = rms_norm(x, nw, 1e-6) if res is None else fused_add_rms_norm(x, res.clone(), nw, 1e-6)
    assert torch.equal(normed, unfused)
    with pytest.raises(ValueError, match="normed_out"):
        gemv_rms_norm(x, res, nw, 1e-6, w, normed_out=torch.empty(1, k + 1, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_rms_norm_row_wider_than_one_block(monkeypatch, dtype):
    """Rows wider than RMS_MAX_BLOCK: the sum of squares loops over blocks (here 3 blocks, the last ragged)."""
    monkeypatch.setattr(gemv_module, "RMS_MAX_BLOCK", 64)
    torch.manual_seed(1)
    n, k, eps = 24, 150, 1e-6
    x, res = torch.randn(1, k, dtype=dtype), torch.randn(1, k, dtype=dtype)
    nw, w = torch.randn(k, dtype=dtype), torch.randn(n, k, dtype=dtype) / k ** 0.5
    for residual in (res, None):
        y, new_res = gemv_rms_norm(x, residual, nw, eps, w, config=GemvConfig(8, 64, 4))
        y_unfused, res_unfused = _unfused_rms(x, residual, nw, eps, w, None, GemvConfig(8, 64, 4))
        assert torch.equal(new_res, res_unfused)
        torch.testing.assert_close(y, y_unfused, rtol=_tol(dtype), atol=_tol(dtype))


def test_gemv_fused_reject_bad_shapes():
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match="even"):
        gemv_silu_mul(torch.randn(1, 15), w)
    with pytest.raises(ValueError, match=r"2\*K = 16"):
        gemv_silu_mul(torch.randn(1, 8), w)
    with pytest.raises(ValueError, match=r"x_gate_up \[1, 2\*K\]"):
        gemv_silu_mul(torch.randn(2, 16), w)
    nw = torch.randn(8)
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        gemv_rms_norm(torch.randn(1, 9), None, nw, 1e-6, w)
    with pytest.raises(ValueError, match="residual"):
        gemv_rms_norm(torch.randn(1, 8), torch.randn(1, 9), nw, 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight"):
        gemv_rms_norm(torch.randn(1, 8), None, torch.randn(9), 1e-6, w)
    with pytest.raises(ValueError, match="bias"):
        gemv_rms_norm(torch.randn(1, 8), None, nw, 1e-6, w, torch.randn(5))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(3072, 2048), (16384, 2048)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_gemv_rms_norm_on_gpu_matches_unfused(n, k, with_residual):
    torch.manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(1, k, device="cuda", dtype=dt)
    res = torch.randn(1, k, device="cuda", dtype=dt) * 3 if with_residual else None
    nw = 1 + 0.1 * torch.randn(k, device="cuda", dtype=dt)
    w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
    res0 = None if res is None else res.clone()
    y, new_res = gemv_rms_norm(x, res, nw, 1e-5, w)
    y_unfused, res_unfused = _unfused_rms(x, res0, nw, 1e-5, w, None, None)
    if res is not None:
        assert torch.equal(res, res0)
    assert torch.equal(new_res, res_unfused)
    torch.testing.assert_close(y, y_unfused, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_gemv_silu_mul_on_gpu_matches_unfused():
    torch.manual_seed(0)
    n, k, dt = 2048, 8192, torch.bfloat16
    xgu = torch.randn(1, 2 * k, device="cuda", dtype=dt) * 2
    w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
    torch.testing.assert_close(gemv_silu_mul(xgu, w), gemv(silu_and_mul(xgu), w), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("n,k,config", FUSED_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_gelu_tanh_mul_matches_unfused(n, k, config, dtype):
    """Gemma's GeGLU before the down projection: bit-identical to the GeGLU kernel followed by the product."""
    torch.manual_seed(n + 3 * k)
    xgu = torch.randn(1, 2 * k, dtype=dtype) * 2
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    got = gemv_gelu_tanh_mul(xgu, w, config)
    assert torch.equal(got, gemv(gelu_tanh_and_mul(xgu), w, config=config))
    _assert_near_ref(got, gemv_gelu_tanh_mul_ref(xgu, w), "gemv_gelu_tanh_mul vs reference")
    assert not torch.equal(got, gemv_silu_mul(xgu, w, config))


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_rms_norm_with_a_float32_weight_rounds_as_gemma(with_residual, dtype):
    """A float32 norm weight (Gemma's 1 + w): the prologue equals the norm kernel's Gemma rounding, then the product."""
    torch.manual_seed(7)
    n, k, eps, config = 40, 256, 1e-6, GemvConfig(8, 64, 4)
    x = torch.randn(1, k, dtype=dtype)
    res = torch.randn(1, k, dtype=dtype) * 3 if with_residual else None
    nw = 1 + 0.1 * torch.randn(k)  # float32
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    y, new_res = gemv_rms_norm(x, res, nw, eps, w, config=config)
    y_unfused, res_unfused = _unfused_rms(x, res, nw, eps, w, None, config)
    assert torch.equal(new_res, res_unfused) and torch.equal(y, y_unfused)
    _assert_near_ref(y, gemv_rms_norm_ref(x, res, nw, eps, w)[0], "gemv_rms_norm (float32 weight) vs reference")


# (heads, head size, config): two heads a chunk over two chunks; three heads in a 64-wide chunk (the masked path)
GATED_SHAPES = [(4, 16, GemvConfig(8, 32, 4)), (3, 16, GemvConfig(4, 64, 4)), (4, 16, None)]


@pytest.mark.parametrize("heads,dim,config", GATED_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_gated_rms_norm_matches_unfused(heads, dim, config, dtype):
    """The Gated DeltaNet's norm before out_proj: bit-identical to the gated-norm kernel followed by the product;
    the gate is a strided view of the fused z|b|a projection, as the layer passes it."""
    n, k = 40, heads * dim
    x = torch.randn(1, k, dtype=dtype)
    zba = torch.randn(1, k + 2 * heads, dtype=dtype) * 2
    z = zba[:, :k].view(1, heads, dim)
    nw = 1 + 0.2 * torch.randn(dim, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    got = gemv_gated_rms_norm(x, z, nw, 1e-6, w, config)
    assert got.shape == (1, n) and got.dtype == dtype
    assert torch.equal(got, gemv(gated_rms_norm(x.view(1, heads, dim), z, nw, 1e-6).view(1, k), w, config=config))
    _assert_near_ref(got, gemv_gated_rms_norm_ref(x, z, nw, 1e-6, w), "gemv_gated_rms_norm vs reference")


@pytest.mark.parametrize("heads,dim,config", GATED_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_sigmoid_gate_matches_reference(heads, dim, config, dtype):
    """Qwen3.5's output gate before o_proj, read per head from beside each query head in the fused qkv output."""
    n, k = 40, heads * dim
    o = torch.randn(1, k, dtype=dtype)
    qkv = torch.randn(1, 2 * k + 32, dtype=dtype) * 2
    gate = qkv[:, :2 * k].view(1, heads, 2 * dim)[..., dim:]
    w = torch.randn(n, k, dtype=dtype) / k ** 0.5
    b = torch.randn(n, dtype=dtype)
    got = gemv_sigmoid_gate(o, gate, w, b, config)
    assert got.shape == (1, n) and got.dtype == dtype
    _assert_near_ref(got, gemv_sigmoid_gate_ref(o, gate, w, b), "gemv_sigmoid_gate vs reference")
    if dtype == torch.float32:
        torch.testing.assert_close(got, gemv(o * torch.sigmoid(gate).reshape(1, k), w, b, config), rtol=1e-6,
                                   atol=1e-6)


def test_gemv_gated_reject_bad_shapes():
    w, nw = torch.randn(4, 32), torch.randn(16)
    with pytest.raises(ValueError, match="gate"):
        gemv_sigmoid_gate(torch.randn(1, 32), torch.randn(1, 3, 16), w)
    with pytest.raises(ValueError, match="power of two"):
        gemv_gated_rms_norm(torch.randn(1, 36), torch.randn(1, 3, 12), torch.randn(12), 1e-6, torch.randn(4, 36))
    with pytest.raises(ValueError, match="whole heads"):
        gemv_gated_rms_norm(torch.randn(1, 32), torch.randn(1, 2, 16), nw, 1e-6, w, GemvConfig(4, 8, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 4096)])  # Qwen3.5-9B's out_proj / o_proj (32 x 128, 16 x 256)
def test_gemv_qwen3_5_gated_prologues_on_gpu_match_unfused(n, k):
    """Both gated prologues at Qwen3.5-9B's shapes, bf16, against the unfused launches (the gated-norm kernel, or
    torch's sigmoid and product, then the plain product), equal to the rounding of the float32 summation order;
    the gated-norm kernel against HF's torch arithmetic."""
    torch.manual_seed(0)
    dt = torch.bfloat16
    x = torch.randn(1, k, device="cuda", dtype=dt)
    w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
    zba = torch.randn(1, k + 64, device="cuda", dtype=dt) * 2
    z = zba[:, :k].view(1, 32, 128)
    nw = 1 + 0.2 * torch.randn(128, device="cuda", dtype=dt)
    unfused = gemv(gated_rms_norm(x.view(1, 32, 128), z, nw, 1e-6).view(1, k), w)
    torch.testing.assert_close(gemv_gated_rms_norm(x, z, nw, 1e-6, w), unfused, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gated_rms_norm(x.view(1, 32, 128), z, nw, 1e-6),
                               gated_rms_norm_ref(x.view(1, 32, 128), z, nw, 1e-6), rtol=1e-2, atol=1e-2)
    qkv = torch.randn(1, 2 * k + 2048, device="cuda", dtype=dt) * 2
    gate = qkv[:, :2 * k].view(1, 16, 512)[..., 256:]
    unfused = gemv((x.view(1, 16, 256) * torch.sigmoid(gate)).reshape(1, k), w)
    torch.testing.assert_close(gemv_sigmoid_gate(x, gate, w), unfused, rtol=1e-2, atol=1e-2)


def _lora(n_shards_sizes, k, max_loras=3, max_rank=8, rank=5, slot=1, dtype=torch.float32, device="cpu"):
    """Stacks with a rank-``rank`` adapter (zero-padded to max_rank) in every slot, read at ``slot``."""
    from minfer.kernels.gemm.gemv_lora import GemvLora
    n = sum(n_shards_sizes)
    a = torch.zeros(max_loras, len(n_shards_sizes), max_rank, k, dtype=dtype, device=device)
    b = torch.zeros(max_loras, n, max_rank, dtype=dtype, device=device)
    a[..., :rank, :] = torch.randn(max_loras, len(n_shards_sizes), rank, k, device=device).to(dtype) / k ** 0.5
    b[..., :rank] = torch.randn(max_loras, n, rank, device=device).to(dtype)
    return GemvLora(torch.tensor([slot], dtype=torch.int32, device=device), a, b, tuple(n_shards_sizes))


@pytest.mark.parametrize("slot,dtype,k", [  # an adapter; the base model alone (-1, and a slot past the stack)
    (1, torch.float32, 1200), (-1, torch.float32, 1200), (3, torch.float32, 160), (1, torch.bfloat16, 160)])
def test_gemv_lora_matches_reference(slot, dtype, k):
    """The shrink launch and the expand epilogue against the float32 reference, on every fused variant the
    one-token forward uses: qkv's three ragged shards behind the RMS prologue, o's one, down's behind SwiGLU. K of
    1200 splits the shrink into three parts of 512 columns, the last one ragged."""
    torch.manual_seed(7)
    sizes = (64, 24, 24)
    tol = 1e-5 if dtype == torch.float32 else 5e-2  # bf16: an ulp of outputs up to 8 (the sums differ in order)
    x, residual = torch.randn(1, k, dtype=dtype), torch.randn(1, k, dtype=dtype)
    norm_w = torch.rand(k, dtype=dtype) + 0.5
    w, bias = torch.randn(sum(sizes), k, dtype=dtype) / k ** 0.5, torch.randn(sum(sizes), dtype=dtype)
    lora = _lora(sizes, k, slot=slot, dtype=dtype)
    got, got_res = gemv_rms_norm(x, residual, norm_w, 1e-6, w, bias, GemvConfig(8, 256, 4), lora=lora)
    ref, _ = gemv_rms_norm_ref(x, residual, norm_w, 1e-6, w, bias, lora=lora)
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    base, base_res = gemv_rms_norm(x, residual, norm_w, 1e-6, w, bias, GemvConfig(8, 256, 4))
    assert torch.equal(got_res, base_res)  # the shrink, which runs the same prologue, left the residual alone
    if slot == 1:
        assert (got.float() - base.float()).abs().max() > 0.1  # the adapter's product is there
    else:
        torch.testing.assert_close(got, base, rtol=0, atol=0)
    o_lora = _lora((96,), k, slot=slot, dtype=dtype)
    wo = torch.randn(96, k, dtype=dtype) / k ** 0.5
    torch.testing.assert_close(gemv(x, wo, lora=o_lora), gemv_ref(x, wo, lora=o_lora), rtol=tol, atol=tol)
    gate_up = torch.randn(1, 2 * k, dtype=dtype)
    torch.testing.assert_close(gemv_silu_mul(gate_up, wo, lora=o_lora), gemv_silu_mul_ref(gate_up, wo, lora=o_lora),
                               rtol=tol, atol=tol)


def test_gemv_lora_rejects_bad_stacks():
    lora = _lora((32,), 64)
    with pytest.raises(ValueError, match="a_stack"):
        gemv(torch.randn(1, 48), torch.randn(32, 48), lora=lora)
    with pytest.raises(ValueError, match="b_stack"):
        gemv(torch.randn(1, 64), torch.randn(40, 64), lora=lora)


@pytest.mark.gpu
@pytest.mark.parametrize("slot", [0, -1])
def test_gemv_lora_on_gpu_matches_reference(slot):
    """llama-3.1-8b's qkv (behind the RMS prologue) and down (behind SwiGLU) with a rank-16 adapter."""
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    x, residual = torch.randn(1, 4096, device=dev, dtype=dt), torch.randn(1, 4096, device=dev, dtype=dt)
    norm_w = torch.rand(4096, device=dev, dtype=dt) + 0.5
    w = torch.randn(6144, 4096, device=dev, dtype=dt) / 64
    lora = _lora((4096, 1024, 1024), 4096, max_loras=4, max_rank=16, rank=16, slot=slot, dtype=dt, device=dev)
    got, _ = gemv_rms_norm(x, residual, norm_w, 1e-5, w, lora=lora)
    torch.testing.assert_close(got, gemv_rms_norm_ref(x, residual, norm_w, 1e-5, w, lora=lora)[0], rtol=2e-2, atol=2e-2)
    wd = torch.randn(4096, 14336, device=dev, dtype=dt) / 120
    gate_up = torch.randn(1, 2 * 14336, device=dev, dtype=dt)
    down = _lora((4096,), 14336, max_loras=4, max_rank=16, rank=16, slot=slot, dtype=dt, device=dev)
    torch.testing.assert_close(gemv_silu_mul(gate_up, wd, lora=down), gemv_silu_mul_ref(gate_up, wd, lora=down),
                               rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim,config", [((4, 2), 16, None), ((2, 1), 32, GemvConfig(8, 64, 4)),
                                                   ((3, 3), 8, GemvConfig(2, 32, 2))])
@pytest.mark.parametrize("bias,slot", [(False, 5), (True, 0), (False, -1)])
def test_gemv_rms_norm_rope_store_matches_the_separate_kernel(dtype, heads, head_dim, config, bias, slot):
    """The qkv launch with the rope-and-store epilogue (gemv_epilogue.py) against the plain launch followed by
    ``rope_store_kv``: q and k rotated, v as it is, k and v in the token's slot (slot -1: nothing stored), bit for bit
    (the same roundings, the same float32 arithmetic); a position deep in the table."""
    _check_rope_store(dtype, heads, head_dim, config, bias, slot, 48, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("heads,head_dim,hidden", [((32, 8), 64, 2048), ((32, 8), 128, 4096), ((64, 8), 64, 2880)])
def test_gemv_rms_norm_rope_store_on_gpu(heads, head_dim, hidden):
    """Compiled (PDL on an H100/H200), at llama-3.2-1b's, llama-3.1-8b's and gpt-oss's qkv shapes, default configs."""
    _check_rope_store(torch.bfloat16, heads, head_dim, None, head_dim == 64 and heads[0] == 64, 7, hidden, "cuda")


def _check_rope_store(dtype: torch.dtype, heads: tuple[int, int], head_dim: int, config: GemvConfig | None,
                      bias: bool, slot: int, k: int, device: str) -> None:
    from minfer.kernels.gemm.gemv_epilogue import RopeStore
    from minfer.kernels.rope_store import rope_store_kv
    from minfer.model.layers.rotary import RotaryEmbedding

    torch.manual_seed(head_dim + slot)
    hq, hkv = heads
    n = (hq + 2 * hkv) * head_dim
    x, res = torch.randn(1, k, dtype=dtype, device=device), torch.randn(1, k, dtype=dtype, device=device)
    nw = 1 + 0.1 * torch.randn(k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    table = RotaryEmbedding(head_dim, 512, 10000.0, None).cos_sin_cache.to(device)
    pos, slots = torch.tensor([300], device=device), torch.tensor([slot], device=device)
    caches = [torch.zeros(4, 4, hkv, head_dim, dtype=dtype, device=device) for _ in range(4)]
    store = RopeStore(pos, table, caches[0], caches[1], slots, hq, hkv, head_dim)
    y, new_res = gemv_rms_norm(x, res, nw, 1e-6, w, b, config, rope_store=store)
    ref, ref_res = gemv_rms_norm(x, res, nw, 1e-6, w, b, config)
    q, kk, v = ref.view(-1).split([hq * head_dim, hkv * head_dim, hkv * head_dim])
    rope_store_kv(q.view(1, hq, head_dim), kk.view(1, hkv, head_dim), v.view(1, hkv, head_dim), pos, table,
                  caches[2], caches[3], slots)
    assert torch.equal(new_res, ref_res)
    assert torch.equal(y[0, :hq * head_dim], q) and torch.equal(y[0, (hq + hkv) * head_dim:], v)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert bool(caches[0].abs().sum() > 0) == (slot >= 0)
    if slot >= 0:  # the k part of the output is rotated too: the cache row holds it
        flat = caches[0].view(-1, hkv * head_dim)[slot]
        assert torch.equal(y[0, hq * head_dim:(hq + hkv) * head_dim], flat)


def test_rope_store_refuses_what_it_cannot_do():
    from minfer.kernels.gemm.gemv_epilogue import RopeStore

    x, nw, w = torch.randn(1, 32), torch.ones(32), torch.randn(64, 32)  # 2 + 2 x 1 heads of 16
    cache = torch.zeros(2, 4, 1, 16)
    table = torch.zeros(64, 16)
    ok = RopeStore(torch.tensor([1]), table, cache, cache, torch.tensor([0]), 2, 1, 16)
    gemv_rms_norm(x, None, nw, 1e-6, w, rope_store=ok)
    for bad, match in ((dict(num_q_heads=3), "rows"), (dict(cos_sin_cache=torch.zeros(64, 8)), "full rotary"),
                       (dict(k_cache=cache.to(torch.bfloat16)), "k_cache")):
        with pytest.raises(ValueError, match=match):
            gemv_rms_norm(x, None, nw, 1e-6, w, rope_store=dataclasses.replace(ok, **bad))
