"""Phi-3 / Phi-4 (``Phi3ForCausalLM``) without the engine: longrope's table is HF's rotary output in the regime
it serves, the config is read as HF's Phi3Config reads it (legacy rope names, its defaults, the top-level
original length first), unsupported settings are refused by name, and random-weight checkpoints carry
Phi's fused tensor names (what benchmark shapes and ``load_format="dummy"`` draw)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.model.layers.rotary import RotaryEmbedding, long_rope, rope_attention_factor
from minfer.model.models.phi3 import Phi3ForCausalLM
from minfer.model.registry import load_model_config, model_config

SHORT = [1.0, 1.3, 1.7, 2.2, 3.0, 4.1, 5.5, 7.5]
LONG = [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0]


def _hf_cos_sin(extra: dict, length: int) -> torch.Tensor:
    """HF's Phi3RotaryEmbedding over positions 0..length-1 (one forward of that many tokens), as our
    table's layout: [cos | sin] of the head_dim/2 frequencies."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = Phi3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **extra)
    rotary = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, length, 64)
    cos, sin = rotary(x, torch.arange(length)[None])
    return torch.cat([cos[0, :, :8], sin[0, :, :8]], dim=-1)


@pytest.mark.parametrize("rope", [
    dict(),  # the attention factor from max_position_embeddings / original (512 / 16: sqrt(1 + ln 32 / ln 16) = 1.5)
    dict(factor=4.0),  # ... from an explicit factor
    dict(attention_factor=1.2),  # as written
])
def test_longrope_table_is_hfs_within_and_beyond_the_original_length(rope):
    """max_model_len within the original length: the short factors, HF's table for every sequence (all
    of them stay within it); beyond it: the long factors, HF's table for a forward longer than it."""
    extra = dict(max_position_embeddings=512, original_max_position_embeddings=16,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT,
                                  "long_factor": LONG, **rope})
    cfg = model_config(dict(extra, architectures=["Phi3ForCausalLM"], vocab_size=320, hidden_size=64,
                            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    assert not long_rope(cfg.rope_scaling, 16) and long_rope(cfg.rope_scaling, 17)
    short = RotaryEmbedding(cfg.head_dim, 16, cfg.rope_theta, cfg.rope_scaling).cos_sin_cache
    assert torch.equal(short, _hf_cos_sin(extra, 16))
    long = RotaryEmbedding(cfg.head_dim, 512, cfg.rope_theta, cfg.rope_scaling).cos_sin_cache
    assert torch.equal(long[:40], _hf_cos_sin(extra, 40))
    assert not torch.equal(long[:16], short)  # (the two sets differ where HF's do)


def test_a_hub_phi3_128k_config_reads_as_hfs():
    """Phi-3-mini-128k's first config.json: rope_scaling type 'su' (longrope's old name), the original
    length at the top level, no factor: the attention factor comes from 131072 / 4096."""
    hub = dict(architectures=["Phi3ForCausalLM"], hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, vocab_size=32064, max_position_embeddings=131072,
               original_max_position_embeddings=4096, rope_theta=10000.0, sliding_window=262144,
               rope_scaling={"type": "su", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
               torch_dtype="bfloat16", bos_token_id=1, eos_token_id=32000)
    cfg = model_config(hub)
    assert cfg.rope_scaling["rope_type"] == "longrope" and cfg.rope_scaling["original_max_position_embeddings"] == 4096
    assert rope_attention_factor(cfg.rope_scaling) == math.sqrt(1 + math.log(32) / math.log(4096))
    assert cfg.rms_norm_eps == 1e-5  # Phi3Config's default, which the file leaves out
    assert cfg.layer_window(31) == 262144 and not cfg.tie_word_embeddings


def test_phi4_mini_partial_rotary_is_refused_by_name():
    hub = dict(architectures=["Phi3ForCausalLM"], hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
               num_attention_heads=24, num_key_value_heads=8, vocab_size=200064, max_position_embeddings=131072,
               original_max_position_embeddings=4096, partial_rotary_factor=0.75,
               rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48})
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75"):
        model_config(hub)
    with pytest.raises(ValueError, match="longrope needs 64 factors"):  # factors sized for the partial rotation
        cfg = model_config({**hub, "partial_rotary_factor": 1.0})
        RotaryEmbedding(cfg.head_dim, 16, cfg.rope_theta, cfg.rope_scaling)


def test_checkpoint_shapes_are_the_checkpoints_fused_tensors(checkpoints):
    """What random-weight benchmark checkpoints and dummy loads draw: HF's own tensor names and shapes."""
    from safetensors import safe_open

    folder = checkpoints["phi3"]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        written = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    shapes = Phi3ForCausalLM.checkpoint_shapes(load_model_config(folder))
    assert shapes == written
    assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (64 + 2 * 32, 64)
    assert shapes["model.layers.1.mlp.gate_up_proj.weight"] == (2 * 128, 64)


def test_dummy_load_of_a_phi_config_generates(checkpoints, tmp_path):
    config = json.loads((checkpoints["phi3"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, num_kv_blocks=16)
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
