"""Staged 8-bit prefill (``kv_stage.py``): the plan's pages and scratch table, the staged values against the
torch dequantization bit for bit, and prefill over the staged cache against the float64 reference on the codes
(windows, soft-capping and sinks included; pages before a window are NaN, so staging one would show). CPU
interpreter in CI; ``-m gpu`` runs the same on a GPU, the Hopper kernel included where it applies."""

import functools

import numpy as np
import pytest
import torch

from kernel_testlib import (  # noqa: F401 (seed_per_case: autouse fixture)
    check_prefill_quant, check_prefill_window, make_paged_kv, quantize_paged_kv, seed_per_case,
)
from minfer.kernels.attention.gluon_sm90 import sm90_available
from minfer.kernels.attention.kv_stage import conversions, plan_stage, stage_kv, staged_prefill_attention
from minfer.kernels.attention.prefill_attention import paged_prefill_attention
from minfer.kernels.attention.prefill_attention_sm90 import paged_prefill_attention_sm90
from minfer.kernels.quant.kv_quant import KV_QUANT_FORMATS, dequantize_ref

FORMATS = list(KV_QUANT_FORMATS)
PAGE = 16
STAGED = functools.partial(staged_prefill_attention, paged_prefill_attention)


def test_plan_stages_each_chunks_visible_pages() -> None:
    # Chunks: a whole 40-token prompt; 5 rows ending at token 70 with a 20-key window (its first row, at position
    # 65, sees keys 46..65: pages 2-4); a single row at position 15.
    plan = plan_stage([40, 70, 16], [40, 5, 1], PAGE, 6, 20, torch.device("cpu"))
    assert plan.pages == 3 + 3 + 1
    assert plan.seq.tolist() == [0, 0, 0, 1, 1, 1, 2]
    assert plan.col.tolist() == [0, 1, 2, 2, 3, 4, 0]  # chunk 0 from page 0: its first row's window starts there
    # Entries before a chunk's first staged page and past its last point at its own staged pages.
    assert plan.table.tolist() == [[0, 1, 2, 2, 2, 2], [3, 3, 3, 4, 5, 5], [6, 6, 6, 6, 6, 6]]
    no_window = plan_stage([40, 70], [40, 5], PAGE, 5, 0, torch.device("cpu"))
    assert no_window.pages == 3 + 5 and no_window.col.tolist() == [0, 1, 2, 0, 1, 2, 3, 4]


def test_plan_stages_only_what_the_converting_kernel_would_convert_often() -> None:
    """Staging pays where the prefill kernel would convert each key several times (once per 128-row query block):
    an 8k prompt yes, speculative verification (4 rows over a long context) and a short prompt no."""
    cpu = torch.device("cpu")
    assert conversions(np.array([8192]), np.array([8192])) == 8192 * 65 / 2
    assert conversions(np.array([2000]), np.array([4])) == 2000  # one block sees every key
    assert conversions(np.array([1000]), np.array([200])) == 2 * 800 + 200 * 3 / 2
    assert plan_stage([8192], [8192], PAGE, 512, 0, cpu, min_reuse=3) is not None
    assert plan_stage([2000, 1500], [4, 4], PAGE, 125, 0, cpu, min_reuse=3) is None
    assert plan_stage([300], [300], PAGE, 19, 0, cpu, min_reuse=3) is None  # 3 blocks: 2 conversions a key
    assert plan_stage([300], [300], PAGE, 19, 0, cpu, min_reuse=2) is not None
    # A window bounds the keys: 4 rows at the end of a 2000-token context with a 64-key window see 67 keys.
    assert plan_stage([2000], [4], PAGE, 125, 64, cpu, min_reuse=1).pages == 5


@pytest.mark.parametrize("ctx,q_lens,width", [([10], [11], 2), ([10], [0], 2), ([40], [1], 2)])
def test_plan_rejects_bad_lengths(ctx: list[int], q_lens: list[int], width: int) -> None:
    with pytest.raises(ValueError, match="query_len|pages"):
        plan_stage(ctx, q_lens, PAGE, width, 0, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_staged_values_are_the_dequantized_codes(kv_dtype: str, dtype: torch.dtype) -> None:
    """code * scale is exact in float32 (8 significant bits times 11), so one rounding to the scratch dtype
    gives torch's dequantization bit for bit."""
    kf, vf, table = make_paged_kv([37, 64], 2, 32, PAGE, torch.float32, "cpu")
    kc, vc, ks, vs = quantize_paged_kv(kf * 40, vf, kv_dtype)
    plan = plan_stage([37, 64], [37, 64], PAGE, table.shape[1], 0, torch.device("cpu"))
    k16, v16 = stage_kv(kc, vc, ks, vs, table, plan, dtype)
    for staged, codes, scales in ((k16, kc, ks), (v16, vc, vs)):
        for i, (s, c) in enumerate(zip(plan.seq.tolist(), plan.col.tolist())):
            blk = table[s, c]
            want = dequantize_ref(codes[blk], scales[blk].transpose(0, 1), dtype)
            assert torch.equal(staged[i], want), f"page {i} of {kv_dtype} staged as {dtype}"


def test_stage_kv_rejects_bad_arguments() -> None:
    kf, vf, table = make_paged_kv([20], 2, 32, PAGE, torch.float32, "cpu")
    kc, vc, ks, vs = quantize_paged_kv(kf, vf, "int8")
    plan = plan_stage([20], [20], PAGE, table.shape[1], 0, torch.device("cpu"))
    with pytest.raises(ValueError, match="8-bit cache"):
        stage_kv(kf, vf, None, None, table, plan, torch.bfloat16)
    with pytest.raises(TypeError, match="scratch dtype"):
        stage_kv(kc, vc, ks, vs, table, plan, torch.int8)
    with pytest.raises(ValueError, match="block_tables"):
        stage_kv(kc, vc, ks, vs, table[:, :1], plan, torch.bfloat16)


@pytest.mark.parametrize("kv_dtype,dtype", [("int8", torch.bfloat16), ("fp8_e4m3", torch.bfloat16),
                                             ("fp8_e5m2", torch.float16)], ids=["int8", "fp8_e4m3", "fp8_e5m2-fp16"])
def test_staged_prefill_matches_reference(kv_dtype: str, dtype: torch.dtype) -> None:
    # A whole prompt, a chunk after cached context (two query tiles), a single row.
    check_prefill_quant([PAGE + 1, 40, 1], [PAGE + 1, 3 * PAGE, 23], 8, 2, 64, PAGE, kv_dtype, dtype, "cpu",
                        kernel=STAGED)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_staged_prefill_window_softcap_sinks(kv_dtype: str) -> None:
    """Pages wholly before a chunk's window hold NaN: staging reads none of them."""
    sinks = torch.randn(8)
    check_prefill_window([40, 7, 21], [90, 30, 21], 8, 2, 32, PAGE, torch.bfloat16, "cpu", window=21, softcap=2.0,
                         kv_dtype=kv_dtype, stale="nan", kernel=STAGED, sinks=sinks)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_staged_prefill_gpu(kv_dtype: str) -> None:
    """On the GPU, over the kernel the engine stages for: the Hopper kernel where it applies."""
    kernel = paged_prefill_attention_sm90 if sm90_available(torch.device("cuda"), 128, PAGE) else \
        paged_prefill_attention
    staged = functools.partial(staged_prefill_attention, kernel)
    check_prefill_quant([1000, 300, 1, 77], [1000, 2000, 513, 77], 32, 8, 128, PAGE, kv_dtype, torch.bfloat16,
                        "cuda", kernel=staged)
    check_prefill_window([300, 7, 200], [2000, 30, 200], 32, 8, 128, PAGE, torch.bfloat16, "cuda", window=256,
                         kv_dtype=kv_dtype, stale="nan", kernel=staged)
