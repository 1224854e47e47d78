"""Programmatic dependent launch: off on the CPU, and on a GPU a CUDA graph of PDL launches computes
exactly what plain launches compute (a kernel that read its input before the previous kernel
finished would differ, on some replay)."""
from __future__ import annotations

import pytest
import torch

from kernel_testlib import seed_per_case  # noqa: F401 (autouse fixture)
from minfer.kernels.activation import silu_and_mul
from minfer.kernels.gemm.gemv import gemv, gemv_rms_norm, gemv_silu_mul
from minfer.kernels.pdl import launch_options, use_pdl
from minfer.kernels.rmsnorm import fused_add_rms_norm


def test_pdl_is_off_on_the_cpu_and_for_the_interpreter(monkeypatch):
    assert not use_pdl(torch.device("cpu"))
    assert launch_options(False) == {}


def _layer_chain(x, residual, w):
    """A batch-1 decoder layer's kernels without attention: norm+qkv, o, norm+gate_up, silu+down, then the
    unfused norm, SwiGLU and gemv once more (every kernel kind that PDL launches, back to back)."""
    qkv, residual = gemv_rms_norm(x, residual, w["n1"], 1e-6, w["qkv"])
    h = gemv(qkv[:, :w["o"].shape[1]].contiguous(), w["o"])
    gu, residual = gemv_rms_norm(h, residual, w["n2"], 1e-6, w["gate_up"])
    out = gemv_silu_mul(gu, w["down"])
    normed = fused_add_rms_norm(out, residual, w["n1"], 1e-6)
    return gemv(silu_and_mul(gemv(normed, w["gate_up"])), w["down"]), residual


@pytest.mark.gpu
def test_pdl_graph_replays_equal_plain_launches(monkeypatch):
    k, inter = 2048, 8192
    dev = "cuda"
    w = {"n1": torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5,
         "n2": torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5,
         "qkv": torch.randn(3072, k, device=dev, dtype=torch.bfloat16) / k ** 0.5,
         "o": torch.randn(k, k, device=dev, dtype=torch.bfloat16) / k ** 0.5,
         "gate_up": torch.randn(2 * inter, k, device=dev, dtype=torch.bfloat16) / k ** 0.5,
         "down": torch.randn(k, inter, device=dev, dtype=torch.bfloat16) / inter ** 0.5}
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    res = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    monkeypatch.setenv("MINFER_PDL", "0")
    ref_out, ref_res = _layer_chain(x, res.clone(), w)
    monkeypatch.setenv("MINFER_PDL", "1")
    assert use_pdl(x.device), "an sm_90+ GPU should launch with PDL"
    static_res = res.clone()
    _layer_chain(x, static_res.clone(), w)  # compile the PDL variants outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, new_res = _layer_chain(x, static_res, w)
    for _ in range(20):
        static_res.copy_(res)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref_out) and torch.equal(new_res, ref_res)
