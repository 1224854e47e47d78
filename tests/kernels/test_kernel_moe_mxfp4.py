"""gpt-oss's MoE: the MXFP4 format's reference, the MoE reference against HF's gpt-oss block, and the fused
kernels (routing by top-k-then-softmax, biases, the clamped SwiGLU, MXFP4 codes expanded in registers) against
the reference, under the Triton interpreter at small shapes.

Tolerances as ``test_kernel_moe.py``'s (its module docstring says why): float32 kernel vs reference 1e-5;
bfloat16 against the float64 result (routing and weights taken from the same rounded inputs) 1e-2 for the
reference, 4e-2 for the kernel under the interpreter (which rounds float32 -> bfloat16 toward zero).
The reference against HF's block (the path a loaded HF model runs, ``grouped_mm``): ``torch.equal`` in bfloat16,
1e-6 in float32 (HF multiplies the transposed weights: the products' sums in another order).
"""
from __future__ import annotations

import pytest
import torch
from kernel_testlib import EXACT_BF16, distinct_logits, rel_err, seed_per_case  # noqa: F401 (seed_per_case: autouse)

from minfer.kernels.moe.moe import MOE_CONFIGS, MoeConfig, fused_moe, moe_route
from minfer.kernels.moe.moe_ref import fused_moe_ref, moe_experts_ref, moe_route_ref
from minfer.kernels.quant.mxfp4_ref import E2M1_MAGNITUDES, dequantize_mxfp4, quantize_mxfp4, unpack_e2m1

LIMIT, ALPHA = 7.0, 1.702  # gpt-oss's swiglu_limit and swiglu_alpha


# ------------------------------------------------------------------------------------------------ MXFP4
def random_mxfp4(*shape: int, lo: int = 118, hi: int = 124) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed codes ``[..., K // 2]`` and scale bytes ``[..., K // 32]`` in [lo, hi) (2^-9 .. 2^-4:
    gpt-oss's checkpoints' range)."""
    *lead, k = shape
    return (torch.randint(0, 256, (*lead, k // 2), dtype=torch.uint8),
            torch.randint(lo, hi, (*lead, k // 32), dtype=torch.uint8))


def test_dequantize_layout():
    """Element k of a row: the low nibble of byte k // 2 when k is even, the high one when odd; code c's value
    is the e2m1 table's (bit 3 the sign), times 2 ** (scale[k // 32] - 127). Spelled out element by element."""
    blocks, scales = random_mxfp4(3, 64, lo=100, hi=150)
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out.shape == (3, 64)
    for n in range(3):
        for k in range(64):
            byte = int(blocks[n, k // 2])
            code = byte & 0xF if k % 2 == 0 else byte >> 4
            value = E2M1_MAGNITUDES[code & 7] * (-1 if code & 8 else 1) * 2.0 ** (int(scales[n, k // 32]) - 127)
            assert out[n, k].item() == value
    assert torch.equal(unpack_e2m1(torch.tensor([0x9F], dtype=torch.uint8)), torch.tensor([15, 9]))


def test_dequantize_matches_hf_conversion():
    """Cross-check with HF's own loader conversion (a private function: skipped if it moved). HF's takes the
    checkpoint's ``[E, N, K/32, 16]`` blocks and returns ``[E, K, N]`` (its experts are transposed)."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    convert = getattr(mxfp4, "_convert_moe_packed_tensors", None)
    if convert is None:
        pytest.skip("transformers.integrations.mxfp4._convert_moe_packed_tensors is gone")
    blocks, scales = random_mxfp4(2, 6, 96)
    for dtype in (torch.bfloat16, torch.float32):
        hf = convert(blocks.reshape(2, 6, 3, 16), scales, dtype=dtype)
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), hf.transpose(1, 2))


def test_quantize_dequantize_exact_on_representable_values():
    """Values e2m1 * 2 ** s with one s a block (every code, every sign, zeros, an all-zero block) round-trip
    exactly, and re-quantizing a dequantized tensor gives it back."""
    blocks, scales = random_mxfp4(4, 8, 128, lo=90, hi=160)
    blocks[0, 0] = 0  # an all-zero block
    w = dequantize_mxfp4(blocks, scales, torch.float32)
    w[0, 0, :32] = 0.0
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(w), torch.float32), w)
    for dtype in (torch.bfloat16, torch.float16):
        small = dequantize_mxfp4(blocks, scales.clamp(110, 140), dtype)  # in float16's range
        assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(small), dtype), small)


def test_quantize_rounds_to_nearest_and_saturates():
    """One block of 32 whose scale is 1 (amax 4): each value to the nearest e2m1, ties to the even code."""
    w = torch.zeros(32)
    cases = [(4.0, 4.0), (0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0),
             (5.1, 6.0), (0.3, 0.5), (-2.6, -3.0), (-0.2, -0.0)]
    for j, (v, _) in enumerate(cases):
        w[j] = v
    blocks, scales = quantize_mxfp4(w)
    assert scales.tolist() == [127]
    out = dequantize_mxfp4(blocks, scales, torch.float32)
    assert out[:len(cases)].tolist() == [want for _, want in cases]
    # 7.9 * 2^-1 .. : amax 7.9 gives scale 2 ** 0 (floor(log2 7.9) - 2 = 0): 7.9 saturates to 6
    w[0] = 7.9
    assert dequantize_mxfp4(*quantize_mxfp4(w), torch.float32)[0].item() == 6.0
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(3, 48))


def test_quantize_error_is_bounded():
    """Random weights: every element within half an e2m1 step of its block's grid (relative error of the
    whole below the format's ~10%)."""
    w = torch.randn(16, 256)
    err = rel_err(dequantize_mxfp4(*quantize_mxfp4(w), torch.float32), w)
    assert 0 < err < 0.15


# ------------------------------------------------------------------------------------------------ gpt-oss
def make_gpt_oss(t: int, e: int, h: int, i: int, dtype: torch.dtype, mxfp4: bool = False, spread: float = 6.0):
    """x, router logits (no ties), and the experts' kwargs in our layout, at a scale where about a quarter of the
    gate/up values pass the clamp on one side or the other (gate/up std ~ ``spread``)."""
    x = torch.randn(t, h).to(dtype)
    logits = distinct_logits(t, e, dtype)
    w_gate_up = torch.randn(e, 2 * i, h) * spread / h ** 0.5
    w_down = torch.randn(e, h, i) / i ** 0.5
    experts = dict(bias_gate_up=torch.randn(e, 2 * i).to(dtype), bias_down=(0.1 * torch.randn(e, h)).to(dtype),
                   swiglu_limit=LIMIT, swiglu_alpha=ALPHA)
    if mxfp4:
        (w_gate_up, experts["scale_gate_up"]), (w_down, experts["scale_down"]) = map(quantize_mxfp4,
                                                                                     (w_gate_up, w_down))
    else:
        w_gate_up, w_down = w_gate_up.to(dtype), w_down.to(dtype)
    return x, logits, w_gate_up, w_down, experts


def hf_gpt_oss_mlp(x, logits_weight, logits_bias, w_gate_up, w_down, experts, top_k: int, dtype: torch.dtype):
    """HF's GptOssMLP (router and experts, ``grouped_mm``: a loaded model's path) on our weights: the gate/up
    rows interleaved back (HF's column 2j gate j, 2j + 1 up j) and both matrices transposed."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    e, two_i, h = w_gate_up.shape
    cfg = GptOssConfig(hidden_size=h, intermediate_size=two_i // 2, num_local_experts=e, num_experts_per_tok=top_k,
                       swiglu_limit=experts["swiglu_limit"])
    cfg._experts_implementation = "grouped_mm"
    mlp = GptOssMLP(cfg).to(dtype).eval()
    interleave = torch.stack([torch.arange(two_i // 2), torch.arange(two_i // 2) + two_i // 2], 1).reshape(-1)
    with torch.no_grad():
        mlp.router.weight.copy_(logits_weight)
        mlp.router.bias.copy_(logits_bias)
        mlp.experts.gate_up_proj.copy_(w_gate_up[:, interleave].transpose(1, 2))
        mlp.experts.gate_up_proj_bias.copy_(experts["bias_gate_up"][:, interleave])
        mlp.experts.down_proj.copy_(w_down.transpose(1, 2))
        mlp.experts.down_proj_bias.copy_(experts["bias_down"])
        return mlp(x[None])[0][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mxfp4", [False, True], ids=["float", "mxfp4"])
def test_reference_matches_hf_gpt_oss(dtype, mxfp4):
    """Our reference (router and experts) is HF's GptOssMLP to the bit in bfloat16, MXFP4 weights dequantized
    to the model dtype first (HF's dequantizing load)."""
    e, top_k, h, i, t = 8, 4, 64, 32, 19
    x, _, w_gate_up, w_down, experts = make_gpt_oss(t, e, h, i, dtype, mxfp4)
    router_w, router_b = (torch.randn(e, h) * 2 / h ** 0.5).to(dtype), torch.randn(e).to(dtype)
    logits = torch.nn.functional.linear(x, router_w, router_b)
    ours = fused_moe_ref(x, logits, w_gate_up, w_down, top_k, False, topk_softmax=True, **experts)
    if mxfp4:
        w_gate_up = dequantize_mxfp4(w_gate_up, experts["scale_gate_up"], dtype)
        w_down = dequantize_mxfp4(w_down, experts["scale_down"], dtype)
    want = hf_gpt_oss_mlp(x, router_w, router_b, w_gate_up, w_down, experts, top_k, dtype)
    if dtype == torch.float32:  # the products' float32 sums in another order (grouped_mm on transposed weights)
        assert rel_err(ours, want) <= 1e-6
    else:
        assert torch.equal(ours, want), f"max diff {(ours.double() - want.double()).abs().max():.2e}"


def test_gpt_oss_routing_and_clamps():
    """The router: top-k of the logits, then a softmax over those k alone (not all experts'); renormalize
    changes nothing. The clamps: gate values above the limit and up values past either side occur."""
    logits = torch.tensor([[0.0, 3.0, 1.0, -1.0, 2.0]])
    weights, ids = moe_route_ref(logits, 2, False, topk_softmax=True)
    assert ids.tolist() == [[1, 4]]
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[3.0, 2.0]]), -1))
    assert torch.equal(moe_route_ref(logits, 2, True, topk_softmax=True)[0], weights)
    x, _, w_gate_up, _, experts = make_gpt_oss(17, 4, 64, 32, torch.float32)
    gate_up = torch.einsum("th,eoh->teo", x, w_gate_up) + experts["bias_gate_up"]
    gate, up = gate_up.chunk(2, -1)
    assert (gate > LIMIT).float().mean() > 0.05 and (up > LIMIT).any() and (up < -LIMIT).any()


def test_reference_in_float64_agrees():
    """The bfloat16 reference is within 1e-2 of the same block in float64 (the kernel tests' yardstick)."""
    x, logits, w_gate_up, w_down, experts = make_gpt_oss(19, 8, 64, 32, torch.bfloat16, mxfp4=True)
    ref = fused_moe_ref(x, logits, w_gate_up, w_down, 4, False, topk_softmax=True, **experts)
    assert rel_err(ref, exact(x, logits, w_gate_up, w_down, 4, experts)) < 1e-2


def exact(x, logits, w_gate_up, w_down, top_k, experts) -> torch.Tensor:
    """The block in float64 on the same inputs: routing from the same logits, MXFP4 weights dequantized exactly."""
    weights, ids = moe_route_ref(logits, top_k, False, topk_softmax=True)
    kw = dict(experts)
    if kw.pop("scale_gate_up", None) is not None:
        w_gate_up = dequantize_mxfp4(w_gate_up, experts["scale_gate_up"], torch.float64)
        w_down = dequantize_mxfp4(w_down, kw.pop("scale_down"), torch.float64)
    kw = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    return moe_experts_ref(x.double(), weights.double(), ids, w_gate_up.double(), w_down.double(), **kw)


# ------------------------------------------------------------------------------------------------ kernels
KERNEL_TOL = {torch.float32: 1e-5, torch.float16: 2e-4, torch.bfloat16: 1e-2 if EXACT_BF16 else 4e-2}
SMALL = MoeConfig(16, 64, 32)  # 16-row blocks, 32 deep: several blocks and K steps at test shapes


def check_kernel(x, logits, w_gate_up, w_down, experts, top_k=4, config=SMALL, **kw) -> None:
    """The kernel against the reference: float32 and float16 directly (the same roundings; float16 checks
    their order), bfloat16 against the float64 block (see the module docstring)."""
    out = fused_moe(x, logits, w_gate_up, w_down, top_k, False, config, topk_softmax=True, **experts, **kw)
    assert out.shape == x.shape and out.dtype == x.dtype
    if x.dtype == torch.bfloat16:
        err = rel_err(out, exact(x, logits, w_gate_up, w_down, top_k, experts))
    else:
        err = rel_err(out, fused_moe_ref(x, logits, w_gate_up, w_down, top_k, False, topk_softmax=True, **experts))
    assert err <= KERNEL_TOL[x.dtype], f"rel err {err:.2e} > {KERNEL_TOL[x.dtype]:.0e} ({x.dtype}, {config}, {kw})"


@pytest.mark.parametrize("t", [1, 33])
@pytest.mark.parametrize("mxfp4", [False, True], ids=["float", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_moe_gpt_oss(dtype, mxfp4, t):
    """gpt-oss's routing, biases and clamped SwiGLU (clamps hit: test_gpt_oss_routing_and_clamps), float or
    MXFP4 weights; 8 experts, top 4: at T=33 loads are uneven, several blocks per expert."""
    check_kernel(*make_gpt_oss(t, 8, 64, 32, dtype, mxfp4))


@pytest.mark.parametrize("dtype,mxfp4", [(torch.float32, False), (torch.float32, True), (torch.bfloat16, True)],
                         ids=["float32", "float32-mxfp4", "bfloat16-mxfp4"])
def test_skewed_load_and_an_expert_with_no_tokens(dtype, mxfp4):
    """Expert 1 takes every token (two 16-row blocks at T=20), expert 3 none: its biases are NaN and its
    weights huge (MXFP4: scale 2 ** 113), which a kernel that read them would spread."""
    x, logits, w_gate_up, w_down, experts = make_gpt_oss(20, 8, 64, 32, dtype, mxfp4)
    logits[:, 1] += 30
    logits[:, 3] -= 30
    counts = moe_route(logits, 2, False, topk_softmax=True).expert_counts.tolist()
    assert counts[1] == 20 and counts[3] == 0 and sum(counts) == 40
    experts["bias_gate_up"][3] = float("nan")
    experts["bias_down"][3] = float("nan")
    if mxfp4:
        experts["scale_gate_up"][3] = 240
        experts["scale_down"][3] = 240
    else:
        w_gate_up[3] = float("nan")
        w_down[3] = float("nan")
    check_kernel(x, logits, w_gate_up, w_down, experts, top_k=2)


@pytest.mark.parametrize("config", [MoeConfig(16, 32, 64, group_m=2), MoeConfig(32, 64, 32), MOE_CONFIGS[-1][1]],
                         ids=["16x32x64-g2", "32x64x32", "largest"])
def test_mxfp4_configs_and_k_tails(config):
    """H = I = 96: BLOCK_K 64 leaves a 32-column tail (the masked path) in both GEMMs."""
    check_kernel(*make_gpt_oss(5, 4, 96, 96, torch.float32, mxfp4=True), top_k=2, config=config)


def test_plain_swiglu_with_mxfp4_weights():
    """MXFP4 without gpt-oss's extras: the softmax-then-top-k router, plain SwiGLU, no biases."""
    x, logits, w_gate_up, w_down, experts = make_gpt_oss(9, 4, 64, 32, torch.float32, mxfp4=True, spread=1.0)
    scales = dict(scale_gate_up=experts["scale_gate_up"], scale_down=experts["scale_down"])
    out = fused_moe(x, logits, w_gate_up, w_down, 2, True, SMALL, **scales)
    assert rel_err(out, fused_moe_ref(x, logits, w_gate_up, w_down, 2, True, **scales)) <= 1e-5


@pytest.mark.parametrize("e,top_k,t", [(32, 4, 9), (128, 4, 5), (6, 3, 7)])
def test_route_topk_softmax(e, top_k, t):
    """The routing kernel's gpt-oss mode: HF's picks in HF's order (largest logit first), a softmax over
    those k, and row lists holding each (token, slot) once under its expert."""
    logits = distinct_logits(t, e, torch.bfloat16)
    routing = moe_route(logits, top_k, False, topk_softmax=True)
    weights, ids = moe_route_ref(logits, top_k, False, topk_softmax=True)
    assert torch.equal(routing.topk_ids.long(), ids)
    assert routing.topk_weights.dtype == torch.bfloat16
    torch.testing.assert_close(routing.topk_weights.float(), weights.float(), rtol=1e-2 if not EXACT_BF16 else 4e-3,
                               atol=0)
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    assert torch.equal(routing.expert_counts.long(), counts)
    for expert in range(e):
        rows = routing.expert_rows[expert, :counts[expert]].sort().values
        assert torch.equal(rows.long(), torch.nonzero(ids.reshape(-1) == expert).squeeze(1))


def test_ops_take_moe_experts():
    """Both backends' op reads a MoeExperts: the Triton op (interpreted) equals the torch op."""
    from minfer.ops import MoeExperts, TorchOps
    from minfer.ops.triton_ops import TritonOps

    x, logits, w_gate_up, w_down, experts = make_gpt_oss(5, 4, 64, 32, torch.float32, mxfp4=True)
    moe = MoeExperts(w_gate_up, w_down, **experts)
    want = TorchOps().fused_moe(x, logits, moe, 2, False, topk_softmax=True)
    out = TritonOps(torch.device("cpu"), 16, 64).fused_moe(x, logits, moe, 2, False, topk_softmax=True)
    assert rel_err(out, want) <= 1e-5
    with pytest.raises(ValueError, match="both"):
        MoeExperts(w_gate_up, w_down, scale_gate_up=experts["scale_gate_up"])


def test_mxfp4_bad_arguments():
    x, logits, w_gate_up, w_down, experts = make_gpt_oss(3, 4, 64, 32, torch.float32, mxfp4=True)
    with pytest.raises(ValueError, match="block_k"):
        fused_moe(x, logits, w_gate_up, w_down, 2, False, MoeConfig(16, 32, 16), **experts)
    with pytest.raises(ValueError, match="scales"):
        fused_moe(x, logits, w_gate_up, w_down, 2, False, **{**experts, "scale_down": experts["scale_down"][:, :8]})
    with pytest.raises(TypeError, match="uint8"):
        fused_moe(x, logits, w_gate_up.float(), w_down, 2, False, **experts)
    codes = dict(dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiples of 32"):  # H = 48
        fused_moe(torch.randn(3, 48), logits, torch.zeros(4, 64, 24, **codes), torch.zeros(4, 48, 16, **codes), 2,
                  False, scale_gate_up=torch.zeros(4, 64, 1, **codes), scale_down=torch.zeros(4, 48, 1, **codes))
    with pytest.raises(ValueError, match="bias_down"):
        fused_moe(x, logits, w_gate_up, w_down, 2, False, **{**experts, "bias_down": experts["bias_down"][:2]})
