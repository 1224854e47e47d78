"""Paged decode and prefill attention vs the float64 torch reference (CPU interpreter in CI)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from kernel_testlib import check_decode, check_prefill, seed_per_case  # noqa: F401 (autouse fixture)

PAGE = 16
# Ragged lengths: 1, page - 1, page, page + 1, five pages.
RAGGED = [1, PAGE - 1, PAGE, PAGE + 1, 5 * PAGE]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
def test_decode(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    check_decode(RAGGED, num_heads, num_kv_heads, head_dim, PAGE, dtype, "cpu", num_splits=1)


@pytest.mark.parametrize("num_splits", [3, 8])
def test_decode_split_k(num_splits: int) -> None:
    # 8 splits of a 15-token context leave empty splits: the merge must ignore them.
    check_decode(RAGGED, 8, 2, 64, PAGE, torch.bfloat16, "cpu", num_splits=num_splits)


def test_decode_default_heuristic_and_wide_pages() -> None:
    check_decode([3, 70, 200], 4, 1, 32, 64, torch.float32, "cpu")


def test_decode_fp16_head_dim_256() -> None:
    check_decode([5, 33], 4, 2, 256, 16, torch.float16, "cpu", num_splits=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"])
def test_prefill_varlen(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    # Whole prompts of different lengths: q_len == context_len.
    check_prefill([PAGE + 1, 1, 45], [PAGE + 1, 1, 45], num_heads, num_kv_heads, head_dim, PAGE, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_chunk_mid_sequence(dtype: torch.dtype) -> None:
    # Chunks that start after cached context (chunked prefill / prefix hit), mixed with a decode-like row
    # and a fresh prompt; q_len 40 spans two query blocks on the interpreter's 32-row tiles.
    check_prefill([40, 1, 7, PAGE], [5 * PAGE, 23, PAGE + 7, PAGE], 8, 2, 64, PAGE, dtype, "cpu")


def test_prefill_fp16_wide_pages() -> None:
    check_prefill([33, 9], [70, 9], 4, 4, 32, 32, torch.float16, "cpu")


@settings(max_examples=6, deadline=None, derandomize=True)
@given(
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=4),
    page=st.sampled_from([16, 32]),
    group=st.sampled_from([1, 2, 4]),
    splits=st.integers(1, 5),
)
def test_decode_property(lens: list[int], page: int, group: int, splits: int) -> None:
    check_decode(lens, 2 * group, 2, 32, page, torch.float32, "cpu", num_splits=splits)


@settings(max_examples=6, deadline=None, derandomize=True)
@given(data=st.data(), page=st.sampled_from([16, 32]), group=st.sampled_from([1, 4]))
def test_prefill_property(data: st.DataObject, page: int, group: int) -> None:
    ctx = data.draw(st.lists(st.integers(1, 80), min_size=1, max_size=3))
    q_lens = [data.draw(st.integers(1, c)) for c in ctx]
    check_prefill(q_lens, ctx, 2 * group, 2, 32, page, torch.float32, "cpu")
