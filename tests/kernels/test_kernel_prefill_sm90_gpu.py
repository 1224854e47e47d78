"""The Hopper (Gluon) paged prefill kernel against the float64 reference and the Triton kernel it
stands in for, on an sm_90 GPU (`pytest -m gpu`): page sizes, GQA ratios, head dims, 16-bit dtypes,
every 8-bit cache format, chunks that start mid-sequence and lengths that are not multiples of the
128-row tiles."""

import pytest
import torch

from kernel_testlib import (  # noqa: F401 (seed_per_case: autouse fixture)
    check_prefill, check_prefill_quant, make_paged_kv, quantize_paged_kv, rel_err, seed_per_case,
)
from minfer.kernels.attention import prefill_attention_sm90 as sm90
from minfer.kernels.attention.prefill_attention import paged_prefill_attention
from minfer.kernels.attention.gluon_sm90 import sm90_available
from minfer.kernels.attention.prefill_attention_sm90 import paged_prefill_attention_sm90

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not sm90_available(torch.device("cuda"), 128, 16),
                       reason="needs an sm_90 GPU and Triton's Gluon"),
]

@pytest.fixture(autouse=True)
def the_hopper_kernel_ran():
    """The entry point falls back to the Triton kernel if the Gluon kernel fails to build: a test that passed
    that way tested the wrong kernel."""
    yield
    assert not sm90._guard.failed, "the Hopper kernel did not build (see the warning): the Triton kernel ran instead"


def batch(q_lens: list[int], ctx_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(query_start_loc, context_lens) of a varlen prefill batch, on the GPU."""
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).int().cuda()
    return qsl, torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")


# A whole prompt, a chunk starting mid-sequence, a single-row chunk, a short prompt, an overhanging tile.
Q_LENS = [1000, 300, 1, 77, 129]
CTX_LENS = [1000, 2000, 513, 77, 4000]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(16, 8, 128), (32, 8, 128), (32, 8, 64), (8, 8, 128), (32, 4, 128)],
                         ids=["qwen3-0.6b", "llama-3.1-8b", "llama-3.2-1b", "mha", "gqa8"])
def test_prefill_sm90(shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    check_prefill(Q_LENS, CTX_LENS, *shape, 16, dtype, "cuda", kernel=paged_prefill_attention_sm90)


@pytest.mark.parametrize("page", [32, 64, 128, 256])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_sm90_pages(page: int, head_dim: int) -> None:
    check_prefill(Q_LENS, CTX_LENS, 16, 4, head_dim, page, torch.bfloat16, "cuda", kernel=paged_prefill_attention_sm90)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("shape,page", [((32, 8, 128), 16), ((16, 8, 128), 64), ((32, 8, 64), 16), ((8, 8, 128), 256)],
                         ids=["8b-p16", "0.6b-p64", "1b-p16", "mha-p256"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_prefill_sm90_quant(kv_dtype: str, shape: tuple[int, int, int], page: int, dtype: torch.dtype) -> None:
    check_prefill_quant(Q_LENS, CTX_LENS, *shape, page, kv_dtype, dtype, "cuda", kernel=paged_prefill_attention_sm90)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_prefill_sm90_quant_matches_triton(kv_dtype: str) -> None:
    """Over 8-bit caches both kernels take float16 products on exactly converted codes and scale the same
    columns: they agree to float16 rounding."""
    q_lens, ctx_lens = [4096, 1000], [4096, 3000]
    kf, vf, table = make_paged_kv(ctx_lens, 8, 128, 16, torch.float32, "cuda")
    kc, vc, ks, vs = quantize_paged_kv(kf, vf, kv_dtype)
    qsl, lens = batch(q_lens, ctx_lens)
    q = torch.randn(sum(q_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, kc, vc, table, qsl, lens, max(q_lens), 128 ** -0.5)
    fast = paged_prefill_attention_sm90(*args, k_scale=ks, v_scale=vs)
    ref = paged_prefill_attention(*args, k_scale=ks, v_scale=vs)
    assert rel_err(fast, ref) < 4e-3


def test_prefill_sm90_matches_triton() -> None:
    """Both kernels round P to bf16 before P·V and accumulate in float32: they agree far inside the
    bf16 tolerance, so a systematic error in either shows here."""
    q_lens, ctx_lens = [8192, 2048, 1024], [8192, 6144, 1024]
    k_cache, v_cache, table = make_paged_kv(ctx_lens, 8, 128, 16, torch.bfloat16, "cuda")
    qsl, lens = batch(q_lens, ctx_lens)
    q = torch.randn(sum(q_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, k_cache, v_cache, table, qsl, lens, max(q_lens), 128 ** -0.5)
    fast, ref = paged_prefill_attention_sm90(*args), paged_prefill_attention(*args)
    assert rel_err(fast, ref) < 4e-3


def test_prefill_sm90_strided_q_and_graph() -> None:
    """q as a slice of a fused qkv projection (row stride > Hq*D), launched inside a CUDA graph."""
    q_lens, ctx_lens = [300, 45], [700, 45]
    k_cache, v_cache, table = make_paged_kv(ctx_lens, 8, 128, 16, torch.bfloat16, "cuda")
    qsl, lens = batch(q_lens, ctx_lens)
    qkv = torch.randn(sum(q_lens), (32 + 16) * 128, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :32 * 128].view(-1, 32, 128)
    args = (q, k_cache, v_cache, table, qsl, lens, max(q_lens), 128 ** -0.5)
    out = torch.full_like(q, float("nan"), memory_format=torch.contiguous_format)
    paged_prefill_attention_sm90(*args, out=out)  # compile outside the capture
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_prefill_attention_sm90(*args, out=out)
    graph.replay()
    torch.cuda.synchronize()
    ref = paged_prefill_attention(q.contiguous(), *args[1:])
    assert rel_err(out, ref) < 4e-3
