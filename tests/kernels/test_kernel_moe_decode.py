"""The decode MoE kernels (``moe_decode.py``: a gate/up and a down matrix-vector kernel for a few tokens, each
program routing its own token) against the torch reference, under the Triton interpreter at small shapes; the
``gpu`` tests (``test_kernel_moe_decode_gpu.py``) repeat them at real layer shapes.

Cases: T = 1, 2, 5; both routers (softmax then top-k, renormalised or not; gpt-oss's top-k then softmax); plain and
gpt-oss experts (biases, clamped SwiGLU); float and MXFP4 weights; float32, bfloat16 and float16 activations; an
expert two tokens chose and one no token chose (its weights poisoned); a top-k that is not a power of two (masked
slots); row tiles past the layer's edge and K loops with a tail; ties in the routing.

Tolerances as ``test_kernel_moe.py``'s (its docstring says why): float32 1e-5 and float16 2e-4 against the
reference; bfloat16 against the float64 block, 4e-2 under the interpreter (which rounds float32 -> bfloat16
toward zero), 1e-2 on a GPU. Most cases take the CPU's default config (tiles as wide as the layer: one program a
pair, one a token, which keeps the interpreter to a few seconds); ``test_tiles_wrap_and_k_tails`` takes narrow
tiles and K loops with tails, as the GPU's configs do at real shapes.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kernel_testlib import EXACT_BF16, distinct_logits, rel_err, seed_per_case  # noqa: F401 (seed_per_case: autouse)

from minfer.kernels.gemm.gemv_config import STREAM_STAGES
from minfer.kernels.moe.moe_args import (DECODE_MAX_TOKENS, MoeDecodeConfig, decode_block_k, moe_decode_config,
                                        use_moe_decode)
from minfer.kernels.moe.moe_decode import fused_moe_decode
from minfer.kernels.moe.moe_ref import fused_moe_ref, moe_experts_ref, moe_route_ref
from minfer.kernels.quant.mxfp4_ref import dequantize_mxfp4, quantize_mxfp4

TOL = {torch.float32: 1e-5, torch.float16: 2e-4, torch.bfloat16: 1e-2 if EXACT_BF16 else 4e-2}
ROUTERS = {"softmax": dict(renormalize=False), "softmax_renorm": dict(renormalize=True),
           "topk_softmax": dict(renormalize=False, topk_softmax=True)}


def make_layer(t: int, e: int, h: int, i: int, dtype: torch.dtype, *, gpt_oss: bool, mxfp4: bool,
               device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, dict]:
    """x, router logits (no ties) and the experts as keywords: at unit output scale, or gpt-oss's (gate/up values a
    few units wide so the clamp at 7 bites, biases); MXFP4 codes quantized from the same normal weights."""
    x = torch.randn(t, h, device=device).to(dtype)
    w_gate_up = torch.randn(e, 2 * i, h, device=device) * (6.0 if gpt_oss else 1.0) / h ** 0.5
    w_down = torch.randn(e, h, i, device=device) / i ** 0.5
    kw: dict = {}
    if gpt_oss:
        kw = dict(bias_gate_up=torch.randn(e, 2 * i, device=device).to(dtype),
                  bias_down=(0.1 * torch.randn(e, h, device=device)).to(dtype), swiglu_limit=7.0, swiglu_alpha=1.702)
    if mxfp4:
        (kw["w_gate_up"], kw["scale_gate_up"]), (kw["w_down"], kw["scale_down"]) = map(quantize_mxfp4,
                                                                                       (w_gate_up, w_down))
    else:
        kw["w_gate_up"], kw["w_down"] = w_gate_up.to(dtype), w_down.to(dtype)
    return x, distinct_logits(t, e, dtype, device), kw


def exact(x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool, topk_softmax: bool = False,
          weights_dtype: torch.dtype | None = None, **experts) -> torch.Tensor:
    """The block in float64 on the same inputs: the routing from the same logits, MXFP4 weights dequantized
    exactly."""
    weights, ids = moe_route_ref(logits, top_k, renormalize, weights_dtype, topk_softmax)
    if experts.get("scale_gate_up") is not None:
        experts["w_gate_up"] = dequantize_mxfp4(experts["w_gate_up"], experts.pop("scale_gate_up"), torch.float64)
        experts["w_down"] = dequantize_mxfp4(experts["w_down"], experts.pop("scale_down"), torch.float64)
    experts = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in experts.items()}
    return moe_experts_ref(x.double(), weights.double(), ids, **experts)


def check(x: torch.Tensor, logits: torch.Tensor, top_k: int, config: MoeDecodeConfig | None = None,
          **kw) -> None:
    """The decode kernels against the reference (float32, float16) or the float64 block (bfloat16)."""
    out = fused_moe_decode(x, logits, top_k=top_k, config=config, **kw)
    assert out.shape == x.shape and out.dtype == x.dtype
    if x.dtype == torch.bfloat16:
        err = rel_err(out, exact(x, logits, top_k, **kw))
    else:
        err = rel_err(out, fused_moe_ref(x, logits, top_k=top_k, **kw))
    assert err <= TOL[x.dtype], f"rel err {err:.2e} > {TOL[x.dtype]:.0e} ({x.dtype}, {config})"


# (T, activations, router, gpt-oss experts, MXFP4 weights, router weights dtype): both routers, both kinds of expert,
# both weight formats, each dtype (float16 x MXFP4: the weights rounded to float16 as the reference dequantizes);
# float32 router weights (Mixtral) keep the weighted rows in float32. Top 4 of 8, top 2 at T = 5 (fewer programs).
CASES = [
    (1, torch.float32, "topk_softmax", True, True, None),
    (2, torch.float16, "topk_softmax", True, True, None),
    (5, torch.bfloat16, "topk_softmax", True, True, None),
    (1, torch.float32, "softmax_renorm", False, False, None),
    (2, torch.float32, "softmax", False, True, None),
    (5, torch.bfloat16, "softmax_renorm", False, False, torch.float32),
]


@pytest.mark.parametrize("t,dtype,router,gpt_oss,mxfp4,weights_dtype", CASES,
                         ids=[f"T{c[0]}-{str(c[1])[6:]}-{c[2]}-{'gpt_oss' if c[3] else 'plain'}-"
                              f"{'mxfp4' if c[4] else 'float'}" + ("-f32weights" if c[5] else "") for c in CASES])
def test_decode_matches_reference(t, dtype, router, gpt_oss, mxfp4, weights_dtype):
    x, logits, kw = make_layer(t, 8, 64, 32, dtype, gpt_oss=gpt_oss, mxfp4=mxfp4)
    check(x, logits, 4 if t < 5 else 2, weights_dtype=weights_dtype, **ROUTERS[router], **kw)


@pytest.mark.parametrize("gpt_oss,mxfp4", [(True, True), (False, False)], ids=["gpt_oss-mxfp4", "plain-float"])
def test_shared_and_cold_experts(gpt_oss, mxfp4):
    """Tokens 0 and 2 both choose expert 2 first; no token chooses expert 4, whose weights (MXFP4: scales 2 ** 113)
    and biases are NaN or huge, which a kernel that read them would spread. Top 3 of 6: one masked slot in the
    down kernel's tile of 4, two padding lanes in the routing's 8."""
    x, logits, kw = make_layer(3, 6, 64, 32, torch.float32, gpt_oss=gpt_oss, mxfp4=mxfp4)
    logits[[0, 2], 2] += 30
    logits[:, 4] -= 30
    router = ROUTERS["topk_softmax" if gpt_oss else "softmax_renorm"]
    ids = moe_route_ref(logits, 3, **router)[1]
    assert ids[0, 0] == ids[2, 0] == 2 and not (ids == 4).any()
    if mxfp4:
        kw["scale_gate_up"][4] = kw["scale_down"][4] = 240
    else:
        kw["w_gate_up"][4] = kw["w_down"][4] = float("nan")
    if gpt_oss:
        kw["bias_gate_up"][4] = kw["bias_down"][4] = float("nan")
    check(x, logits, 3, **router, **kw)


@pytest.mark.parametrize("gpt_oss,mxfp4", [(True, True), (False, False)], ids=["gpt_oss-mxfp4", "plain-float"])
def test_down_expert_loop_equals_one_tile(gpt_oss, mxfp4):
    """The down kernel's two layouts (the experts one after another, or all in one tile) add the same products in
    the same order: bit-identical outputs at top 3 (a padded slot in the one tile) in one K step; both against the
    reference at top 8 with K tails."""
    for top_k, e, h, i, tile in ((3, 6, 64, 32, 1 << 16), (8, 16, 64, 96 if mxfp4 else 40, 2048)):
        x, logits, kw = make_layer(2, e, h, i, torch.float32, gpt_oss=gpt_oss, mxfp4=mxfp4)
        router = ROUTERS["topk_softmax" if gpt_oss else "softmax_renorm"]
        outs = []
        for loop in (False, True):
            cfg = MoeDecodeConfig(16, 8, tile=tile, expert_loop=loop)
            check(x, logits, top_k, cfg, **router, **kw)
            outs.append(fused_moe_decode(x, logits, top_k=top_k, config=cfg, **router, **kw))
        if tile == 1 << 16:  # one K step in both (at 2048 the depths differ: the tile is split over fewer rows)
            assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("mxfp4", [False, True], ids=["float", "mxfp4"])
def test_pipelined_k_loops_are_bit_equal(mxfp4):
    """The K loops pipelined three deep (``gemm/gemv_config.STREAM_STAGES``; on a GPU cp.async copies ahead) add the
    same steps in the same order as the default depth: bit-identical, whole steps and a masked tail in both kernels
    (test_kernel_moe_decode_gpu.py repeats it at real shapes)."""
    h, i, cfg = (96, 96, MoeDecodeConfig(64, 64, tile=2048)) if mxfp4 else (56, 40, MoeDecodeConfig(16, 32, tile=512))
    x, logits, kw = make_layer(2, 4, h, i, torch.float32, gpt_oss=True, mxfp4=mxfp4)
    outs = [fused_moe_decode(x, logits, top_k=2, config=replace(cfg, num_stages=s), **ROUTERS["topk_softmax"], **kw)
            for s in (1, 3)]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("mxfp4", [False, True], ids=["float", "mxfp4"])
def test_tiles_wrap_and_k_tails(mxfp4):
    """Row tiles that do not divide the layer (the last one's rows wrap around and are not stored) and K loops of
    whole steps then a masked tail, in both kernels: float H 56 = 3 x 16 + 8, I 40 = 2 x 16 + 8; MXFP4 (K a
    multiple of 32) H = I = 96 = 64 + 32."""
    h, i, cfg = (96, 96, MoeDecodeConfig(64, 64)) if mxfp4 else (56, 40, MoeDecodeConfig(16, 32, tile=512))
    assert decode_block_k(h, 2 * cfg.block_n_gate_up, cfg.tile, mxfp4) < h
    assert decode_block_k(i, 2 * cfg.block_n_down, cfg.tile, mxfp4) < i
    assert i % cfg.block_n_gate_up and h % cfg.block_n_down
    x, logits, kw = make_layer(2, 4, h, i, torch.float32, gpt_oss=True, mxfp4=mxfp4)
    check(x, logits, 2, cfg, **ROUTERS["topk_softmax"], **kw)


def test_routing_ties_go_to_the_lower_expert():
    """A tie at the k-th place goes to the lower expert index, as the grouped path's routing (the same code):
    test_kernel_moe.py's cases, with the picks spelled out."""
    x, _, kw = make_layer(3, 4, 64, 32, torch.float32, gpt_oss=False, mxfp4=False)
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0], [3.0, 0.5, -1.0, 0.5]])
    ids = torch.tensor([[0, 1], [1, 2], [0, 1]])
    weights = torch.softmax(logits, -1).gather(1, ids)
    weights /= weights.sum(-1, keepdim=True)
    out = fused_moe_decode(x, logits, top_k=2, renormalize=True, **kw)
    assert rel_err(out, moe_experts_ref(x, weights, ids, kw["w_gate_up"], kw["w_down"])) <= 1e-5


def test_the_op_takes_the_decode_kernels_up_to_the_threshold(monkeypatch):
    """TritonOps.fused_moe: the decode kernels at 1..DECODE_MAX_TOKENS tokens of MXFP4 experts and at one token of
    float experts, the grouped GEMMs past that (and at 0), with the same arguments."""
    from minfer.ops import MoeExperts
    from minfer.ops import triton_ops

    calls = []
    monkeypatch.setattr(triton_ops, "fused_moe_decode", lambda x, *a, **k: calls.append(("decode", x.shape[0])))
    monkeypatch.setattr(triton_ops, "fused_moe", lambda x, *a, **k: calls.append(("grouped", x.shape[0])))
    ops = triton_ops.TritonOps(torch.device("cpu"), 16, 64)
    mxfp4 = MoeExperts(torch.zeros(4, 64, 16, dtype=torch.uint8), torch.zeros(4, 32, 16, dtype=torch.uint8),
                       scale_gate_up=torch.zeros(4, 64, 1, dtype=torch.uint8),
                       scale_down=torch.zeros(4, 32, 1, dtype=torch.uint8))
    for experts in (mxfp4, MoeExperts(torch.zeros(4, 64, 32), torch.zeros(4, 32, 32))):
        for t in (0, 1, 2, DECODE_MAX_TOKENS, DECODE_MAX_TOKENS + 1):
            ops.fused_moe(torch.zeros(t, 32), torch.zeros(t, 4), experts, 2, True)
    assert calls == [("grouped", 0), ("decode", 1), ("decode", 2), ("decode", DECODE_MAX_TOKENS),
                     ("grouped", DECODE_MAX_TOKENS + 1),
                     ("grouped", 0), ("decode", 1), ("grouped", 2), ("grouped", 8), ("grouped", 9)]
    assert [use_moe_decode(t) for t in (0, 1, 8, 9)] == [False, True, True, False]
    assert [use_moe_decode(t, mxfp4=False) for t in (0, 1, 2)] == [False, True, False]


def test_configs():
    """On a GPU: 8 gate/up rows and 4 down rows a program; MXFP4 8192-value tiles in one down tile, hence 512-deep K
    steps at gpt-oss's layer; bfloat16 4096-value tiles (2048 of float32), the down kernel's experts in turn; the
    pipelining depth of ``STREAM_STAGES``; on the CPU one program a pair and one a token, each a single K step."""
    gpu = torch.device("cuda")
    assert moe_decode_config(0.5, 2880, 2880, gpu) == MoeDecodeConfig(num_stages=STREAM_STAGES)
    assert moe_decode_config(2, 2048, 768, gpu) == MoeDecodeConfig(tile=4096, num_stages=STREAM_STAGES,
                                                                   expert_loop=True)
    assert moe_decode_config(4, 2048, 768, gpu).tile == 2048
    # (K, rows: gate/up 2 x 8, down top_k x 4)
    assert [decode_block_k(2880, 2 * 8, 8192, True), decode_block_k(2880, 4 * 4, 8192, True)] == [512, 512]
    assert [decode_block_k(2048, 2 * 8, 8192, False), decode_block_k(768, 8 * 4, 8192, False)] == [512, 256]
    cfg = moe_decode_config(2, 64, 40, torch.device("cpu"))
    assert (cfg.block_n_gate_up, cfg.block_n_down) == (64, 64) and decode_block_k(64, 128, cfg.tile, False) == 64


def test_empty_and_bad_arguments():
    x, logits, kw = make_layer(3, 4, 64, 32, torch.float32, gpt_oss=False, mxfp4=False)
    assert fused_moe_decode(x[:0], logits[:0], top_k=2, renormalize=True, **kw).shape == (0, 64)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe_decode(x, logits, top_k=5, renormalize=True, **kw)
    with pytest.raises(TypeError, match="dtype"):
        fused_moe_decode(x, logits, top_k=2, renormalize=True, w_gate_up=kw["w_gate_up"].half(), w_down=kw["w_down"])
