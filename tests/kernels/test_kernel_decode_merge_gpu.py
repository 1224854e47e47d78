"""The fused split-K merge on an sm_90 GPU (`pytest -m gpu`): the Hopper kernels (16-bit and 8-bit caches) and the
Triton kernel, each with the merge in the split kernel and with the merge kernel, against the float64 reference, at
batch 1 x 32k (llama-3.1-8b heads) and ragged batches with empty splits; every call twice and under CUDA-graph
replay, the counters zero after each."""

import pytest
import torch

from kernel_testlib import make_paged_kv, rel_err, seed_per_case  # noqa: F401 (seed_per_case: autouse fixture)
from minfer.kernels.attention import decode_attention_sm90 as sm90
from minfer.kernels.attention.attention_ref import paged_decode_attention_ref
from minfer.kernels.attention.decode_attention import paged_decode_attention
from minfer.kernels.attention.decode_attention_sm90 import paged_decode_attention_sm90
from minfer.kernels.attention.gluon_sm90 import sm90_available
from test_kernel_decode_merge import assert_counters_zero, check_merge_paths

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not sm90_available(torch.device("cuda"), 128, 16),
                       reason="needs an sm_90 GPU and Triton's Gluon"),
]

RAGGED = [1, 15, 65, 1000, 4096]  # with 64 splits all but the last have empty splits, the first three one live split
KERNELS = {"gluon": paged_decode_attention_sm90, "triton": paged_decode_attention}


@pytest.fixture(autouse=True)
def the_hopper_kernel_ran():
    """A Gluon build failure falls back to the Triton kernel: a test that passed that way tested the wrong kernel."""
    yield
    assert not sm90._guard.failed, "the Hopper kernel did not build (see the warning): the Triton kernel ran instead"


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("splits", [None, 16, 33], ids=["heuristic", "16", "33"])
def test_fused_merge_batch1_32k(kernel: str, splits: int | None) -> None:
    check_merge_paths(KERNELS[kernel], [32768], 32, 8, 128, 16, torch.bfloat16, "cuda", splits, tol=1e-2)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8_e4m3"], ids=["bf16", "int8", "fp8"])
@pytest.mark.parametrize("shape", [(32, 8, 128), (64, 4, 128), (16, 8, 64)], ids=["llama-8b", "gqa16", "d64"])
@pytest.mark.parametrize("splits", [2, 7, 64])
def test_fused_merge_ragged(kernel: str, kv_dtype: str | None, shape: tuple[int, int, int], splits: int) -> None:
    check_merge_paths(KERNELS[kernel], RAGGED, *shape, 16, torch.bfloat16, "cuda", splits, kv_dtype=kv_dtype,
                      tol=1e-2)


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_fused_merge_graph_replays(kernel: str) -> None:
    """Captured once, replayed three times as the contexts grow: the counters the capture's launch left at zero
    are back at zero after every replay, and every replay's output is right."""
    ctx_lens = [1, 700, 45, 5000]
    kc, vc, table = make_paged_kv([c + 300 for c in ctx_lens], 8, 128, 16, torch.bfloat16, "cuda")
    lens = torch.tensor(ctx_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(ctx_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    args = (q, kc, vc, table, lens, 128 ** -0.5)
    KERNELS[kernel](*args, out=out, num_splits=9, fused_merge=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        KERNELS[kernel](*args, out=out, num_splits=9, fused_merge=True)
    for grow in (0, 100, 200):
        lens.add_(grow)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_counters_zero(q.device)
        ref = paged_decode_attention_ref(q.double(), kc.double(), vc.double(), table, lens, 128 ** -0.5)
        assert rel_err(out, ref) < 1e-2, (grow, rel_err(out, ref))
