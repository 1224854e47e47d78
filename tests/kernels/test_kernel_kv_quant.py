"""8-bit KV caches (int8, fp8 e4m3/e5m2): quantization error bounds, the store kernel against its
reference bit for bit, and the decode/prefill kernels and the engine's torch path against the
float64 reference on the same codes and scales (CPU interpreter in CI; `-m gpu` on a GPU), and the
sm_90 SASS of the 8-bit decode loop (compiled on the CPU)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from kernel_testlib import (  # noqa: F401 (seed_per_case: autouse fixture)
    assert_close, check_decode_quant, check_prefill_quant, check_store_kv_quant, make_paged_kv, quantize_paged_kv,
    seed_per_case,
)
from minfer.kernels.attention.decode_attention import DecodeConfig, paged_decode_attention_ref
from minfer.kernels.attention.prefill_attention import paged_prefill_attention_ref
from minfer.kernels.quant.kv_quant import KV_QUANT_FORMATS, dequantize_ref, quantize_ref
from minfer.kernels.quant.quant import split_q_int8
from minfer.ops import AttentionMetadata
from minfer.ops.torch_attention import torch_decode_attention, torch_prefill_attention

FORMATS = list(KV_QUANT_FORMATS)
PAGE = 16


@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32], ids=["s16", "s32"])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_round_trip_error_bounds(kv_dtype: str, scale_dtype: torch.dtype) -> None:
    """Per element: int8 within half a step (scale / 2); fp8 within half an ulp of the value
    (2^-(mantissa+1) relative), or half the subnormal spacing near zero."""
    fmt = KV_QUANT_FORMATS[kv_dtype]
    # Rows of one (token, head) whose magnitudes span 1e-6 .. 1e4, plus an all-zero row.
    x = torch.randn(512, 4, 128) * torch.logspace(-6, 4, 512)[:, None, None]
    x[0, 0] = 0
    codes, scale = quantize_ref(x, fmt, scale_dtype)
    assert codes.dtype == fmt.dtype and scale.dtype == scale_dtype and scale.shape == x.shape[:-1]
    assert torch.isfinite(scale).all() and (scale > 0).all()
    back = dequantize_ref(codes, scale, torch.float64)
    err = (back - x.double()).abs()
    s = scale.double()[..., None]
    if fmt.is_int:
        assert codes.abs().max() <= 127
        bound = s / 2 * (1 + 1e-4)  # slack: x / scale is itself rounded to float32 (127 * 2^-24 of a step)
    else:
        rel = 2.0 ** -(fmt.mantissa_bits + 1)
        subnormal_step = s * 2.0 ** (fmt.min_exponent - fmt.mantissa_bits)
        bound = torch.maximum(x.double().abs() * rel, subnormal_step / 2) * (1 + 1e-4)
    assert (err <= bound).all(), f"worst excess {(err - bound).max():.3e}"
    assert (back[0, 0] == 0).all()
    # The largest magnitude of a row is kept (up to the scale's own rounding): the range is used fully.
    amax, amax_back = x.abs().amax(-1).double(), back.abs().amax(-1)
    big = amax > 1e-2  # rows above the scale dtype's smallest-normal clamp
    assert ((amax_back[big] / amax[big] - 1).abs() < 2.0 ** -(fmt.mantissa_bits or 7)).all()


@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("dtype,scale_dtype", [(torch.float32, torch.float16), (torch.bfloat16, torch.float32)],
                         ids=["fp32-s16", "bf16-s32"])
def test_store_kv_quant(kv_dtype: str, dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
    check_store_kv_quant(37, 3, 32, PAGE, kv_dtype, dtype, scale_dtype, "cpu")


@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("num_heads,num_kv_heads,splits,dtype,column_sums", [
    (8, 2, 1, torch.float32, False), (8, 2, 3, torch.bfloat16, True), (2, 2, 2, torch.float16, False),
    (8, 1, 2, torch.bfloat16, False)],
    ids=["gqa4", "gqa4-split-bf16-colsums", "mha-split-fp16", "gqa8-split-bf16"])
def test_decode_quant(kv_dtype: str, num_heads: int, num_kv_heads: int, splits: int, dtype: torch.dtype,
                      column_sums: bool) -> None:
    # A 16-bit q takes the float16 / integer-MMA path (int8: q split into two int8 parts), float32 q
    # the float32 one; column_sums: the softmax denominators summed once at the end.
    cfg = DecodeConfig(block_n=32, num_warps=4, num_stages=1, column_sums=column_sums)
    check_decode_quant([1, PAGE - 1, PAGE + 1, 5 * PAGE], num_heads, num_kv_heads, 64, PAGE, kv_dtype, dtype, "cpu",
                       num_splits=splits, config=cfg)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_decode_quantization_error(kv_dtype: str) -> None:
    # Relative change of the output vs attention over the unquantized N(0, 1) cache, measured over 40
    # cases: int8 max 0.74%, fp8_e4m3 3.2%, fp8_e5m2 5.9% (median 0.61 / 2.7 / 5.4%). A missing or
    # misplaced scale gives ~100%.
    bound = {"int8": 0.015, "fp8_e4m3": 0.05, "fp8_e5m2": 0.1}[kv_dtype]
    check_decode_quant([1, PAGE - 1, PAGE + 1, 5 * PAGE], 8, 2, 64, PAGE, kv_dtype, torch.float32, "cpu",
                       num_splits=2, max_quant_err=bound)


@pytest.mark.parametrize("kv_dtype,dtype", [("int8", torch.float32), ("fp8_e4m3", torch.float32),
                                             ("fp8_e5m2", torch.float32), ("int8", torch.bfloat16),
                                             ("fp8_e4m3", torch.bfloat16), ("fp8_e5m2", torch.float16)],
                         ids=["int8", "fp8_e4m3", "fp8_e5m2", "int8-bf16", "fp8_e4m3-bf16", "fp8_e5m2-fp16"])
def test_prefill_quant(kv_dtype: str, dtype: torch.dtype) -> None:
    # A whole prompt, a chunk after cached context (two query tiles), a single row.
    check_prefill_quant([PAGE + 1, 40, 1], [PAGE + 1, 3 * PAGE, 23], 8, 2, 64, PAGE, kv_dtype, dtype, "cpu")


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_engine_torch_path_matches_reference(kv_dtype: str) -> None:
    """The torch ops' attention (minfer/ops/torch_attention.py, the engine's CPU path) on quantized caches equals the
    kernels' reference: the same codes, the same scales, the same attention."""
    ctx, q_lens, hq, hkv, d = [5, 40, 17, 33], [1, 1, 17, 9], 8, 2, 32
    kf, vf, table = make_paged_kv(ctx, hkv, d, PAGE, torch.float32, "cpu")
    kc, vc, ks, vs = quantize_paged_kv(kf, vf, kv_dtype)
    scales = dict(k_scale=ks, v_scale=vs)
    lens = torch.tensor(ctx, dtype=torch.int32)
    qsl = torch.tensor([0] + q_lens).cumsum(0).int()
    q = torch.randn(sum(q_lens), hq, d)
    meta = AttentionMetadata(
        slot_mapping=[torch.empty(0, dtype=torch.long)], block_tables=[table], context_lens=lens, num_decodes=2,
        block_size=PAGE, prefill_query_start_loc=qsl[2:] - 2, max_prefill_query_len=17, context_lens_host=ctx,
        query_lens_host=q_lens)
    dec = torch_decode_attention(q[:2], kc, vc, meta, d ** -0.5, **scales)
    ref = paged_decode_attention_ref(q[:2].double(), kc, vc, table[:2], lens[:2], d ** -0.5, **scales)
    assert_close(dec, ref, torch.float32, "torch decode path")
    pre = torch_prefill_attention(q, kc, vc, meta, d ** -0.5, **scales)
    ref = paged_prefill_attention_ref(q[2:].double(), kc, vc, table[2:], qsl[2:] - 2, lens[2:], 17, d ** -0.5, **scales)
    assert_close(pre, ref, torch.float32, "torch prefill path")


def test_scales_are_required_and_checked() -> None:
    from minfer.kernels.attention.decode_attention import paged_decode_attention
    from minfer.kernels.kv_store import store_kv

    kf, vf, table = make_paged_kv([5], 2, 32, PAGE, torch.float32, "cpu")
    kc, vc, ks, vs = quantize_paged_kv(kf, vf, "int8")
    q, lens = torch.randn(1, 2, 32), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        paged_decode_attention(q, kc, vc, table, lens, 1.0)
    with pytest.raises(ValueError, match=r"num_kv_heads, block_size"):
        paged_decode_attention(q, kc, vc, table, lens, 1.0, k_scale=ks.transpose(1, 2), v_scale=vs)
    with pytest.raises(ValueError, match="belong to 8-bit caches"):
        store_kv(q, q, kf, vf, torch.tensor([0]), ks, vs)


GPU_SHAPES = [(32, 8, 128), (32, 8, 64)]  # llama-3.1-8b, llama-3.2-1b heads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_dtype", FORMATS)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=["llama-3.1-8b", "llama-3.2-1b"])
@pytest.mark.parametrize("splits", [None, 1], ids=["auto", "s1"])
@pytest.mark.parametrize("config", [None, DecodeConfig(64, 4, 2)], ids=["default", "64-tiles"])
def test_decode_quant_gpu(kv_dtype: str, shape: tuple[int, int, int], splits: int | None,
                          config: DecodeConfig | None) -> None:
    check_decode_quant([1, 15, 16, 17, 1000, 4096], *shape, PAGE, kv_dtype, torch.bfloat16, "cuda", num_splits=splits,
                       config=config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_prefill_and_store_quant_gpu(kv_dtype: str) -> None:
    check_prefill_quant([1000, 300, 1, 77], [1000, 2000, 513, 77], 32, 8, 128, PAGE, kv_dtype, torch.bfloat16, "cuda")
    check_store_kv_quant(4099, 8, 128, PAGE, kv_dtype, torch.bfloat16, torch.float16, "cuda")


@triton.jit
def _split_q_kernel(Q, HI, LO, S, ROWS: tl.constexpr, DIM: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * DIM + tl.arange(0, DIM)[None, :]
    hi, lo, scale = split_q_int8(tl.load(Q + offs))
    tl.store(HI + offs, hi)
    tl.store(LO + offs, lo)
    tl.store(S + tl.arange(0, ROWS), scale)


def test_split_q_int8_keeps_15_bits() -> None:
    """decode's int8 Q·Kᵀ splits q per row into q ≈ scale·(hi + lo/256): every element within 1/256 of a
    step (2^-15 of the row's largest magnitude), both parts inside int8, an all-zero row exact."""
    q = torch.randn(16, 64) * torch.logspace(-3, 3, 16)[:, None]
    q[3] = 0
    q[5, 7] = -q[5].abs().max() * 2  # a negative extreme
    hi, lo = torch.empty(16, 64, dtype=torch.int8), torch.empty(16, 64, dtype=torch.int8)
    scale = torch.empty(16)
    _split_q_kernel[(1,)](q, hi, lo, scale, ROWS=16, DIM=64)
    back = scale.double()[:, None] * (hi.double() + lo.double() / 256)
    err = (back - q.double()).abs()
    assert (err <= scale.double()[:, None] / 256 * (1 + 1e-3)).all(), f"worst {(err / scale[:, None]).max():.3e} steps"
    assert hi.abs().max() <= 127 and lo.abs().max() <= 127
    assert (back[3] == 0).all() and (hi[5, 7] == -127)


def test_8bit_decode_loop_sass() -> None:
    """The 8-bit decode loop, compiled for sm_90 here (Triton ships ptxas and nvdisasm; no GPU needed),
    keeps the shape its speed rests on: V converted before the MMA's layout change (no byte-wise
    shared-memory loads), no I2F/F2F conversions, and int8 Q·Kᵀ on the integer MMA. A Triton upgrade
    or a kernel change that undoes one of these fails here instead of silently costing ~30%."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0")  # a real compile, in a fresh process
    res = subprocess.run([sys.executable, str(root / "dev" / "sass_stats.py"), "--kv",
                          "int8,fp8_e4m3,fp8_e5m2", "--check"], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("byte LDS 0") == 3, res.stdout
