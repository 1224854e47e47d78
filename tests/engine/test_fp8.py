"""FP8 weights on the CPU reference path: checkpoints in the formats people download load and give
the tokens and logprobs of their references; online quantization; bad formats fail at load."""
from __future__ import annotations

import json
import shutil

import pytest

from compare import assert_runs_agree, assert_within_quant_noise, hf_model
from conftest import make_checkpoint
from fp8_checkpoints import (
    assert_same_distributions, fake_quant_reference, write_block_fp8, write_compressed_tensors, write_dequantized,
    write_tensor_fp8,
)
from minfer import LLM, SamplingParams
from minfer.ops import triton_ops

PROMPTS = [[5], list(range(3, 20)), [(i * 7) % 300 + 2 for i in range(50)]]
NEW = 8
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=3)
# Both sides round each activation to e4m3, from float32 values whose summation order differs (this
# CPU's kernels against HF's, a batch of prompts against one, an all-reduce): a value on a rounding
# boundary lands a whole e4m3 step away and moves the logprobs of every later step. So each run is
# held to its reference teacher-forced, against FP8's own distance from the float model
# (``compare.assert_within_quant_noise``).


@pytest.fixture(scope="module")
def float_ckpts(tmp_path_factory):
    """Float checkpoints whose dimensions are multiples of 128 (FP8 blocks and activation groups)."""
    root = tmp_path_factory.mktemp("fp8src")
    return {arch: make_checkpoint(root / arch, arch, hidden=128, intermediate=256, scale=1.0)
            for arch in ("llama3", "qwen2", "qwen3", "phi3")}


def _generate(model_dir, **kwargs):
    llm = LLM(str(model_dir), num_kv_blocks=64, **kwargs)
    return llm, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)


def _check_against(outs, reference, unquantized) -> None:
    assert_within_quant_noise(outs, PROMPTS, reference, hf_model(unquantized))


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3", "phi3"])
@pytest.mark.parametrize("strategy,static", [("channel", False), ("tensor", True), ("block", False)])
def test_compressed_tensors_checkpoint_matches_hf(float_ckpts, tmp_path, arch, strategy, static):
    """Written by compressed-tensors itself; HF's forward of it rounds the activations to e4m3 as we do,
    so the logprobs agree to float32 rounding where no rounding flips, and within FP8's noise where one does.
    Phi-3 quantizes its fused qkv_proj and gate_up_proj whole: one scale per tensor, per row of the stack, or
    per 128-row block (k and v share one here), read at each shard's checkpoint rows."""
    ckpt = write_compressed_tensors(float_ckpts[arch], tmp_path / "ct", strategy, static)
    llm, outs = _generate(ckpt)
    quant = llm.llm_engine.runner.model.quant
    assert quant.block == (strategy == "block") and quant.static_input_scale == static
    _check_against(outs, hf_model(ckpt), float_ckpts[arch])


@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_block_fp8_checkpoint_matches_its_dequantized_reference(float_ckpts, tmp_path, arch):
    """The Qwen3-FP8 layout (weight_scale_inv per 128x128 block): HF's float model on the exactly
    dequantized weights, with its linear inputs rounded per 128-column group as the FP8 kernels do."""
    ckpt = write_block_fp8(float_ckpts[arch], tmp_path / "fp8")
    reference = fake_quant_reference(write_dequantized(ckpt, tmp_path / "deq"), block=True)
    llm, outs = _generate(ckpt)
    assert llm.llm_engine.runner.model.quant.block
    assert llm.get_stats()["weight_dtype"].startswith("fp8_e4m3")
    _check_against(outs, reference, float_ckpts[arch])


def test_per_tensor_fp8_checkpoint_matches_its_dequantized_reference(float_ckpts, tmp_path):
    """``quant_method: fp8`` without blocks: one weight scale per tensor (q, k and v each their own)."""
    ckpt = write_tensor_fp8(float_ckpts["qwen2"], tmp_path / "fp8")
    reference = fake_quant_reference(write_dequantized(ckpt, tmp_path / "deq"), block=False)
    llm, outs = _generate(ckpt)
    assert not llm.llm_engine.runner.model.quant.block
    _check_against(outs, reference, float_ckpts["qwen2"])


def test_online_fp8_matches_its_reference_and_halves_the_weights(float_ckpts):
    ckpt = float_ckpts["qwen3"]
    llm, outs = _generate(ckpt, quantization="fp8")
    reference = fake_quant_reference(ckpt, block=False, quantize_weights=True)
    _check_against(outs, reference, ckpt)
    fp8, plain = llm.get_stats(), LLM(str(ckpt), num_kv_blocks=64).get_stats()
    assert fp8["weight_dtype"] == "fp8_e4m3 per channel (online)" and plain["weight_dtype"] == "float32"
    linear = sum(p.numel() for n, p in llm.llm_engine.runner.model.named_parameters() if n.endswith("proj.weight"))
    assert plain["weight_bytes"] - fp8["weight_bytes"] >= 3 * linear - 4 * linear // 100  # 4 -> 1 byte, + scales


@pytest.mark.parametrize("arch", ["qwen2", "phi3"])
def test_fp8_under_tensor_parallelism_equals_one_process(tmp_path, arch):
    """Block scales shard with their rows and columns (each rank's share of o_proj's and down's inputs
    starts on a 128-column block: 4 heads of 64, MLP 512, over 2 ranks), and with Phi-3's fused qkv_proj and
    gate_up_proj each rank reads the block rows of its own shards from the one tensor. The all-reduce sums the ranks'
    partial products in another order than one process's GEMM, so an e4m3 rounding can flip between the
    two: both runs are held to the dequantized reference within FP8's noise, and to each other token for
    token until one process's top two are a near-tie on that scale."""
    src = make_checkpoint(tmp_path / "src", arch, hidden=256, intermediate=512, scale=1.0)
    ckpt = write_block_fp8(src, tmp_path / "fp8")
    reference = fake_quant_reference(write_dequantized(ckpt, tmp_path / "deq"), block=True)
    _, one = _generate(ckpt)
    llm = LLM(str(ckpt), num_kv_blocks=64, tensor_parallel_size=2)
    try:
        two = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    noise = assert_within_quant_noise(one, PROMPTS, reference, hf_model(src)).mean_noise
    assert_within_quant_noise(two, PROMPTS, reference, hf_model(src))
    assert assert_runs_agree(two, one, tol=noise, tie_gap=noise) >= len(PROMPTS)


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq", "bits": 4}, "awq"),
    ({"quant_method": "gptq", "bits": 4}, "gptq"),
    ({"quant_method": "bitsandbytes"}, "bitsandbytes"),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}}, "pack-quantized"),
])
def test_unsupported_quantization_fails_at_load_naming_it(float_ckpts, tmp_path, qc, match):
    ckpt = tmp_path / "q"
    shutil.copytree(float_ckpts["llama3"], ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = qc
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match) as info:
        LLM(str(ckpt))
    assert "minfer loads" in str(info.value) or "not supported" in str(info.value)


def test_bad_quantization_argument_names_the_field(float_ckpts):
    with pytest.raises(ValueError, match="quantization"):
        LLM(str(float_ckpts["llama3"]), quantization="int4")


@pytest.mark.parametrize("fmt", ["online", "online-cublas", "block", "static"])
def test_triton_fp8_path_matches_the_reference(float_ckpts, tmp_path, monkeypatch, fmt):
    """The Triton ops in the interpreter: the norms and SwiGLU emit e4m3 themselves, the channel and per-tensor
    products of these short prompts run through the split-K Triton GEMM (``online-cublas``: through
    ``_scaled_mm``, as past 64 rows), block ones through the block-scaled GEMM, batch 1 through the e4m3
    matrix-vector kernels; the same distributions as the reference ops (``assert_same_distributions``: e4m3
    rounding aside)."""
    monkeypatch.setattr(triton_ops, "FP8_SPLITK", not fmt.endswith("-cublas"))
    fmt = fmt.removesuffix("-cublas")
    kwargs = {"quantization": "fp8"} if fmt == "online" else {}
    ckpt = float_ckpts["qwen3"] if fmt == "online" else (
        write_block_fp8(float_ckpts["qwen3"], tmp_path / "fp8") if fmt == "block" else
        write_compressed_tensors(float_ckpts["qwen3"], tmp_path / "ct", "tensor", static_acts=True))
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": p} for p in (PROMPTS[1], PROMPTS[2][:24])]  # interpreted: keep them short
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(ckpt), num_kv_blocks=16, attention_backend=backend, **kwargs)
        outs[backend] = llm.generate(prompts, params, use_tqdm=False)
        outs[backend] += llm.generate(prompts[:1], params, use_tqdm=False)  # alone: the one-token path
    assert_same_distributions(outs["triton"], outs["torch"])
