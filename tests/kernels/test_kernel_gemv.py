"""Batch-1 matrix-vector kernel (interpreter on CPU) against a float32 reference and torch's linear."""
from __future__ import annotations

import pytest
import torch

from minfer.kernels.gemv import GemvConfig, gemv, gemv_ref


@pytest.mark.parametrize("n,k,bias,config", [
    (64, 128, False, None),
    (50, 200, True, None),                       # ragged rows and columns: the masked path
    (96, 256, False, GemvConfig(16, 64, 4)),     # several K iterations, even shapes
    (33, 1024, True, GemvConfig(4, 256, 4)),
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
@pytest.mark.parametrize("n,k", [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (4096, 1024)])
def test_gemv_on_gpu_matches_reference(n, k):
    torch.manual_seed(0)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    torch.testing.assert_close(gemv(x, w), gemv_ref(x, w), rtol=1e-2, atol=1e-2)
