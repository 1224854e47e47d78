"""The fused MoE kernels against their torch reference, and the reference against HF transformers' MoE blocks.

On the CPU the kernels run under the Triton interpreter at small shapes (E 4 and 8, top-k 1 and 2, T 1, 3, 17,
I a power of two or not), with skewed loads (an expert with no rows, an expert with every token) and tied
router logits. The ``gpu`` tests repeat the check at qwen3-30b-a3b and mixtral-8x7b layer shapes (bfloat16),
inside a CUDA graph.

Tolerances (relative Frobenius error unless said):
- float32, kernel vs reference: 1e-5. Same roundings; only the order of each float32 dot product's sum
  differs (seen: ~3e-7). The sum over a token's experts is in the same (slot) order in both: no atomics.
- float16, kernel vs reference: 2e-4, a tenth of the format's own error (seen: up to 2e-5, against 7e-4 for
  either vs float64). Both round every intermediate where HF does, and only a rounding that the different
  dot order tips goes the other way. This is the check of the rounding order: the interpreter rounds
  float32 -> float16 to nearest, as GPUs do.
- bfloat16, against the float64 result: the reference (HF's own arithmetic) 1e-2 (seen: up to 5e-3), the
  kernel 1e-2 on a GPU but 4e-2 under the interpreter, which rounds float32 -> bfloat16 toward zero
  (kernel_testlib): the six roundings on a row's way add up to a bias toward zero (seen: 1.1-2.2e-2).
- reference vs HF's blocks: 1e-6 in float32 and ``torch.equal``-level in bfloat16 against the path a loaded
  HF model runs (``grouped_mm``); 1e-6 in float32 against the eager expert loop, which rounds each weighted
  row and sums in another order.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_testlib import EXACT_BF16, distinct_logits, rel_err, seed_per_case  # noqa: F401 (seed_per_case: autouse)

from minfer.kernels.moe.moe import MOE_CONFIGS, MoeConfig, fused_moe, max_blocks, moe_config, moe_route
from minfer.kernels.moe.moe_ref import fused_moe_ref, moe_experts_ref, moe_route_ref

KERNEL_TOL = {torch.float32: 1e-5, torch.float16: 2e-4, torch.bfloat16: 1e-2 if EXACT_BF16 else 4e-2}
SMALL = MoeConfig(16, 32, 32)  # 16-row blocks, 16-column gate/up halves: several blocks and tiles at test shapes


def make_moe(t: int, e: int, h: int, i: int, dtype: torch.dtype, device: str = "cpu"):
    """x, router logits (no ties), w_gate_up, w_down at unit output scale."""
    x = torch.randn(t, h, device=device).to(dtype)
    logits = distinct_logits(t, e, dtype, device)
    w_gate_up = (torch.randn(e, 2 * i, h, device=device) / h ** 0.5).to(dtype)
    w_down = (torch.randn(e, h, i, device=device) / i ** 0.5).to(dtype)
    return x, logits, w_gate_up, w_down


def exact(x, logits, w_gate_up, w_down, top_k, renormalize, **kw) -> torch.Tensor:
    """The reference in float64 on the same inputs (routing from the same logits)."""
    weights, ids = moe_route_ref(logits, top_k, renormalize, **kw)
    return moe_experts_ref(x.double(), weights.double(), ids, w_gate_up.double(), w_down.double())


def check(x, logits, w_gate_up, w_down, top_k, renormalize, config=None, **kw) -> None:
    out = fused_moe(x, logits, w_gate_up, w_down, top_k, renormalize, config, **kw)
    ref = fused_moe_ref(x, logits, w_gate_up, w_down, top_k, renormalize, **kw)
    assert out.shape == x.shape and out.dtype == x.dtype
    if x.dtype == torch.bfloat16:
        want = exact(x, logits, w_gate_up, w_down, top_k, renormalize, **kw)
        assert rel_err(ref, want) <= 1e-2
        err = rel_err(out, want)
    else:
        err = rel_err(out, ref)
    assert err <= KERNEL_TOL[x.dtype], f"rel err {err:.2e} > {KERNEL_TOL[x.dtype]:.0e} ({x.dtype}, {config})"


# ------------------------------------------------------------------------------------------------ kernel
@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("e,top_k", [(4, 1), (4, 2), (8, 1), (8, 2)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("h,i", [(64, 32), (64, 48)])
def test_fused_moe_float32(t, e, top_k, renormalize, h, i):
    check(*make_moe(t, e, h, i, torch.float32), top_k, renormalize)


@pytest.mark.parametrize("t", [1, 17])
@pytest.mark.parametrize("e,top_k", [(4, 2), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_16bit(t, e, top_k, dtype):
    check(*make_moe(t, e, 64, 48, dtype), top_k, True)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float32_weights(dtype, top_k):
    """Mixtral's router keeps the weights float32: weighted rows in float32, one rounding after the sum."""
    check(*make_moe(17, 8, 64, 48, dtype), top_k, True, weights_dtype=torch.float32)


@pytest.mark.parametrize("config", [SMALL, MoeConfig(32, 64, 16, group_m=2), MoeConfig(16, 32, 64, group_m=4),
                                    MOE_CONFIGS[-1][1]], ids=["16x32x32", "32x64x16-g2", "16x32x64-g4", "largest"])
@pytest.mark.parametrize("h,i", [(64, 48), (40, 24)])  # K of either GEMM not a multiple of block_k
def test_configs(config, h, i):
    check(*make_moe(17, 4, h, i, torch.float32), 2, True, config)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skewed_load(dtype):
    """Expert 1 takes every token (two 16-row blocks at T=17), expert 3 none: its weights hold NaN, which a
    kernel that read them would spread."""
    x, logits, w_gate_up, w_down = make_moe(17, 4, 64, 48, dtype)
    logits[:, 1] += 30
    logits[:, 3] -= 30
    w_gate_up[3] = float("nan")
    w_down[3] = float("nan")
    routing = moe_route(logits, 2, True)
    assert routing.expert_counts.tolist()[1] == 17 and routing.expert_counts.tolist()[3] == 0
    check(x, logits, w_gate_up, w_down, 2, True, SMALL)
    check(x, logits, w_gate_up, w_down, 1, False, SMALL)


def test_ties_inside_top_k():
    """Equal logits that are all chosen: the same experts whichever way the tie is broken."""
    x, logits, w_gate_up, w_down = make_moe(5, 8, 64, 32, torch.float32)
    logits[:, 2] = logits[:, 6] = 10.0  # two clear winners, tied
    check(x, logits, w_gate_up, w_down, 2, True)
    logits[:, 1] = 10.0  # three tied winners, top 3
    check(x, logits, w_gate_up, w_down, 3, False)


def test_ties_across_the_cut():
    """A tie at the k-th place goes to the lower expert index (torch.topk promises no order there: on the CPU
    it picks [2, 3] of four equal logits), so the expected output uses those picks explicitly."""
    x, logits, w_gate_up, w_down = make_moe(3, 4, 64, 32, torch.float32)
    logits[0] = 0.0  # all four tied, top 2: experts 0, 1
    logits[1] = torch.tensor([0.0, 1.0, 1.0, 1.0])  # 1 clear, then 2 and 3 tied for the second place: 1, 2
    logits[2] = torch.tensor([3.0, 0.5, -1.0, 0.5])  # 0, then 1 and 3 tied: 0, 1
    routing = moe_route(logits, 2, True)
    assert routing.topk_ids.tolist() == [[0, 1], [1, 2], [0, 1]]
    probs = torch.softmax(logits, -1)
    ids = routing.topk_ids.long()
    weights = probs.gather(1, ids)
    weights /= weights.sum(-1, keepdim=True)
    torch.testing.assert_close(routing.topk_weights, weights, rtol=1e-6, atol=0)
    out = fused_moe(x, logits, w_gate_up, w_down, 2, True)
    assert rel_err(out, moe_experts_ref(x, weights, ids, w_gate_up, w_down)) <= 1e-5


@pytest.mark.parametrize("e,top_k,t", [(8, 2, 17), (128, 8, 40), (6, 3, 9)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route(e, top_k, t, renormalize):
    """The routing kernel: HF's picks in HF's order, its weights, and row lists that hold every (token, slot)
    once under its expert; the padded blocks fit the grid's bound."""
    logits = distinct_logits(t, e, torch.bfloat16)
    routing = moe_route(logits, top_k, renormalize)
    weights, ids = moe_route_ref(logits, top_k, renormalize)
    assert torch.equal(routing.topk_ids.long(), ids)
    assert routing.topk_weights.dtype == torch.bfloat16
    torch.testing.assert_close(routing.topk_weights.float(), weights.float(), rtol=1e-2 if not EXACT_BF16 else 4e-3,
                               atol=0)
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    assert torch.equal(routing.expert_counts.long(), counts)
    for expert in range(e):
        rows = routing.expert_rows[expert, :counts[expert]].sort().values
        assert torch.equal(rows.long(), torch.nonzero(ids.reshape(-1) == expert).squeeze(1))
    for block_m in (16, 64):
        assert sum(-(-int(c) // block_m) for c in counts) <= max_blocks(t, top_k, e, block_m)


def test_config_table():
    """The table is data: increasing buckets, the last open-ended, every tile one the kernels take."""
    bounds = [b for b, _ in MOE_CONFIGS]
    assert bounds == sorted(bounds) and bounds[-1] == float("inf")
    for _, cfg in MOE_CONFIGS:
        assert cfg.block_n % 32 == 0 and cfg.block_m >= 16 and cfg.block_k >= 16
    assert moe_config(1, 8, 128).block_m == 16 and moe_config(4096, 2, 8).block_m == MOE_CONFIGS[-1][1].block_m


def test_empty_and_bad_arguments():
    x, logits, w_gate_up, w_down = make_moe(3, 4, 64, 32, torch.float32)
    assert fused_moe(x[:0], logits[:0], w_gate_up, w_down, 2, True).shape == (0, 64)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe(x, logits, w_gate_up, w_down, 5, True)
    with pytest.raises(ValueError, match="inconsistent"):
        fused_moe(x, logits[:, :3], w_gate_up, w_down, 2, True)
    with pytest.raises(TypeError, match="dtype"):
        fused_moe(x, logits, w_gate_up.half(), w_down, 2, True)
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe(x.t().contiguous().t(), logits, w_gate_up, w_down, 2, True)


# ------------------------------------------------------------------------------------ reference against HF
def hf_eager_loop(x, router_weight, gate_up_proj, down_proj, top_k, norm_topk_prob, cast_weights):
    """HF's router and eager expert loop (Qwen3MoeTopKRouter / MixtralTopKRouter, Qwen3MoeExperts.forward),
    line for line; ``cast_weights``: Qwen3-MoE's cast of the weights to the logits' dtype."""
    router_logits = F.linear(x, router_weight)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, top_k, dim=-1)
    if norm_topk_prob:
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    if cast_weights:
        router_top_value = router_top_value.to(router_logits.dtype)
    top_k_index, top_k_weights = router_indices, router_top_value
    num_experts = gate_up_proj.shape[0]
    final_hidden_states = torch.zeros_like(x)
    expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=num_experts + 1)
    expert_mask = expert_mask.permute(2, 1, 0)
    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
        current_state = x[token_idx]
        gate, up = F.linear(current_state, gate_up_proj[expert_idx]).chunk(2, dim=-1)
        current_hidden_states = F.silu(gate) * up
        current_hidden_states = F.linear(current_hidden_states, down_proj[expert_idx])
        current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
    return final_hidden_states



def hf_block(arch: str, e: int, top_k: int, renormalize: bool, h: int, i: int, dtype: torch.dtype,
             experts_implementation: str | None):
    """An HF sparse MoE block with random weights; ``experts_implementation`` 'grouped_mm' is what a loaded
    model runs, None (a block built on its own) the eager loop."""
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        cfg = Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=top_k,
                             norm_topk_prob=renormalize)
    else:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        cfg = MixtralConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=top_k)
    cfg._experts_implementation = experts_implementation
    block = Block(cfg).to(dtype).eval()
    with torch.no_grad():
        block.gate.weight.copy_(torch.randn(e, h) / h ** 0.5 * 3)
        block.experts.gate_up_proj.copy_(torch.randn(e, 2 * i, h) / h ** 0.5)
        block.experts.down_proj.copy_(torch.randn(e, h, i) / i ** 0.5)
    return block


ARCHS = [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)]


@pytest.mark.parametrize("arch,renormalize", ARCHS, ids=["qwen3-norm", "qwen3", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_hf(arch, renormalize, dtype):
    e, top_k, h, i, t = 8, 2, 64, 48, 23
    x = torch.randn(t, h).to(dtype)
    weights_dtype = torch.float32 if arch == "mixtral" else None  # Mixtral's router does not cast its weights
    for impl in ("grouped_mm", None):
        block = hf_block(arch, e, top_k, renormalize, h, i, dtype, impl)
        with torch.no_grad():
            want = block(x[None])[0]
            logits = F.linear(x, block.gate.weight)
            ours = fused_moe_ref(x, logits, block.experts.gate_up_proj, block.experts.down_proj, top_k, renormalize,
                                 weights_dtype=weights_dtype)
            loop = hf_eager_loop(x, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj, top_k,
                                 renormalize, cast_weights=arch != "mixtral")
        if impl is None:  # the eager loop: HF's class and our copy of its code agree exactly
            assert torch.equal(want, loop)
        if dtype == torch.float32 or impl == "grouped_mm":
            assert rel_err(ours, want) <= 1e-6, f"{impl}: {rel_err(ours, want):.2e}"
            if dtype == torch.bfloat16:
                torch.testing.assert_close(ours, want, rtol=0, atol=0)
        else:  # bfloat16 eager: each weighted row rounded, summed in expert order
            assert rel_err(ours, want) <= 1e-2


def test_kernel_matches_hf_block():
    block = hf_block("qwen3_moe", 8, 2, True, 64, 48, torch.float32, "grouped_mm")
    x = torch.randn(9, 64)
    with torch.no_grad():
        want = block(x[None])[0]
        out = fused_moe(x, F.linear(x, block.gate.weight), block.experts.gate_up_proj.data,
                        block.experts.down_proj.data, 2, True)
    assert rel_err(out, want) <= 1e-5


# ----------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [(2048, 768, 128, 8), (4096, 14336, 8, 2)], ids=["qwen3-30b-a3b", "mixtral-8x7b"])
@pytest.mark.parametrize("t", [1, 7, 64, 300])
def test_gpu_graph(shape, t):
    """At real layer shapes in bfloat16, replayed from a CUDA graph (no host sync, grids from shapes)."""
    h, i, e, top_k = shape
    x, logits, w_gate_up, w_down = make_moe(t, e, h, i, torch.bfloat16, "cuda")
    fused_moe(x, logits, w_gate_up, w_down, top_k, True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, logits, w_gate_up, w_down, top_k, True)
    x.copy_(torch.randn_like(x))
    graph.replay()
    want = exact(x, logits, w_gate_up, w_down, top_k, True)
    assert rel_err(out, want) <= 1e-2
