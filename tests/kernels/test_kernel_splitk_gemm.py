"""The split-K FP8 GEMM of decode batches (``splitk_gemm.py``) against the channel reference, under the interpreter
at small odd shapes (its ``tl.dot`` is exact there, so only the float32 summation order differs) and on a GPU at
llama-3.1-8b's decode shapes (against cuBLAS too); the ticket counters are back at zero after every launch, and the
split sum does not depend on which program finishes last."""
from __future__ import annotations

import pytest
import torch
from kernel_testlib import rel_err, seed_per_case  # noqa: F401 (seed_per_case: autouse fixture)

from minfer.kernels.gemm import fp8_gemm as fg
from minfer.kernels.gemm import splitk_gemm as fs
from minfer.kernels.quant import fp8_quant as fq
from minfer.kernels.quant import fp8_ref as fr


def _operands(m: int, n: int, k: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    xq, xs = fq.quantize_fp8(torch.randn(m, k, device=device, dtype=torch.bfloat16), None)
    wq, ws = fr.quantize_fp8_ref(torch.randn(n, k, device=device) / k ** 0.5, None)
    return xq, xs, wq, ws.contiguous()


@pytest.mark.parametrize("m,n,k", [(3, 33, 200), (17, 65, 300), (70, 129, 520)])
@pytest.mark.parametrize("config", [fs.SplitKConfig(16, 32, 1), fs.SplitKConfig(16, 32, 3),
                                    fs.SplitKConfig(32, 64, 2, block_k=64), None],
                         ids=["unsplit", "split3", "split2-k64", "auto"])
def test_splitk_matches_reference(m, n, k, config):
    """Every split count, ragged K (the last stretch masked), rows and columns past the tiles; with and without
    bias, float32 and bf16 outputs; the tickets are zero again afterwards."""
    xq, xs, wq, ws = _operands(m, n, k)
    bias = torch.randn(n, dtype=torch.bfloat16)
    for b in (None, bias):
        y = fs.fp8_gemm_splitk(xq, xs, wq, ws, b, out_dtype=torch.float32, config=config)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert rel_err(y, fg.fp8_gemm_channel_ref(xq, xs, wq, ws, b, out_dtype=torch.float32)) <= 1e-5
    y16 = fs.fp8_gemm_splitk(xq, xs, wq, ws, bias, config=config)
    assert y16.dtype == torch.bfloat16
    assert rel_err(y16, fg.fp8_gemm_channel_ref(xq, xs, wq, ws, bias)) <= 1e-2
    if config is not None and config.split > 1:
        assert int(fs._tickets[torch.device("cpu")].abs().sum()) == 0


def test_splitk_sum_is_in_stretch_order():
    """The split result equals the stretches' float32 products added in order 0, 1, 2 (what the last program
    does whichever it is), not merely something close: the kernel's sum is fixed, so runs agree bit for bit."""
    m, n, k = 5, 48, 384
    xq, xs, wq, ws = _operands(m, n, k)
    cfg = fs.SplitKConfig(16, 16, 3)
    y = fs.fp8_gemm_splitk(xq, xs, wq, ws, out_dtype=torch.float32, config=cfg)
    parts = [xq[:, s:s + 128].float() @ wq[:, s:s + 128].float().T for s in range(0, k, 128)]
    expected = ((parts[0] + parts[1]) + parts[2]) * xs[:, None] * ws[None, :]
    assert torch.allclose(y, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(y, fs.fp8_gemm_splitk(xq, xs, wq, ws, out_dtype=torch.float32, config=cfg))


def test_splitk_config_fills_the_sms():
    """About two programs an SM, each stretch of K at least ten k-steps: llama-3.1-8b's projections at decode batch
    sizes on 132 SMs get the splits measured best (qkv 2, o 3, down 4, gate_up unsplit on 128-wide tiles)."""
    for m in (1, 16, 64):
        picks = [fs.splitk_config(m, n, k, 132) for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))]
        assert [(c.block_m, c.block_n, c.split) for c in picks] == [(64, 64, 2), (64, 64, 3), (64, 128, 1), (64, 64, 4)]
    assert fs.splitk_config(16, 4096, 1024, 132).split == 1  # 8 k-steps: too short a K to split
    assert fs.splitk_config(128, 4096, 14336, 132).split == 2  # twice the row tiles, half the split
    assert fs.splitk_config(16, 512, 14336, 8).split == 2  # a small GPU: the programs fill its few SMs


def test_splitk_rejects_bad_arguments():
    xq, xs, wq, ws = _operands(4, 32, 64)
    with pytest.raises(ValueError, match="w_scale"):
        fs.fp8_gemm_splitk(xq, xs, wq, ws[:1].contiguous())
    with pytest.raises(TypeError):
        fs.fp8_gemm_splitk(xq.float(), xs, wq, ws)
    with pytest.raises(ValueError, match="contiguous"):
        fs.fp8_gemm_splitk(xq, xs, wq.t().contiguous().t(), ws)
    with pytest.raises(ValueError, match="contiguous"):
        fs.fp8_gemm_splitk(xq, torch.ones(8)[::2], wq, ws)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4, 16, 64, 130])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gpu_splitk(m, n, k):
    """llama-3.1-8b's projections at decode batch sizes: near the float32 reference (each 128-deep product is
    promoted to float32; a whole stretch accumulated in the FP8 MMA's reduced-precision adder measured ~1e-3 at
    these K), as close as bf16 rounding to cuBLAS's row-wise ``_scaled_mm``, repeatable bit for bit, tickets zero
    afterwards."""
    xq, xs, wq, ws = _operands(m, n, k, "cuda")
    y = fs.fp8_gemm_splitk(xq, xs, wq, ws, out_dtype=torch.float32)
    ref = fg.fp8_gemm_channel_ref(xq, xs, wq, ws, out_dtype=torch.float32)
    err = rel_err(y, ref)
    fast = fs.splitk_config(m, n, k, 132)
    fast_err = rel_err(fs.fp8_gemm_splitk(xq, xs, wq, ws, out_dtype=torch.float32,
                                          config=fs.SplitKConfig(**{**fast.__dict__, "fast_accum": True})), ref)
    print(f"M={m} N={n} K={k}: rel err {err:.1e} (fast accumulation {fast_err:.1e})")
    assert err <= 3e-4
    y16 = fs.fp8_gemm_splitk(xq, xs, wq, ws)
    assert rel_err(y16, fg.fp8_gemm_channel(xq, xs, wq, ws)) <= 1e-2
    assert torch.equal(y16, fs.fp8_gemm_splitk(xq, xs, wq, ws))
    tickets = fs._tickets.get(y.device)  # none until a launch splits
    assert tickets is None or int(tickets.abs().sum()) == 0


@pytest.mark.gpu
def test_gpu_splitk_in_a_cuda_graph():
    """Captured after an eager warm-up (which makes the tickets) and replayed over new inputs."""
    m, n, k = 40, 4096, 14336
    xq, xs, wq, ws = _operands(m, n, k, "cuda")
    fs.fp8_gemm_splitk(xq, xs, wq, ws)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fs.fp8_gemm_splitk(xq, xs, wq, ws)
    xq2, xs2, _, _ = _operands(m, n, k, "cuda")
    xq.copy_(xq2)
    xs.copy_(xs2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, fs.fp8_gemm_splitk(xq, xs, wq, ws))
