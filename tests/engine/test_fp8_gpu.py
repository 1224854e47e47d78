"""FP8 weights on the GPU (`pytest -m gpu`): the FP8 tensor-core path (cuBLASLt row-wise scaled GEMM,
the Triton block-scaled GEMM, e4m3 matrix-vector kernels at batch 1, decode graphs) against the
reference path on the same GPU (``attention_backend="torch"``: dequantized weights, e4m3-rounded
activations), in bfloat16. Both round activations to e4m3 from bf16 values that differ by summation
order, so single values may land an e4m3 step apart and a probability moves by a few hundredths; a
wrong scale or layout changes the distribution outright, which is what this checks."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import make_checkpoint
from fp8_checkpoints import write_block_fp8, write_compressed_tensors
from minfer import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5], list(range(3, 20)), [(i * 7) % 300 + 2 for i in range(50)], list(range(100, 180))]
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=4)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("fp8gpu") / "src", "qwen2", hidden=256, intermediate=512,
                           dtype=torch.bfloat16)


def _logprobs(ckpt, **kwargs) -> list[list[dict[int, float]]]:
    """Per request, its steps' top logprobs; the last request runs alone, so its steps after the first
    decode through the batch-1 graph (the e4m3 matrix-vector kernels)."""
    llm = LLM(str(ckpt), device="cuda", dtype="bfloat16", num_kv_blocks=128, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    alone = llm.generate({"prompt_token_ids": PROMPTS[2]}, PARAMS, use_tqdm=False)
    return [o.outputs[0].logprobs for o in outs + alone]


@pytest.mark.parametrize("fmt", ["online", "ct_channel", "ct_tensor_static", "ct_block", "fp8_block"])
def test_fp8_tensor_core_path_agrees_with_the_reference(src, tmp_path, fmt):
    kwargs = {}
    if fmt == "online":
        ckpt, kwargs = src, {"quantization": "fp8"}
    elif fmt == "fp8_block":
        ckpt = write_block_fp8(src, tmp_path / "fb")
    else:
        pytest.importorskip("compressed_tensors")
        strategy = {"ct_channel": "channel", "ct_tensor_static": "tensor", "ct_block": "block"}[fmt]
        ckpt = write_compressed_tensors(src, tmp_path / "ct", strategy, fmt == "ct_tensor_static")
    fast = _logprobs(ckpt, **kwargs)
    ref = _logprobs(ckpt, attention_backend="torch", **kwargs)
    pairs = []
    for f, r in zip(fast, ref):  # each step while the two have drawn the same tokens
        for step in range(len(r)):
            pairs.append((f[step], r[step]))
            if max(f[step], key=f[step].get) != max(r[step], key=r[step].get):
                break
    for f, r in pairs:
        ranked = sorted(r.items(), key=lambda kv: -kv[1])
        shared = [t for t, _ in ranked if t in f]
        assert len(shared) >= 2, (f, r)  # the top tokens are the same tokens
        assert max(abs(math.exp(f[t]) - math.exp(r[t])) for t in shared) < 0.08, (f, r)  # probabilities
        if ranked[0][1] - ranked[1][1] > 0.3:  # no near-tie: the same greedy token
            assert max(f, key=f.get) == ranked[0][0], (f, r)
