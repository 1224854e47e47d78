"""gpt-oss beyond the generic HF comparisons (``ARCHS["gpt_oss"]`` runs through tests/engine's every scenario and
tensor parallelism): YaRN's table against HF's, and MXFP4 checkpoints in the released layout.

An MXFP4 checkpoint is made from the float one: its experts quantized (``quantize_mxfp4``), written as
``*_blocks`` [E, N, K/32, 16] and ``*_scales`` [E, N, K/32] with gate/up rows interleaved, and beside it a float
"twin" holding the dequantized values. minfer on the MXFP4 checkpoint must equal HF on the twin: the two hold
the same numbers, so any difference is a layout or kernel error.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_greedy_match, assert_same_outputs, hf_greedy, kv_settings
from minfer import LLM, SamplingParams
from minfer.distributed import TensorParallel
from minfer.kernels.quant.mxfp4_ref import dequantize_mxfp4, quantize_mxfp4
from minfer.model.layers.rotary import rope_attention_factor, rope_inv_freq
from minfer.model.models.gpt_oss import GptOssExperts
from minfer.model.registry import load_model_config

NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
PROMPTS = [[5], list(range(2, 30)), [(i * 7) % 300 + 2 for i in range(50)]]  # the longer two pass the window (21)
NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("params", [
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096),  # truncate: default
    dict(factor=40.0, beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.707,
         original_max_position_embeddings=4096),
    dict(factor=4.0, attention_factor=1.3, original_max_position_embeddings=2048)])
def test_yarn_table_equals_hf(params):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = GptOssConfig(head_dim=64, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **params})
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    scaling = {"rope_type": "yarn", **params}
    assert torch.equal(rope_inv_freq(64, 150000.0, scaling), inv_freq)
    assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-12)


def write_mxfp4_pair(src: Path, out: Path) -> tuple[Path, Path]:
    """(the MXFP4 checkpoint, its float twin) made from the float checkpoint ``src``."""
    mx_dir, twin_dir = out / "mxfp4", out / "twin"
    for d in (mx_dir, twin_dir):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.safetensors"))
    mx, twin = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            rows = t.transpose(1, 2).contiguous()  # HF's [E, K, N] -> the checkpoint's rows [E, N, K]
            blocks, scales = quantize_mxfp4(rows)
            mx[name + "_blocks"], mx[name + "_scales"] = blocks.unflatten(-1, (-1, 16)), scales
            twin[name] = dequantize_mxfp4(blocks, scales, t.dtype).transpose(1, 2).contiguous()
        else:
            mx[name] = twin[name] = t
    save_file(mx, str(mx_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(twin, str(twin_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (mx_dir / "config.json").write_text(json.dumps(config))
    return mx_dir, twin_dir


@pytest.fixture(scope="module")
def mxfp4_pair(checkpoints, tmp_path_factory) -> tuple[Path, Path]:
    return write_mxfp4_pair(checkpoints["gpt_oss"], tmp_path_factory.mktemp("gpt_oss_mxfp4"))


def _run(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


SCENARIOS = {
    "default": dict(num_kv_blocks=64),
    "chunked": dict(num_kv_blocks=64, max_num_batched_tokens=7, max_num_seqs=2),
    "preempting": dict(num_kv_blocks=4, max_num_batched_tokens=6, max_num_seqs=4),  # the longest just fits alone
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_mxfp4_checkpoint_matches_hf_on_the_dequantized_weights(mxfp4_pair, scenario):
    mx_dir, twin_dir = mxfp4_pair
    llm = LLM(str(mx_dir), **kv_settings(mx_dir, SCENARIOS[scenario]))
    stats = llm.get_stats()
    assert stats["weight_dtype"] == "mxfp4 experts"
    experts = llm.llm_engine.runner.model.layers[0].mlp.experts
    assert experts.w_gate_up.dtype == torch.uint8  # kept packed: no dequantized copy in memory
    outs = _run(llm, PROMPTS)
    for prompt, out in zip(PROMPTS, outs):
        ref, ref_logits = hf_greedy(twin_dir, prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
        for step, (token, logprobs) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            expected = torch.log_softmax(ref_logits[step], -1)[token]
            assert logprobs[token] == pytest.approx(float(expected), abs=1e-4)
    if scenario == "default":  # the prompts again: their blocks from the prefix cache, the outputs the same
        assert_same_outputs(_run(llm, PROMPTS[1:]), outs[1:])
        assert llm.get_stats()["prefix_cache_hit_tokens"] > 0
    if scenario == "preempting":
        assert llm.get_stats()["num_preemptions"] > 0
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_mxfp4_on_the_triton_kernels_matches_hf(mxfp4_pair):
    """The Triton attention with sinks and windows and the MoE kernel expanding MXFP4 codes (the interpreter on
    the CPU), prompts past the window, chunked and mixed with decodes."""
    mx_dir, twin_dir = mxfp4_pair
    llm = LLM(str(mx_dir), attention_backend="triton",
              **kv_settings(mx_dir, dict(num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=2)))
    assert llm.llm_engine.runner.ops.name == "triton"
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]],
                        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS[1:], outs):
        ref, ref_logits = hf_greedy(twin_dir, prompt, 6)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)


def test_hf_reads_our_mxfp4_layout_as_the_twin(mxfp4_pair):
    """HF's own MXFP4 loader (dequantizing) on the written checkpoint gives the twin's expert weights: the
    interleaving, nibble order and transposes of ``write_mxfp4_pair`` are the released format's."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    mx_dir, twin_dir = mxfp4_pair
    hf = AutoModelForCausalLM.from_pretrained(str(mx_dir), dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True))
    twin = load_file(str(twin_dir / "model.safetensors"))
    params = dict(hf.named_parameters())
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert torch.equal(params[name].float(), twin[name])


def test_mxfp4_tp2_matches_tp1(mxfp4_pair):
    """Each rank reads its 32-column scale blocks of down_proj and its interleaved gate/up rows; rank 0 alone
    adds the down bias."""
    mx_dir, _ = mxfp4_pair
    settings = kv_settings(mx_dir, dict(num_kv_blocks=64))
    one = _run(LLM(str(mx_dir), **settings), PROMPTS)
    llm = LLM(str(mx_dir), tensor_parallel_size=2, **settings)
    try:
        assert_same_outputs(_run(llm, PROMPTS), one)
    finally:
        llm.shutdown()


def test_mxfp4_split_off_scale_blocks_fails_naming_the_sizes(mxfp4_pair):
    cfg = load_model_config(mxfp4_pair[0])
    cfg.moe_intermediate_size = 96  # 48 a rank: not whole 32-column blocks
    with pytest.raises(ValueError, match="multiples of 32"):
        GptOssExperts(cfg, torch.float32, TensorParallel(rank=0, size=2), packed=True)


@pytest.mark.gpu
@pytest.mark.parametrize("scenario", ["default", "chunked"])
def test_mxfp4_on_the_gpu_kernels_matches_hf(mxfp4_pair, scenario):
    """The Triton (and, on Hopper, Gluon) attention with sinks and windows, and the MoE kernel expanding MXFP4
    codes in registers, in float32 against HF on the dequantized twin."""
    mx_dir, twin_dir = mxfp4_pair
    llm = LLM(str(mx_dir), device="cuda", dtype="float32", **kv_settings(mx_dir, SCENARIOS[scenario]))
    assert llm.llm_engine.runner.ops.name == "triton"
    for prompt, out in zip(PROMPTS, _run(llm, PROMPTS)):
        ref, ref_logits = hf_greedy(twin_dir, prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
