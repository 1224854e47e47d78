"""The decode MoE kernels (``moe_decode.py``) on a GPU at real layer shapes (``pytest -m gpu``), against the torch
reference: gpt-oss-20b and gpt-oss-120b (H = I = 2880, 32 / 128 MXFP4 experts, top 4, top-k-then-softmax routing,
biases, clamped SwiGLU) and qwen3-30b-a3b (H 2048, I 768, 128 bfloat16 experts, top 8, renormalised), at T = 1, 4
and 8 (the op's range: the CUDA-graph buckets up to ``DECODE_MAX_TOKENS``).

Besides even loads: every token choosing the same top-k experts (each expert's rows read by T programs side by
side), with every other expert's weights poisoned (NaN, or scale 2 ** 113 for MXFP4 codes); float16 and float32
activations over MXFP4 codes (the pair-word reads of x); and a CUDA graph captured once and replayed on inputs
that route differently. Tolerance: relative Frobenius error against ``fused_moe_ref`` < 2e-2 in bfloat16 (as
test_kernel_moe_gpu.py: only the order of the dot products' float32 sums differs), 2e-3 in float16, 1e-4 in
float32.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testlib import distinct_logits, rel_err, seed_per_case  # noqa: F401 (seed_per_case: autouse fixture)

from minfer.kernels.moe.moe_decode import fused_moe_decode
from minfer.kernels.moe.moe_ref import fused_moe_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# name: (hidden H, expert intermediate I, experts E, top_k, gpt-oss: MXFP4 experts, biases, clamped SwiGLU and
# top-k-then-softmax routing)
LAYERS = {"gpt-oss-20b": (2880, 2880, 32, 4, True), "gpt-oss-120b": (2880, 2880, 128, 4, True),
          "qwen3-30b-a3b": (2048, 768, 128, 8, False)}
TOKENS = [1, 4, 8]
TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-4}
DT = torch.bfloat16


def make_experts(name: str) -> dict:
    """The layer's experts and routing as keywords of ``fused_moe_decode`` / ``fused_moe_ref``: gpt-oss's as random
    codes with scale bytes drawn so gate/up values have a std of a few units (the clamp at 7 bites), down
    projections at about unit output scale (test_kernel_moe_gpu.py's); qwen3's normal weights at unit scale."""
    h, i, e, _, gpt_oss = LAYERS[name]
    if not gpt_oss:
        return dict(w_gate_up=(torch.randn(e, 2 * i, h, device="cuda") / h ** 0.5).to(DT),
                    w_down=(torch.randn(e, h, i, device="cuda") / i ** 0.5).to(DT), renormalize=True)

    def packed(n: int, k: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda"),
                torch.randint(lo, hi, (e, n, k // 32), dtype=torch.uint8, device="cuda"))

    (w_gate_up, scale_gate_up), (w_down, scale_down) = packed(2 * i, h, 120, 123), packed(h, i, 117, 120)
    return dict(w_gate_up=w_gate_up, w_down=w_down, scale_gate_up=scale_gate_up, scale_down=scale_down,
                bias_gate_up=torch.randn(e, 2 * i, device="cuda").to(DT),
                bias_down=(0.1 * torch.randn(e, h, device="cuda")).to(DT), swiglu_limit=7.0, swiglu_alpha=1.702,
                renormalize=False, topk_softmax=True)


@pytest.fixture(scope="module")
def experts():
    """``get(name)`` -> the layer's keywords (:func:`make_experts`), made once per module (120b: 1.6 GB)."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = make_experts(name)
        return cache[name]

    yield get
    cache.clear()
    torch.cuda.empty_cache()


def inputs(name: str, t: int, dtype: torch.dtype = DT) -> tuple[torch.Tensor, torch.Tensor]:
    h, _, e, _, _ = LAYERS[name]
    return torch.randn(t, h, device="cuda").to(dtype), distinct_logits(t, e, dtype, "cuda")


def check(name: str, out: torch.Tensor, x: torch.Tensor, logits: torch.Tensor, kw: dict, what: str) -> None:
    ref = fused_moe_ref(x, logits, top_k=LAYERS[name][3], **kw)
    assert out.shape == x.shape and out.dtype == x.dtype
    err = rel_err(out, ref)  # also fails on a NaN (an unwritten element, or a poisoned expert read)
    assert err < TOL[x.dtype], f"{name} {what}: rel err {err:.2e} >= {TOL[x.dtype]:.0e}"


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("t", TOKENS)
def test_real_layer(experts, name, t):
    kw = experts(name)
    x, logits = inputs(name, t)
    check(name, fused_moe_decode(x, logits, top_k=LAYERS[name][3], **kw), x, logits, kw, f"T={t}")


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("t", [4, 8])
def test_same_top_k_and_poisoned_experts(experts, name, t):
    """Every token picks experts 0..top_k-1; every other expert's weights (and biases) are NaN, or its MXFP4 scales
    2 ** 113: a program that read them would spread it."""
    _, _, e, top_k, gpt_oss = LAYERS[name]
    x, logits = inputs(name, t)
    logits[:, :top_k] = 8 + 0.5 * torch.arange(top_k, device="cuda", dtype=DT)
    kw = dict(experts(name))
    poison = [("scale_gate_up", 240), ("scale_down", 240), ("bias_gate_up", float("nan")),
              ("bias_down", float("nan"))] if gpt_oss else [("w_gate_up", float("nan")), ("w_down", float("nan"))]
    for key, value in poison:
        kw[key] = kw[key].clone()
        kw[key][top_k:] = value
    check(name, fused_moe_decode(x, logits, top_k=top_k, **kw), x, logits, kw, f"T={t} same top-k")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("t", [1, 8])
def test_mxfp4_with_16_and_32_bit_activations(experts, dtype, t):
    """x's values read in pairs from int32 (float16) and int64 (float32) words; float16 rounds each dequantized
    weight to float16 first, as the reference does."""
    kw = {k: v.to(dtype) if k.startswith("bias") else v for k, v in experts("gpt-oss-20b").items()}
    x, logits = inputs("gpt-oss-20b", t, dtype)
    check("gpt-oss-20b", fused_moe_decode(x, logits, top_k=4, **kw), x, logits, kw, f"T={t} {dtype}")


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("t", TOKENS)
def test_cuda_graph_replays_with_new_inputs(experts, name, t):
    """Captured once, replayed on new x and router logits that route differently, up to every token sharing its
    experts: each program routes its token inside the graph, so each replay equals the reference on its inputs."""
    _, _, e, top_k, _ = LAYERS[name]
    kw = experts(name)
    x, logits = inputs(name, t)

    def run() -> torch.Tensor:
        return fused_moe_decode(x, logits, top_k=top_k, **kw)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for case in ("even", "same_top_k", "even"):
        new_x, new_logits = inputs(name, t)
        if case == "same_top_k":
            new_logits[:, :top_k] = 8 + 0.5 * torch.arange(top_k, device="cuda", dtype=DT)
        x.copy_(new_x)
        logits.copy_(new_logits)
        graph.replay()
        check(name, out, x, logits, kw, f"T={t} graph {case}")


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("t", [1, 8])
def test_pipelined_k_loops_are_bit_equal(experts, name, t):
    """Both kernels' K loops pipelined three deep (cp.async copies ahead) give the very bits of the default depth
    (``gemm/gemv_config.STREAM_STAGES``), at the default configs' tiles and the one-tile down layout."""
    from dataclasses import replace

    from minfer.kernels.moe.moe_args import moe_decode_config

    h, i, _, top_k, gpt_oss = LAYERS[name]
    kw = experts(name)
    x, logits = inputs(name, t)
    base = moe_decode_config(0.5 if gpt_oss else 2, h, i, x.device)
    for cfg in (base, replace(base, expert_loop=not base.expert_loop)):
        one = fused_moe_decode(x, logits, top_k=top_k, config=replace(cfg, num_stages=1), **kw)
        deep = fused_moe_decode(x, logits, top_k=top_k, config=replace(cfg, num_stages=3), **kw)
        assert torch.equal(deep, one), f"{name} T={t} {cfg}"
