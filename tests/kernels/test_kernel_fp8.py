"""FP8 (e4m3) kernels against their torch references: activation quantization (alone and fused into RMSNorm /
SwiGLU), the block-scaled GEMM, the channel reference against torch._scaled_mm, and the matrix-vector kernels on
e4m3 weights. On the CPU every kernel runs under the Triton interpreter at small odd shapes (fp8 ``tl.dot``
included); the ``gpu`` tests repeat the checks at llama-3.1-8b shapes on a CUDA GPU, where float32 → e4m3 is the
hardware conversion rather than the interpreter's hand rounding."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kernel_testlib import EXACT_BF16, rel_err, seed_per_case  # noqa: F401 (seed_per_case: autouse fixture)

from minfer.kernels.gemm import fp8_gemm as fg
from minfer.kernels.quant import fp8_quant as fq
from minfer.kernels.quant import fp8_ref as fr
from minfer.kernels.activation import silu_and_mul
from minfer.kernels.gemm.gemv import gemv, gemv_rms_norm, gemv_silu_mul
from minfer.kernels.gemm.gemv_ref import gemv_ref, gemv_rms_norm_ref, gemv_silu_mul_ref
from minfer.kernels.gemm.gemv_config import BLOCK, CHANNEL, RMS_NORM, SILU_MUL, GemvConfig, default_fp8_config
from minfer.kernels.rmsnorm import fused_add_rms_norm, rms_norm

MK = [(1, 200), (3, 77), (17, 300)]  # M = 1, 3, 17; K never a multiple of 128
GROUPS = [None, 128]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_same_codes(q: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """e4m3 codes equal as values (+0 and -0 are the same code for a GEMM)."""
    assert q.dtype == ref.dtype == torch.float8_e4m3fn and q.shape == ref.shape
    diff = (q.float() != ref.float()).sum().item()
    assert diff == 0, f"{what}: {diff} of {q.numel()} codes differ"


def assert_quantized_near(q: torch.Tensor, s: torch.Tensor, q_ref: torch.Tensor, s_ref: torch.Tensor, tol: float,
                          what: str, group: int | None) -> None:
    """Dequantized values within ``tol`` (relative Frobenius) of the reference's."""
    g = group or fr.FP8_GROUP
    err = rel_err(fr.dequantize_fp8(q, s, g), fr.dequantize_fp8(q_ref, s_ref, g))
    assert err <= tol, f"{what}: rel err {err:.2e} > {tol:.0e}"


def _bf16_tol(dtype: torch.dtype) -> float:
    """Tolerance of a fused kernel vs the torch reference, the roundings to ``dtype`` included. A bf16 ulp moves
    a code by at most one e4m3 step where the value sits on a rounding boundary; the interpreter rounds
    float32 -> bfloat16 toward zero (kernel_testlib), a bias that makes that common."""
    if dtype == torch.bfloat16:
        return 1e-2 if EXACT_BF16 else 4e-2
    return 1e-3 if dtype == torch.float16 else 1e-5


# ------------------------------------------------------------------------------------------------ quantize
@pytest.mark.parametrize("m,k", MK)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_fp8_matches_reference(m, k, group, dtype):
    # Rows over three decades, one all-zero row (its scale is the floor, its codes zero).
    x = (torch.randn(m, k) * torch.exp(3 * torch.rand(m, 1) - 1.5)).to(dtype)
    if m > 1:
        x[1] = 0
    q, s = fq.quantize_fp8(x, group)
    q_ref, s_ref = fr.quantize_fp8_ref(x, group)
    assert s.shape == ((m,) if group is None else (m, fr.num_groups(k))) and s.dtype == torch.float32
    assert_same_codes(q, q_ref, "quantize_fp8")
    assert torch.equal(s, s_ref)
    if m > 1:
        assert (q[1].float() == 0).all() and (s[1] == fr.FP8_MIN_SCALE).all()
    # The format itself: every value within half an e4m3 step (2^-4 relative), or a subnormal step of its scale.
    x_hat = fr.dequantize_fp8(q, s)
    scale = s[:, None] if group is None else s.repeat_interleave(128, 1)[:, :k]
    assert ((x_hat - x.float()).abs() <= torch.maximum(x.float().abs() / 16, scale / 512) * (1 + 1e-6)).all()
    # Each row's (group's) largest magnitude is stored as ±448.
    amax = q.float().abs().amax(1) if group is None else torch.nn.functional.pad(q.float().abs(), (
        0, s.shape[1] * 128 - k)).view(m, -1, 128).amax(-1)
    assert ((amax == 448) | (s == fr.FP8_MIN_SCALE)).all()


@pytest.mark.parametrize("k", [77, 300])
def test_quantize_fp8_per_token_two_passes(k):
    """Rows wider than the block: amax over chunks, then codes; the same codes as one pass."""
    x = torch.randn(3, k, dtype=torch.bfloat16) * 5
    q, s = fq.quantize_fp8(x, None, block=64)
    q_ref, s_ref = fr.quantize_fp8_ref(x, None)
    assert_same_codes(q, q_ref, "two-pass quantize_fp8")
    assert torch.equal(s, s_ref)


def test_quantize_fp8_rounds_to_nearest_even_and_saturates():
    """Values on and around e4m3's rounding boundaries (the interpreter's own conversion gets 127.5 -> 64)."""
    row = torch.tensor([[448.0, 127.5, 125.0, 116.0, -17.0, 2 ** -9, 1.5 * 2 ** -9, 0.3, -448.0, 0.0]])
    q, s = fq.quantize_fp8(row, None)
    assert s.item() == 1.0
    assert q.float().tolist() == [[448.0, 128.0, 128.0, 112.0, -16.0, 2 ** -9, 2 * 2 ** -9, 0.3125, -448.0, 0.0]]
    assert_same_codes(q, fr.quantize_fp8_ref(row, None)[0])


def test_quantize_fp8_rejects_bad_arguments():
    with pytest.raises(ValueError, match="group_size"):
        fq.quantize_fp8(torch.randn(2, 8), 100)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        fq.quantize_fp8(torch.randn(8), None)
    with pytest.raises(TypeError):
        fq.quantize_fp8(torch.randn(2, 8, dtype=torch.float64), None)
    with pytest.raises(ValueError, match="gate"):
        fq.silu_and_mul_fp8(torch.randn(2, 7), None)


# ----------------------------------------------------------------------------------------- fused quantize
@pytest.mark.parametrize("m,k", MK)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_fp8_matches_unfused(m, k, group, dtype):
    xgu = (torch.randn(m, 2 * k) * 2).to(dtype)
    xgu0 = xgu.clone()
    q, s = fq.silu_and_mul_fp8(xgu, group)
    assert torch.equal(xgu, xgu0)
    q_unf, s_unf = fq.quantize_fp8(silu_and_mul(xgu), group)
    assert_same_codes(q, q_unf, "silu_and_mul_fp8 vs unfused")  # the same roundings: bit-identical
    assert torch.equal(s, s_unf)
    q_ref, s_ref = fq.silu_and_mul_fp8_ref(xgu, group)
    assert_quantized_near(q, s, q_ref, s_ref, _bf16_tol(dtype), "silu_and_mul_fp8 vs reference", group)


def test_silu_and_mul_fp8_per_token_two_passes():
    xgu = torch.randn(3, 2 * 300, dtype=torch.bfloat16) * 2
    q, s = fq.silu_and_mul_fp8(xgu, None, block=128)
    q1, s1 = fq.silu_and_mul_fp8(xgu, None)
    assert_same_codes(q, q1, "two-pass silu_and_mul_fp8")
    assert torch.equal(s, s1)


@pytest.mark.parametrize("m,k", MK)
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_fp8_matches_unfused(m, k, group, dtype):
    eps = 1e-6
    x = torch.randn(m, k).to(dtype)
    res = (3 * torch.randn(m, k)).to(dtype)
    w = (1 + 0.1 * torch.randn(k)).to(dtype)
    r1, r2, r3 = res.clone(), res.clone(), res.clone()
    q, s, new_res = fq.add_rms_norm_fp8(x, r1, w, eps, group)
    assert new_res is r1  # updated in place, like fused_add_rms_norm
    q_unf, s_unf = fq.quantize_fp8(fused_add_rms_norm(x, r2, w, eps), group)
    assert torch.equal(r1, r2)
    assert_same_codes(q, q_unf, "add_rms_norm_fp8 vs unfused")  # the same kernel arithmetic: bit-identical
    assert torch.equal(s, s_unf)
    q_ref, s_ref, _ = fq.add_rms_norm_fp8_ref(x, r3, w, eps, group)
    assert_quantized_near(q, s, q_ref, s_ref, _bf16_tol(dtype), "add_rms_norm_fp8 vs reference", group)
    # Without a residual.
    q, s = fq.rms_norm_fp8(x, w, eps, group)
    q_unf, s_unf = fq.quantize_fp8(rms_norm(x, w, eps), group)
    assert_same_codes(q, q_unf, "rms_norm_fp8 vs unfused")
    assert torch.equal(s, s_unf)
    q_ref, s_ref = fq.rms_norm_fp8_ref(x, w, eps, group)
    assert_quantized_near(q, s, q_ref, s_ref, _bf16_tol(dtype), "rms_norm_fp8 vs reference", group)


# ----------------------------------------------------------------------------------------------- GEMMs
def _block_operands(m: int, n: int, k: int, device: str = "cpu", dtype: torch.dtype = torch.bfloat16):
    """Activations quantized per 1x128 group, a weight per 128x128 block, its scales row-expanded to [N, G]."""
    x = torch.randn(m, k, device=device).to(dtype)
    w = torch.randn(n, k, device=device) / k ** 0.5
    wq, ws = quantize_weight_blocks(w)
    xq, xs = fq.quantize_fp8(x, 128)
    return x, w, xq, xs, wq, ws


def quantize_weight_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's 128x128-block quantization of ``w [N, K]``, scales row-expanded: ``([N, K] e4m3, [N, G])``."""
    n, k = w.shape
    g = fr.num_groups(k)
    nb = -(-n // 128)
    padded = torch.nn.functional.pad(w.float(), (0, g * 128 - k, 0, nb * 128 - n))
    amax = padded.view(nb, 128, g, 128).abs().amax(dim=(1, 3))
    scale = (amax / fr.FP8_MAX).clamp_min(fr.FP8_MIN_SCALE).repeat_interleave(128, 0)[:n]  # [N, G]
    wq = (w.float() / scale.repeat_interleave(128, 1)[:, :k]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return wq, scale.contiguous()


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("n,k", [(33, 200), (65, 256), (129, 300)])
@pytest.mark.parametrize("config", [None, fg.Fp8GemmConfig(16, 32, group_m=2), fg.Fp8GemmConfig(32, 64)])
def test_fp8_gemm_block_matches_reference(m, n, k, config):
    """The Triton kernel under the interpreter (its fp8 ``tl.dot`` is exact there) against the dequantized float32
    matmul: the same products summed in another order."""
    x, w, xq, xs, wq, ws = _block_operands(m, n, k)
    bias = torch.randn(n, dtype=torch.bfloat16)
    for b in (None, bias):
        y = fg.fp8_gemm_block(xq, xs, wq, ws, b, out_dtype=torch.float32, config=config)
        y_ref = fg.fp8_gemm_block_ref(xq, xs, wq, ws, b, out_dtype=torch.float32)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert rel_err(y, y_ref) <= 1e-5
    y16 = fg.fp8_gemm_block(xq, xs, wq, ws, bias, config=config)
    assert y16.dtype == torch.bfloat16
    assert rel_err(y16, fg.fp8_gemm_block_ref(xq, xs, wq, ws, bias)) <= 1e-2


@pytest.mark.parametrize("m,n,k", [(3, 33, 200), (17, 129, 300)])
def test_fp8_references_against_unquantized_matmul(m, n, k):
    """Both references on quantized operands stay within FP8's own error of the bf16-free float32 product, and the
    dequantizing formulation of the channel reference equals its factored one."""
    x = torch.randn(m, k)
    w = torch.randn(n, k) / k ** 0.5
    exact = x @ w.T
    wq, ws = quantize_weight_blocks(w)
    xq, xs = fq.quantize_fp8(x, 128)
    assert rel_err(fg.fp8_gemm_block_ref(xq, xs, wq, ws, out_dtype=torch.float32), exact) <= 6e-2
    xq1, xs1 = fq.quantize_fp8(x, None)
    wq1, ws1 = fr.quantize_fp8_ref(w, None)  # per-row weight scales: the channel format
    y = fg.fp8_gemm_channel_ref(xq1, xs1, wq1, ws1, out_dtype=torch.float32)
    assert rel_err(y, exact) <= 6e-2
    assert rel_err(y, fr.dequantize_fp8(xq1, xs1) @ fr.dequantize_fp8(wq1, ws1).T) <= 1e-6


@pytest.mark.parametrize("m,n,k", [(1, 48, 64), (17, 32, 256)])
def test_fp8_gemm_channel_matches_reference(m, n, k):
    """``fp8_gemm_channel``'s call of ``torch._scaled_mm`` (its scale and operand layout) against the reference;
    torch also runs _scaled_mm on the CPU."""
    x = torch.randn(m, k, dtype=torch.bfloat16)
    xq, xs = fq.quantize_fp8(x, None)
    wq, ws = fr.quantize_fp8_ref(torch.randn(n, k) / k ** 0.5, None)
    bias = torch.randn(n, dtype=torch.bfloat16)
    y = fg.fp8_gemm_channel(xq, xs, wq, ws, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel_err(y, fg.fp8_gemm_channel_ref(xq, xs, wq, ws, bias)) <= 1e-2


def test_fp8_gemm_rejects_bad_arguments():
    _, _, xq, xs, wq, ws = _block_operands(2, 8, 200)
    with pytest.raises(ValueError, match="w_scale"):
        fg.fp8_gemm_block(xq, xs, wq, ws[:, :1].contiguous())
    with pytest.raises(ValueError, match="x_scale"):
        fg.fp8_gemm_block(xq, xs[:, 0].contiguous(), wq, ws)
    with pytest.raises(TypeError):
        fg.fp8_gemm_block(xq.float(), xs, wq, ws)
    with pytest.raises(ValueError, match=r"xq \[M, K\]"):
        fg.fp8_gemm_block(xq[:, :100], xs, wq, ws)
    with pytest.raises(ValueError, match="block_k"):
        fg.fp8_gemm_block(xq, xs, wq, ws, config=fg.Fp8GemmConfig(16, 16, block_k=64))


def test_block_config_table():
    assert fg.block_config(1) == fg.BLOCK_CONFIGS[0][1]
    assert fg.block_config(1 << 20).block_m >= 64
    assert all(cfg.block_k == 128 for _, cfg in fg.BLOCK_CONFIGS)
    assert [m for m, _ in fg.BLOCK_CONFIGS] == sorted(m for m, _ in fg.BLOCK_CONFIGS)


# --------------------------------------------------------------------------------------- gemv on e4m3
def _fp8_weight(n: int, k: int, fmt: str, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device=device) / k ** 0.5
    return quantize_weight_blocks(w) if fmt == "block" else fr.quantize_fp8_ref(w, None)


GEMV_SHAPES = [
    (33, 200, None),                       # ragged rows and columns, default config (K chunk 256: two groups)
    (17, 300, GemvConfig(4, 64, 4)),       # K chunks inside one group
    (24, 256, GemvConfig(8, 128, 4)),      # one group per chunk, even shapes
    (9, 77, GemvConfig(2, 256, 2)),        # K shorter than one group
]


@pytest.mark.parametrize("n,k,config", GEMV_SHAPES)
@pytest.mark.parametrize("fmt", ["channel", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_fp8_matches_reference(n, k, config, fmt, dtype):
    x = torch.randn(1, k, dtype=dtype)
    wq, ws = _fp8_weight(n, k, fmt)
    b = torch.randn(n, dtype=dtype)
    y = gemv(x, wq, b, config, weight_scale=ws)
    assert y.shape == (1, n) and y.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_err(y, gemv_ref(x, wq, b, weight_scale=ws)) <= tol
    # The dequantized weight in float32 through the float kernel: the same function.
    if dtype == torch.float32:
        assert rel_err(y, gemv(x, fr.dequantize_fp8(wq, ws), b, config)) <= 1e-5


@pytest.mark.parametrize("n,k,config", GEMV_SHAPES)
@pytest.mark.parametrize("fmt", ["channel", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_fp8_fused_prologues_match_unfused(n, k, config, fmt, dtype):
    wq, ws = _fp8_weight(n, k, fmt)
    tol = 1e-5 if dtype == torch.float32 else (1e-2 if EXACT_BF16 else 3e-2)
    xgu = (torch.randn(1, 2 * k) * 2).to(dtype)
    y = gemv_silu_mul(xgu, wq, config, weight_scale=ws)
    assert torch.equal(y, gemv(silu_and_mul(xgu), wq, config=config or _silu_config(n, k, fmt), weight_scale=ws))
    assert rel_err(y, gemv_silu_mul_ref(xgu, wq, weight_scale=ws)) <= tol
    x, res = torch.randn(1, k, dtype=dtype), (3 * torch.randn(1, k)).to(dtype)
    nw, b = (1 + 0.1 * torch.randn(k)).to(dtype), torch.randn(n, dtype=dtype)
    y, new_res = gemv_rms_norm(x, res, nw, 1e-5, wq, b, config, weight_scale=ws)
    res_unf = res.clone()
    y_unf = gemv(fused_add_rms_norm(x, res_unf, nw, 1e-5), wq, b, config or _rms_config(n, k, fmt), weight_scale=ws)
    assert torch.equal(new_res, res_unf) and torch.equal(y, y_unf)
    y_ref, _ = gemv_rms_norm_ref(x, res, nw, 1e-5, wq, b, weight_scale=ws)
    assert rel_err(y, y_ref) <= tol


def _silu_config(n: int, k: int, fmt: str) -> GemvConfig:
    return default_fp8_config(n, k, SILU_MUL, BLOCK if fmt == "block" else CHANNEL)


def _rms_config(n: int, k: int, fmt: str) -> GemvConfig:
    return default_fp8_config(n, k, RMS_NORM, BLOCK if fmt == "block" else CHANNEL)


def test_gemv_fp8_rejects_bad_scales():
    x = torch.randn(1, 200)
    wq, ws = _fp8_weight(8, 200, "block")
    with pytest.raises(ValueError, match="needs its weight_scale"):
        gemv(x, wq)
    with pytest.raises(ValueError, match="weight_scale is for"):
        gemv(x, torch.randn(8, 200), weight_scale=ws)
    with pytest.raises(ValueError, match="weight_scale must be"):
        gemv(x, wq, weight_scale=ws[:, :1].contiguous())
    with pytest.raises(ValueError, match="weight_scale must be"):
        gemv(x, wq, weight_scale=ws.double())


# ------------------------------------------------------------------------------------------------- GPU
# llama-3.1-8b: (N, K) of qkv, o, gate_up, down.
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(1, 4096), (17, 14336), (257, 4096), (3, 1000)])
@pytest.mark.parametrize("group", GROUPS)
def test_gpu_quantize_fp8_bit_exact(m, k, group):
    x = (torch.randn(m, k, device="cuda") * torch.exp(3 * torch.rand(m, 1, device="cuda") - 1.5)).bfloat16()
    q, s = fq.quantize_fp8(x, group)
    q_ref, s_ref = fr.quantize_fp8_ref(x, group)
    assert_same_codes(q, q_ref, "quantize_fp8 on GPU")  # hardware cvt.rn.satfinite: round to nearest even
    assert torch.equal(s, s_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 257, 4096])
@pytest.mark.parametrize("group", GROUPS)
def test_gpu_fused_quantize_match_unfused(m, group):
    dt = torch.bfloat16
    x, res = torch.randn(m, 4096, device="cuda", dtype=dt), torch.randn(m, 4096, device="cuda", dtype=dt) * 3
    w = 1 + 0.1 * torch.randn(4096, device="cuda", dtype=dt)
    r1, r2 = res.clone(), res.clone()
    q, s, _ = fq.add_rms_norm_fp8(x, r1, w, 1e-5, group)
    normed = fused_add_rms_norm(x, r2, w, 1e-5)
    q2, s2 = fq.quantize_fp8(normed, group)
    assert torch.equal(r1, r2)
    # Compiled separately, the two RMSNorm kernels do not always round alike: on an H200 about one code in
    # 10^6-10^7 moved by one step (a normed value one bf16 ulp apart). Bit-identical under the interpreter.
    flips = (q.float() != q2.float()).sum().item()
    assert flips <= q.numel() * 1e-4, f"add_rms_norm_fp8: {flips} codes differ from the unfused pair's"
    assert_quantized_near(q, s, q2, s2, 2e-3, "add_rms_norm_fp8 vs unfused", group)
    xgu = torch.randn(m, 2 * 14336, device="cuda", dtype=dt) * 2
    q, s = fq.silu_and_mul_fp8(xgu, group)
    q2, s2 = fq.quantize_fp8(silu_and_mul(xgu), group)
    assert_same_codes(q, q2, "silu_and_mul_fp8")
    assert torch.equal(s, s2)
    q_ref, s_ref = fq.silu_and_mul_fp8_ref(xgu, group)
    assert_quantized_near(q, s, q_ref, s_ref, 1e-2, "silu_and_mul_fp8 vs reference", group)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 255, 1024])
@pytest.mark.parametrize("n,k", LLAMA_8B[:2] + [(1000, 1000)])
def test_gpu_fp8_gemm_block(m, n, k):
    _, _, xq, xs, wq, ws = _block_operands(m, n, k, device="cuda")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = fg.fp8_gemm_block(xq, xs, wq, ws, bias, out_dtype=torch.float32)
    assert rel_err(y, fg.fp8_gemm_block_ref(xq, xs, wq, ws, bias, out_dtype=torch.float32)) <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 1024])
def test_gpu_fp8_gemm_channel(m):
    n, k = 6144, 4096
    xq, xs = fq.quantize_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), None)
    wq, ws = _fp8_weight(n, k, "channel", "cuda")
    y = fg.fp8_gemm_channel(xq, xs, wq, ws)
    assert rel_err(y, fg.fp8_gemm_channel_ref(xq, xs, wq, ws)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", LLAMA_8B)
@pytest.mark.parametrize("fmt", ["channel", "block"])
def test_gpu_gemv_fp8(n, k, fmt):
    dt = torch.bfloat16
    wq, ws = _fp8_weight(n, k, fmt, "cuda")
    x = torch.randn(1, k, device="cuda", dtype=dt)
    assert rel_err(gemv(x, wq, weight_scale=ws), gemv_ref(x, wq, weight_scale=ws)) <= 1e-2
    cfg = GemvConfig(16, 128, 4)  # one group per chunk (the default's chunks span several)
    assert rel_err(gemv(x, wq, None, cfg, weight_scale=ws), gemv_ref(x, wq, weight_scale=ws)) <= 1e-2
    xgu = torch.randn(1, 2 * k, device="cuda", dtype=dt)
    assert rel_err(gemv_silu_mul(xgu, wq, weight_scale=ws), gemv_silu_mul_ref(xgu, wq, weight_scale=ws)) <= 1e-2
    res, nw = torch.randn(1, k, device="cuda", dtype=dt), torch.ones(k, device="cuda", dtype=dt)
    y, _ = gemv_rms_norm(x, res, nw, 1e-5, wq, weight_scale=ws)
    assert rel_err(y, gemv_rms_norm_ref(x, res, nw, 1e-5, wq, weight_scale=ws)[0]) <= 1e-2


def _check_pipelined_loop(n: int, k: int, fmt: str, config: GemvConfig, device: str) -> None:
    """The K loop pipelined three deep (``gemv_config.STREAM_STAGES``: cp.async copies ahead on a GPU) gives the
    very bits of the unpipelined loop: the same chunks in the same order, for every prologue (the RMS one's residual
    included); ``fmt``: a bf16 weight or e4m3 with per-row or per-block scales."""
    dt = torch.bfloat16
    wq, ws = (torch.randn(n, k, device=device, dtype=dt) / k ** 0.5, None) if fmt == "bf16" else \
        _fp8_weight(n, k, fmt, device)
    one, deep = replace(config, num_stages=1), replace(config, num_stages=3)
    x, xgu = torch.randn(1, k, device=device, dtype=dt), torch.randn(1, 2 * k, device=device, dtype=dt)
    res, nw = torch.randn(1, k, device=device, dtype=dt), 1 + 0.1 * torch.randn(k, device=device, dtype=dt)
    assert torch.equal(gemv(x, wq, None, deep, weight_scale=ws), gemv(x, wq, None, one, weight_scale=ws))
    assert torch.equal(gemv_silu_mul(xgu, wq, deep, weight_scale=ws), gemv_silu_mul(xgu, wq, one, weight_scale=ws))
    y1, r1 = gemv_rms_norm(x, res.clone(), nw, 1e-5, wq, None, one, weight_scale=ws)
    y3, r3 = gemv_rms_norm(x, res.clone(), nw, 1e-5, wq, None, deep, weight_scale=ws)
    assert torch.equal(y3, y1) and torch.equal(r3, r1)
    assert rel_err(y3, gemv_rms_norm_ref(x, res, nw, 1e-5, wq, weight_scale=ws)[0]) <= 3e-2


def test_stream_stages_knob_names_itself():
    from minfer.kernels.gemm.gemv_config import MAX_STREAM_STAGES, stream_stages

    assert stream_stages("3") == 3 and stream_stages(str(MAX_STREAM_STAGES)) == MAX_STREAM_STAGES
    for bad in ("0", "x", "-2", "2.5", str(MAX_STREAM_STAGES + 1)):
        with pytest.raises(ValueError, match=r"MINFER_STREAM_STAGES must be an integer in \[1, 8\]"):
            stream_stages(bad)


@pytest.mark.parametrize("fmt", ["bf16", "channel", "block"])
def test_gemv_pipelined_k_loop_is_bit_equal(fmt):
    _check_pipelined_loop(24, 400, fmt, GemvConfig(8, 128, 4), "cpu")  # 3 whole chunks and a masked one


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(28672, 4096), (1000, 1000)])
@pytest.mark.parametrize("fmt", ["bf16", "channel", "block"])
def test_gpu_gemv_pipelined_k_loop_is_bit_equal(n, k, fmt):
    for config in (GemvConfig(8, 512, 4), GemvConfig(4, 1024, 8)):
        _check_pipelined_loop(n, k, fmt, config, "cuda")
