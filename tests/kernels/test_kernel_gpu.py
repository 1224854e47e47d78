"""The kernel checks at real model shapes, in bfloat16 and float16, on a CUDA GPU (`pytest -m gpu`)."""

import pytest
import torch

from kernel_testlib import (  # noqa: F401 (seed_per_case: autouse fixture)
    check_decode, check_prefill, check_rms_norm, check_silu_and_mul, check_store_kv, seed_per_case,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (q heads, kv heads, head dim) of qwen3-0.6b, llama-3.1-8b, llama-3.2-1b.
SHAPES = [(16, 8, 128), (32, 8, 128), (32, 8, 64)]
SHAPE_IDS = ["qwen3-0.6b", "llama-3.1-8b", "llama-3.2-1b"]
DTYPES = [torch.bfloat16, torch.float16]
DTYPE_IDS = ["bf16", "fp16"]
RAGGED = [1, 15, 16, 17, 80, 1000, 4096, 2500]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("num_splits", [None, 1, 7], ids=["auto", "s1", "s7"])
def test_decode(shape: tuple[int, int, int], dtype: torch.dtype, num_splits: int | None) -> None:
    check_decode(RAGGED, *shape, 16, dtype, "cuda", num_splits=num_splits)


@pytest.mark.parametrize("page,head_dim,dtype", [(32, 256, torch.bfloat16), (64, 128, torch.float32)])
def test_decode_other_pages(page: int, head_dim: int, dtype: torch.dtype) -> None:
    check_decode([1, 300, 5000], 8, 2, head_dim, page, dtype, "cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_prefill(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    # A whole prompt, a chunk starting mid-sequence, a single-row chunk and a short prompt.
    check_prefill([1000, 300, 1, 77], [1000, 2000, 513, 77], *shape, 16, dtype, "cuda")


@pytest.mark.parametrize("page,head_dim,dtype", [(32, 256, torch.bfloat16), (16, 128, torch.float32)])
def test_prefill_other(page: int, head_dim: int, dtype: torch.dtype) -> None:
    check_prefill([257, 64], [300, 64], 8, 2, head_dim, page, dtype, "cuda")


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32], ids=DTYPE_IDS + ["fp32"])
def test_elementwise(dtype: torch.dtype) -> None:
    check_store_kv(4099, 8, 128, 16, dtype, "cuda")
    check_rms_norm(1027, 4096, dtype, "cuda")
    check_rms_norm(513, 1024, dtype, "cuda")
    check_silu_and_mul(257, 14336, dtype, "cuda")
