"""The packed e4m3 conversions of the batch-1 matrix-vector kernel (``gemv_fp8.py``) against Triton's cast and the
references: every code in every byte lane of a word, then the products behind each prologue and a LoRA epilogue.

On the CPU the interpreter runs BITS' bit placement written in Triton and the kernel's ``2^8`` rescale (PAIRS is
the cast there); the tests marked gpu run both forms' inline PTX at llama-3.1-8b's shapes.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_testlib import EXACT_BF16, rel_err, seed_per_case  # noqa: F401 (seed_per_case: autouse fixture)

import triton  # after kernel_testlib, which sets TRITON_INTERPRET on a CPU machine
import triton.language as tl
from minfer.kernels.gemm import gemv_fp8
from minfer.kernels.gemm.gemv import gemv, gemv_rms_norm, gemv_silu_mul
from minfer.kernels.gemm.gemv_config import (BLOCK, CHANNEL, PLAIN, RMS_NORM, SILU_MUL, GemvConfig,
                                             default_fp8_config)
from minfer.kernels.gemm.gemv_fp8 import BITS, CAST, PAIRS, fp8_to_f32
from minfer.kernels.gemm.gemv_lora import GemvLora
from minfer.kernels.gemm.gemv_ref import gemv_ref, gemv_rms_norm_ref, gemv_silu_mul_ref
from minfer.kernels.quant import fp8_ref as fr

LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down
SHAPES = [
    (33, 200, None),                       # ragged rows and columns, default config
    (17, 300, GemvConfig(4, 64, 4)),       # K chunks inside one group; two codes a thread (a padded word)
    (24, 256, GemvConfig(8, 128, 4)),      # one group per chunk, even shapes
]


@triton.jit
def _convert_kernel(W, Y, CVT: tl.constexpr, ASM: tl.constexpr):
    offs = tl.arange(0, 1024)
    tl.store(Y + offs, fp8_to_f32(tl.load(W + offs), CVT, ASM))


def _check_codes(cvt: int, device: str) -> None:
    """All 256 codes, each in all four byte lanes of a word (row r is the codes rotated by r), against torch's
    e4m3 values (times 2^-8 under BITS); the two NaN codes are left out (BITS reads them as +-480)."""
    codes = torch.stack([torch.arange(256).roll(r) for r in range(4)]).flatten().to(torch.uint8).to(device)
    codes = codes.view(torch.float8_e4m3fn)
    y = torch.full((1024,), float("nan"), device=device)
    _convert_kernel[(1,)](codes, y, cvt, device == "cuda")
    ref = codes.float() * (2.0 ** -8 if cvt == BITS else 1.0)
    finite = ~torch.isnan(ref)
    assert torch.equal(y[finite], ref[finite]), f"cvt {cvt}: {(y[finite] != ref[finite]).sum().item()} codes differ"
    assert torch.equal(torch.signbit(y[finite]), torch.signbit(ref[finite]))  # -0 stays -0


def _weight(n: int, k: int, fmt: str, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes with per-row scales ([N]) or per-row 128-column scales ([N, ceil(K/128)], the block layout)."""
    w = torch.randn(n, k, device=device) / k ** 0.5
    return fr.quantize_fp8_ref(w, 128 if fmt == "block" else None)


def _cfg(config: GemvConfig | None, n: int, k: int, prologue: int, fmt: str, cvt: int) -> GemvConfig:
    base = config or default_fp8_config(n, k, prologue, BLOCK if fmt == "block" else CHANNEL)
    return dataclasses.replace(base, fp8_cvt=cvt)


# -------------------------------------------------------------------------------------------------------- CPU
@pytest.mark.parametrize("cvt", [CAST, PAIRS, BITS])
def test_every_code_converts_exactly(cvt):
    _check_codes(cvt, "cpu")


@pytest.mark.parametrize("n,k,config", SHAPES)
@pytest.mark.parametrize("fmt", ["channel", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_fp8_bits_equals_cast(n, k, config, fmt, dtype):
    """BITS' values are the cast's times 2^-8 and the row sums come back by 2^8: bit-identical outputs."""
    x, b = torch.randn(1, k, dtype=dtype), torch.randn(n, dtype=dtype)
    wq, ws = _weight(n, k, fmt)
    y_cast = gemv(x, wq, b, _cfg(config, n, k, PLAIN, fmt, CAST), weight_scale=ws)
    y = gemv(x, wq, b, _cfg(config, n, k, PLAIN, fmt, BITS), weight_scale=ws)
    assert torch.equal(y, y_cast)
    assert torch.equal(gemv(x, wq, b, _cfg(config, n, k, PLAIN, fmt, PAIRS), weight_scale=ws), y_cast)
    assert rel_err(y, gemv_ref(x, wq, b, weight_scale=ws)) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("n,k,config", SHAPES[:2])
@pytest.mark.parametrize("fmt", ["channel", "block"])
def test_gemv_fp8_bits_behind_prologues(n, k, config, fmt):
    """The SwiGLU and residual + RMSNorm prologues feed the same conversion: BITS equals the cast there too."""
    dtype = torch.bfloat16
    tol = 1e-2 if EXACT_BF16 else 3e-2
    wq, ws = _weight(n, k, fmt)
    xgu = (torch.randn(1, 2 * k) * 2).to(dtype)
    y = gemv_silu_mul(xgu, wq, _cfg(config, n, k, SILU_MUL, fmt, BITS), weight_scale=ws)
    assert torch.equal(y, gemv_silu_mul(xgu, wq, _cfg(config, n, k, SILU_MUL, fmt, CAST), weight_scale=ws))
    assert rel_err(y, gemv_silu_mul_ref(xgu, wq, weight_scale=ws)) <= tol
    x, res = torch.randn(1, k, dtype=dtype), (3 * torch.randn(1, k)).to(dtype)
    nw = (1 + 0.1 * torch.randn(k)).to(dtype)
    y, new_res = gemv_rms_norm(x, res, nw, 1e-5, wq, None, _cfg(config, n, k, RMS_NORM, fmt, BITS), weight_scale=ws)
    y_cast, res_cast = gemv_rms_norm(x, res, nw, 1e-5, wq, None, _cfg(config, n, k, RMS_NORM, fmt, CAST),
                                     weight_scale=ws)
    assert torch.equal(y, y_cast) and torch.equal(new_res, res_cast)
    assert rel_err(y, gemv_rms_norm_ref(x, res, nw, 1e-5, wq, weight_scale=ws)[0]) <= tol


def test_gemv_fp8_bits_with_a_lora_epilogue():
    """An adapter's expand is the base launch's epilogue, added after the 2^8 rescale: BITS equals the cast."""
    n, k, rank = 48, 256, 4
    x, res = torch.randn(1, k), torch.randn(1, k)
    nw = torch.rand(k) + 0.5
    wq, ws = _weight(n, k, "block")
    a = torch.randn(2, 1, rank, k) / k ** 0.5
    lora = GemvLora(torch.tensor([1], dtype=torch.int32), a, torch.randn(2, n, rank), (n,))
    cfg = GemvConfig(8, 128, 4)
    y, _ = gemv_rms_norm(x, res, nw, 1e-6, wq, None, dataclasses.replace(cfg, fp8_cvt=BITS), weight_scale=ws, lora=lora)
    y_cast, _ = gemv_rms_norm(x, res, nw, 1e-6, wq, None, cfg, weight_scale=ws, lora=lora)
    assert torch.equal(y, y_cast)
    assert rel_err(y, gemv_rms_norm_ref(x, res, nw, 1e-6, wq, weight_scale=ws, lora=lora)[0]) <= 1e-5


def test_fp8_cvt_choice(monkeypatch):
    """The cast off CUDA and below sm_89; MINFER_FP8_PACKED_CVT picks the form on sm_89+, a bad value fails."""
    assert gemv_fp8.fp8_cvt(torch.device("cpu")) == CAST
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(gemv_fp8, "can_run_ptx", lambda device: True)
    monkeypatch.setattr(gemv_fp8, "_capability", lambda index: (8, 0))
    assert gemv_fp8.fp8_cvt(cuda) == CAST
    monkeypatch.setattr(gemv_fp8, "_capability", lambda index: (9, 0))
    monkeypatch.delenv("MINFER_FP8_PACKED_CVT", raising=False)
    assert gemv_fp8.fp8_cvt(cuda) == gemv_fp8.DEFAULT_PACKED_CVT
    for value, cvt in (("0", CAST), ("1", PAIRS), ("2", BITS)):
        monkeypatch.setenv("MINFER_FP8_PACKED_CVT", value)
        assert gemv_fp8.fp8_cvt(cuda) == cvt
    monkeypatch.setenv("MINFER_FP8_PACKED_CVT", "bits")
    with pytest.raises(ValueError, match="MINFER_FP8_PACKED_CVT"):
        gemv_fp8.fp8_cvt(cuda)


# -------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("cvt", [PAIRS, BITS])
def test_gpu_every_code_converts_exactly(cvt):
    """The inline PTX: every code in every byte lane of a word, bit for bit."""
    _check_codes(cvt, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("fmt", ["channel", "block"])
@pytest.mark.parametrize("cvt", [PAIRS, BITS])
def test_gpu_gemv_fp8_packed_matches_cast(n, k, fmt, cvt):
    """The packed forms against the cast (the same float32 sums: expected bit-identical, held to 1e-6) and the
    references, plain and behind the SwiGLU and RMS prologues, at the default configs."""
    wq, ws = _weight(n, k, fmt, "cuda")
    x32 = torch.randn(1, k, device="cuda")
    y = gemv(x32, wq, None, _cfg(None, n, k, PLAIN, fmt, cvt), weight_scale=ws)
    assert rel_err(y, gemv(x32, wq, None, _cfg(None, n, k, PLAIN, fmt, CAST), weight_scale=ws)) <= 1e-6
    assert rel_err(y, gemv_ref(x32, wq, weight_scale=ws)) <= 1e-5
    dt = torch.bfloat16
    xgu = torch.randn(1, 2 * k, device="cuda", dtype=dt)
    y = gemv_silu_mul(xgu, wq, _cfg(None, n, k, SILU_MUL, fmt, cvt), weight_scale=ws)
    assert rel_err(y, gemv_silu_mul(xgu, wq, _cfg(None, n, k, SILU_MUL, fmt, CAST), weight_scale=ws)) <= 1e-3
    assert rel_err(y, gemv_silu_mul_ref(xgu, wq, weight_scale=ws)) <= 1e-2
    x, res = torch.randn(1, k, device="cuda", dtype=dt), torch.randn(1, k, device="cuda", dtype=dt)
    nw = torch.ones(k, device="cuda", dtype=dt)
    y, _ = gemv_rms_norm(x, res, nw, 1e-5, wq, None, _cfg(None, n, k, RMS_NORM, fmt, cvt), weight_scale=ws)
    y_cast, _ = gemv_rms_norm(x, res, nw, 1e-5, wq, None, _cfg(None, n, k, RMS_NORM, fmt, CAST), weight_scale=ws)
    assert rel_err(y, y_cast) <= 1e-3
    assert rel_err(y, gemv_rms_norm_ref(x, res, nw, 1e-5, wq, weight_scale=ws)[0]) <= 1e-2
