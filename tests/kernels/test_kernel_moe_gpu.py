"""The fused MoE kernels on a GPU at real layer shapes (``pytest -m gpu``), against the torch reference.

gpt-oss-20b and 120b (MXFP4 experts, biases, clamped SwiGLU, top-k-then-softmax routing) at the end of the file.

The layers, in bfloat16: qwen3-30b-a3b (H 2048, I 768, 128 experts, top 8, renormalised) and
mixtral-8x7b (H 4096, I 14336, 8 experts, top 2, float32 router weights). Token counts: T = 1, 3, 64, 300
and 4096. These cover one 16-row block, a partly filled block, several experts with several blocks, and
the config table's largest bucket. Skewed loads: one expert takes every token while another takes none,
or every token picks the same top-k experts. An unchosen expert's weights are NaN: a kernel that read
them would spread it. The CUDA graph check captures once, then replays with new inputs that route
differently, a skewed batch included. The grids come from the shapes alone, so the worst case must
fit the same launch.

Tolerance: relative Frobenius error < 2e-2 against ``fused_moe_ref``. Both round every intermediate
where HF does; the bfloat16 results then differ by the dot products' summation order. On the CPU
(tests/kernels/test_kernel_moe.py) they agree to 1e-2 against float64.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testlib import distinct_logits, rel_err, seed_per_case  # noqa: F401 (seed_per_case: autouse fixture)

from minfer.kernels.moe.moe import fused_moe, moe_route
from minfer.kernels.moe.moe_ref import fused_moe_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# name: (hidden H, expert intermediate I, experts E, top_k, router weights dtype: Mixtral keeps float32)
LAYERS = {"qwen3-30b-a3b": (2048, 768, 128, 8, None), "mixtral-8x7b": (4096, 14336, 8, 2, torch.float32)}
TOKENS = [1, 3, 64, 300, 4096]
TOL = 2e-2
DT = torch.bfloat16


@pytest.fixture(scope="module")
def weights():
    """``get(name)`` -> (w_gate_up [E, 2I, H], w_down [E, H, I]) of a layer at unit output scale, made once
    per module (mixtral's are 2.8 GB) and freed after it."""
    cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if name not in cache:
            h, i, e, _, _ = LAYERS[name]
            cache[name] = ((torch.randn(e, 2 * i, h, device="cuda") / h ** 0.5).to(DT),
                           (torch.randn(e, h, i, device="cuda") / i ** 0.5).to(DT))
        return cache[name]

    yield get
    cache.clear()
    torch.cuda.empty_cache()


def skew(logits: torch.Tensor, case: str, top_k: int) -> list[int]:
    """Skew ``logits`` in place; returns the experts that no token may choose."""
    e = logits.shape[1]
    if case == "one_takes_all":  # expert 1 in every token's top k, expert 3 in none
        logits[:, 1] += 30
        logits[:, 3] -= 30
        return [3]
    # "same_top_k": every token picks experts 0..top_k-1 (distinct logits, far above the grid's [-2, 2))
    logits[:, :top_k] = 8 + 0.5 * torch.arange(top_k, device=logits.device, dtype=logits.dtype)
    return list(range(top_k, e))


def poisoned(w_gate_up: torch.Tensor, w_down: torch.Tensor, cold: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of the weights with the ``cold`` experts' matrices NaN."""
    w_gate_up, w_down = w_gate_up.clone(), w_down.clone()
    w_gate_up[cold] = float("nan")
    w_down[cold] = float("nan")
    return w_gate_up, w_down


def check(name: str, out: torch.Tensor, x: torch.Tensor, logits: torch.Tensor, w_gate_up: torch.Tensor,
          w_down: torch.Tensor) -> None:
    _, _, _, top_k, weights_dtype = LAYERS[name]
    ref = fused_moe_ref(x, logits, w_gate_up, w_down, top_k, True, weights_dtype=weights_dtype)
    assert out.shape == x.shape and out.dtype == DT
    err = rel_err(out, ref)  # also fails on a NaN (an unwritten row, or a cold expert read)
    assert err < TOL, f"{name} T={x.shape[0]}: rel err {err:.2e} >= {TOL:.0e}"


def run(name: str, x: torch.Tensor, logits: torch.Tensor, w_gate_up: torch.Tensor,
        w_down: torch.Tensor) -> torch.Tensor:
    _, _, _, top_k, weights_dtype = LAYERS[name]
    return fused_moe(x, logits, w_gate_up, w_down, top_k, True, weights_dtype=weights_dtype)


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("t", TOKENS)
def test_real_layer(weights, name, t):
    h, _, e, _, _ = LAYERS[name]
    w_gate_up, w_down = weights(name)
    x, logits = torch.randn(t, h, device="cuda").to(DT), distinct_logits(t, e, DT, "cuda")
    check(name, run(name, x, logits, w_gate_up, w_down), x, logits, w_gate_up, w_down)


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("case", ["one_takes_all", "same_top_k"])
@pytest.mark.parametrize("t", [3, 300, 4096])
def test_skewed_load(weights, name, case, t):
    h, _, e, top_k, weights_dtype = LAYERS[name]
    x, logits = torch.randn(t, h, device="cuda").to(DT), distinct_logits(t, e, DT, "cuda")
    cold = skew(logits, case, top_k)
    counts = moe_route(logits, top_k, True, weights_dtype).expert_counts.tolist()
    assert counts[1] == t and all(counts[c] == 0 for c in cold)
    w_gate_up, w_down = poisoned(*weights(name), cold)
    check(name, run(name, x, logits, w_gate_up, w_down), x, logits, w_gate_up, w_down)


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("t", [1, 3, 64, 300])
def test_cuda_graph_replays_with_new_inputs(weights, name, t):
    """Captured once on one batch, replayed on new x and router logits. The routing changes inside the
    graph, up to every token sharing its experts. Each replay must equal the reference on the inputs
    it saw."""
    h, _, e, top_k, _ = LAYERS[name]
    w_gate_up, w_down = weights(name)
    x, logits = torch.randn(t, h, device="cuda").to(DT), distinct_logits(t, e, DT, "cuda")
    run(name, x, logits, w_gate_up, w_down)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(name, x, logits, w_gate_up, w_down)
    for case in ("even", "one_takes_all", "same_top_k", "even"):
        new_logits = distinct_logits(t, e, DT, "cuda")
        if case != "even":
            skew(new_logits, case, top_k)
        x.copy_(torch.randn(t, h, device="cuda").to(DT))
        logits.copy_(new_logits)
        graph.replay()
        check(name, out, x, logits, w_gate_up, w_down)


# ------------------------------------------------------------------------------------------------ gpt-oss
# gpt-oss's MoE layers (bfloat16 activations, MXFP4 experts, biases, clamped SwiGLU, top-k-then-softmax routing):
# name: (hidden H, expert intermediate I, experts E, top_k). Held to the reference (the experts dequantized to
# bfloat16, HF's arithmetic after).
GPT_OSS = {"gpt-oss-20b": (2880, 2880, 32, 4), "gpt-oss-120b": (2880, 2880, 128, 4)}
LIMIT, ALPHA = 7.0, 1.702


def gpt_oss_layer(name: str, device: str = "cuda", layers: dict = GPT_OSS) -> dict:
    """A layer's experts as ``fused_moe``'s keywords: random codes with scale bytes drawn so that gate/up values
    have a std of a few units (the clamp at 7 bites), down projections at about unit output scale."""
    h, i, e, _ = layers[name]

    def packed(n: int, k: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=device),
                torch.randint(lo, hi, (e, n, k // 32), dtype=torch.uint8, device=device))

    (w_gate_up, scale_gate_up), (w_down, scale_down) = packed(2 * i, h, 120, 123), packed(h, i, 117, 120)
    return dict(w_gate_up=w_gate_up, w_down=w_down, scale_gate_up=scale_gate_up, scale_down=scale_down,
                bias_gate_up=torch.randn(e, 2 * i, device=device).to(DT),
                bias_down=(0.1 * torch.randn(e, h, device=device)).to(DT), swiglu_limit=LIMIT, swiglu_alpha=ALPHA)


@pytest.fixture(scope="module")
def gpt_oss_weights():
    """``get(name)`` -> the layer's experts (:func:`gpt_oss_layer`), made once per module (120b: 1.6 GB)."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = gpt_oss_layer(name)
        return cache[name]

    yield get
    cache.clear()
    torch.cuda.empty_cache()


def gpt_oss_check(out: torch.Tensor, x: torch.Tensor, logits: torch.Tensor, experts: dict, top_k: int,
                  what: str) -> None:
    ref = fused_moe_ref(x, logits, top_k=top_k, renormalize=False, topk_softmax=True, **experts)
    assert out.shape == x.shape and out.dtype == DT
    err = rel_err(out, ref)
    assert err < TOL, f"{what}: rel err {err:.2e} >= {TOL:.0e}"


@pytest.mark.parametrize("name", list(GPT_OSS))
@pytest.mark.parametrize("t", TOKENS)
def test_gpt_oss_layer(gpt_oss_weights, name, t):
    h, _, e, top_k = GPT_OSS[name]
    experts = gpt_oss_weights(name)
    x, logits = torch.randn(t, h, device="cuda").to(DT), distinct_logits(t, e, DT, "cuda")
    out = fused_moe(x, logits, top_k=top_k, renormalize=False, topk_softmax=True, **experts)
    gpt_oss_check(out, x, logits, experts, top_k, f"{name} T={t}")


@pytest.mark.parametrize("name", list(GPT_OSS))
@pytest.mark.parametrize("t", [3, 300, 4096])
def test_gpt_oss_skewed_load(gpt_oss_weights, name, t):
    """Expert 1 takes every token, expert 3 none: its scales are 2 ** 113 and its biases NaN, which a kernel that
    read them would spread."""
    h, _, e, top_k = GPT_OSS[name]
    x, logits = torch.randn(t, h, device="cuda").to(DT), distinct_logits(t, e, DT, "cuda")
    cold = skew(logits, "one_takes_all", top_k)
    counts = moe_route(logits, top_k, False, topk_softmax=True).expert_counts.tolist()
    assert counts[1] == t and all(counts[c] == 0 for c in cold)
    experts = dict(gpt_oss_weights(name))
    for key, poison in (("scale_gate_up", 240), ("scale_down", 240), ("bias_gate_up", float("nan")),
                        ("bias_down", float("nan"))):
        experts[key] = experts[key].clone()
        experts[key][cold] = poison
    out = fused_moe(x, logits, top_k=top_k, renormalize=False, topk_softmax=True, **experts)
    gpt_oss_check(out, x, logits, experts, top_k, f"{name} T={t} skewed")  # the reference reads no cold expert


@pytest.mark.parametrize("name", list(GPT_OSS))
@pytest.mark.parametrize("t", [1, 64])
def test_gpt_oss_cuda_graph(gpt_oss_weights, name, t):
    """Captured once, replayed on new inputs that route differently."""
    h, _, e, top_k = GPT_OSS[name]
    experts = gpt_oss_weights(name)
    x, logits = torch.randn(t, h, device="cuda").to(DT), distinct_logits(t, e, DT, "cuda")

    def run() -> torch.Tensor:
        return fused_moe(x, logits, top_k=top_k, renormalize=False, topk_softmax=True, **experts)

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for case in ("even", "one_takes_all", "even"):
        new_logits = distinct_logits(t, e, DT, "cuda")
        if case != "even":
            skew(new_logits, case, top_k)
        x.copy_(torch.randn(t, h, device="cuda").to(DT))
        logits.copy_(new_logits)
        graph.replay()
        gpt_oss_check(out, x, logits, experts, top_k, f"{name} T={t} graph {case}")
