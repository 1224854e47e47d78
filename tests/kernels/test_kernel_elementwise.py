"""KV store, RMSNorm and SwiGLU kernels vs their torch references (CPU interpreter in CI); rotary is
tested inside the fused store kernel (test_kernel_rope_store.py)."""

import pytest
import torch

from kernel_testlib import (  # noqa: F401 (seed_per_case: autouse fixture)
    check_rms_norm, check_silu_and_mul, check_store_kv, seed_per_case,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (1, 128), (3, 32)])
def test_store_kv(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    check_store_kv(37, num_kv_heads, head_dim, 16, dtype, "cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("hidden", [64, 1000])
def test_rms_norm(hidden: int, dtype: torch.dtype) -> None:
    check_rms_norm(9, hidden, dtype, "cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("inter", [64, 1500])
def test_silu_and_mul(inter: int, dtype: torch.dtype) -> None:
    check_silu_and_mul(5, inter, dtype, "cpu")
