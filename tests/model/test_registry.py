"""The model registry: architectures resolve there and only there, an unknown one is refused with the list,
and a family added from outside (a class and a registry line) loads and runs through the whole engine."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.model import registry
from minfer.model.models.llama import LlamaForCausalLM


def test_an_unknown_architecture_fails_at_construction_with_the_supported_list(checkpoints, tmp_path):
    folder = shutil.copytree(checkpoints["llama3"], tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["NotAModelForCausalLM"]}))
    with pytest.raises(ValueError, match="NotAModelForCausalLM") as err:
        LLM(str(folder), num_kv_blocks=16)
    assert all(name in str(err.value) for name in registry.ARCHITECTURES)


def test_each_family_reads_its_own_config(checkpoints):
    qwen2 = registry.load_model_config(checkpoints["qwen2"])
    qwen3 = registry.load_model_config(checkpoints["qwen3"])
    llama = registry.load_model_config(checkpoints["llama3"])
    assert (qwen2.attention_bias, qwen2.qk_norm) == (True, False)
    assert (qwen3.attention_bias, qwen3.qk_norm) == (False, True)
    assert (llama.attention_bias, llama.qk_norm) == (False, False)


class ScaledEmbeddingLM(LlamaForCausalLM):
    """A made-up family: Llama whose embeddings are multiplied by 2 (as Gemma scales by sqrt(hidden)).
    What a new dense architecture needs: its class, and a registry line."""

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids) * 2
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, meta)
        return x + residual


def test_a_family_added_from_outside_loads_and_runs(checkpoints, tmp_path, monkeypatch):
    monkeypatch.setitem(registry.ARCHITECTURES, "ScaledEmbeddingLM", ScaledEmbeddingLM)
    folder = shutil.copytree(checkpoints["llama3"], tmp_path / "scaled")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["ScaledEmbeddingLM"]}))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    prompt = {"prompt_token_ids": [5, 9, 17, 3]}
    with LLM(str(folder), num_kv_blocks=32, dtype="float32") as llm:
        assert isinstance(llm.llm_engine.runner.model, ScaledEmbeddingLM)
        scaled = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    with LLM(str(checkpoints["llama3"]), num_kv_blocks=32, dtype="float32") as llm:
        plain = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    # the same weights with the new wiring: the first token's distribution is not Llama's
    assert scaled.logprobs[0] != plain.logprobs[0], (scaled.logprobs[0], plain.logprobs[0])
    assert len(scaled.token_ids) == 6 and torch.isfinite(torch.tensor(list(scaled.logprobs[0].values()))).all()
