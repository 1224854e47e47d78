"""A tiny random Qwen3-MoE model in the engine on a GPU (``pytest -m gpu``): the Triton path (fused MoE
kernels, decode graphs, the batch-1 forward) against the torch ops on the same GPU, and graphs against
eager steps.

What agreeing means. Two paths that compute the same model round at different places: the fused
kernels' dot order against the torch ops' GEMMs, a graph bucket's launch config against an eager
step's. In float32 that moves logprobs by float32 rounding only (the kernels' tf32x3 dots are
float32-level), so the tokens must be equal until the reference's top two are within 1e-3 nats, and
the logprobs within 1e-3 meanwhile. In bfloat16 a value moves by a bf16 step, and a router score that
moves can swap an expert at the top-k cut: a discrete change of the step's output, legitimate where
the router is at a near-tie, as the greedy token is where the logits are. How far such swaps and
roundings move the logprobs depends on the model and the chip, so no fixed tolerance fits: each
test measures the reference run's own distance from the torch ops in float32 (``run_differences``
over the same requests: bf16's noise, router swaps included) and allows the two bf16 paths a small
multiple (``NOISE_MULTIPLE``) of it: their mean logprob difference and their largest, and where
their tokens part, the reference's top-two gap. Two bf16 roundings against one give a difference
~1.4x the noise; a wrong expert, weight or routing moves whole distributions and fails by far.
"""
from __future__ import annotations

import functools

import pytest
import torch

from compare import assert_runs_agree, run_differences
from conftest import make_moe_checkpoint
from minfer import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[5], list(range(2, 18)), list(range(3, 40)), [(i * 7) % 300 + 2 for i in range(50)]]
PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=5)
FLOAT32_TOL = 1e-3  # nats: logprobs and the top-two gap where tokens may part
NOISE_MULTIPLE = 3.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Qwen3-MoE, 2 layers, 8 experts, top 2 renormalised (``conftest.make_moe_checkpoint``)."""
    return make_moe_checkpoint(tmp_path_factory.mktemp("moe_gpu") / "qwen3_moe", "qwen3_moe", tokenizer=False,
                               hidden_size=128, intermediate_size=192, head_dim=32, moe_intermediate_size=64)


@functools.cache
def outputs(ckpt, dtype: torch.dtype, backend: str = "triton", enforce_eager: bool = False) -> list:
    """The four prompts together, then the third alone: its decode steps run the batch-1 path."""
    llm = LLM(str(ckpt), device="cuda", dtype=str(dtype).removeprefix("torch."), num_kv_blocks=64,
              skip_tokenizer_init=True, attention_backend=backend, enforce_eager=enforce_eager)
    runner = llm.llm_engine.runner
    assert runner.ops.name == backend and (runner.graphs is None) == (enforce_eager or backend == "torch")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    outs += llm.generate({"prompt_token_ids": PROMPTS[2]}, PARAMS, use_tqdm=False)
    llm.shutdown()
    assert all(len(o.outputs[0].token_ids) == PARAMS.max_tokens for o in outs)
    return outs


def assert_agree(ckpt, fast: list, ref: list, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        assert_runs_agree(fast, ref, tol=FLOAT32_TOL, tie_gap=FLOAT32_TOL)
        return
    noise, _ = run_differences(ref, outputs(ckpt, torch.float32, backend="torch"))
    diffs, _ = run_differences(fast, ref)
    bound = NOISE_MULTIPLE * max(noise)
    assert assert_runs_agree(fast, ref, tol=bound, tie_gap=bound) >= len(PROMPTS) + 1
    mean_diff, mean_noise = sum(diffs) / len(diffs), sum(noise) / len(noise)
    assert mean_diff <= NOISE_MULTIPLE * mean_noise, (
        f"mean logprob difference {mean_diff:.3g} over {NOISE_MULTIPLE} x the reference's own bf16 distance "
        f"from float32 ({mean_noise:.3g})", diffs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_triton_moe_engine_matches_the_torch_ops(ckpt, dtype):
    assert_agree(ckpt, outputs(ckpt, dtype), outputs(ckpt, dtype, backend="torch"), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_moe_decode_graphs_equal_eager_steps(ckpt, dtype):
    """Graph replays pad the batch to a bucket, which can pick another MoE launch config than the eager
    step's; the padding rows are routed too but must not reach the real rows."""
    assert_agree(ckpt, outputs(ckpt, dtype), outputs(ckpt, dtype, enforce_eager=True), dtype)
