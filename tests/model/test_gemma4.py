"""Gemma 4 (text, dense): configs read as HF's config reads them (transformers 5's ``per_layer_config`` and the
older ``global_head_dim`` keys alike), shared-KV layers on the producers HF's ``kv_sharing_modes`` names, each
layer type's rotary table equal to HF's (the proportional one too), ``checkpoint_shapes`` equal to an HF
checkpoint's tensors, and what minfer does not build refused by name. Tokens and logprobs against HF are in
tests/engine (arch gemma4)."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from minfer.model.loader import build_model
from minfer.model.models.gemma4 import Gemma4ForCausalLM
from minfer.model.registry import load_model_config
from minfer.ops import TorchOps

S, F = "sliding_attention", "full_attention"
TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, hidden_size_per_layer_input=8, vocab_size_per_layer_input=64)
LAYOUTS = [
    dict(TINY, num_hidden_layers=7),  # HF's defaults: five sliding to one global, global head 512, no sharing
    dict(TINY, num_hidden_layers=6, layer_types=[S, F, S, S, F, F], num_kv_shared_layers=3, global_head_dim=32,
         num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=21),
    # without attention_k_eq_v, HF ignores num_global_key_value_heads
    dict(TINY, num_hidden_layers=8, layer_types=[S, S, F, S, S, F, S, F], num_kv_shared_layers=4, global_head_dim=64,
         num_global_key_value_heads=1, use_double_wide_mlp=True,
         rope_parameters={S: {"rope_type": "default", "rope_theta": 5e3},
                          F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e5}}),
]


def _hf_config(fields: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model("gemma4_text", **fields)


@pytest.mark.parametrize("fields", LAYOUTS)
def test_config_reads_as_hf_reads_it(fields):
    hf = _hf_config(fields)
    for written in (fields, hf.to_dict()):  # a config with global_head_dim, and transformers 5's per_layer_config
        cfg = Gemma4ForCausalLM.read_config({**written, "architectures": ["Gemma4ForCausalLM"]})
        assert cfg.layer_types == tuple(hf.layer_types)
        n = hf.num_hidden_layers
        assert [cfg.layer_window(i) for i in range(n)] == [hf.sliding_window if t == S else 0 for t in hf.layer_types]
        assert cfg.extra["layer_head_dims"] == tuple(hf.per_layer_config[i].head_dim for i in range(n))
        assert cfg.extra["layer_kv_heads"] == tuple(hf.per_layer_config[i].num_key_value_heads for i in range(n))
        modes, sources = hf.kv_sharing_modes, cfg.extra["kv_sources"]
        for i, mode in enumerate(modes):
            if mode == "reuse":  # HF reads the K/V its type's "store" layer left
                assert modes[sources[i]] == "store" and hf.layer_types[sources[i]] == hf.layer_types[i]
            else:
                assert sources[i] == i
        assert (cfg.tie_word_embeddings, cfg.head_dim, cfg.extra["ple_size"], cfg.extra["double_wide_mlp"]) == \
            (hf.tie_word_embeddings, hf.to_dict()["head_dim"], hf.hidden_size_per_layer_input,
             hf.use_double_wide_mlp)


@pytest.mark.parametrize("fields", LAYOUTS[1:])
def test_each_layer_types_table_is_hfs(fields):
    """cos and sin of every layer type at every position equal HF's, bit for bit: the proportional rope's
    unrotated pairs are zero frequencies (cos 1, sin 0) in both."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    hf = _hf_config(fields)
    cfg = Gemma4ForCausalLM.read_config({**fields, "architectures": ["Gemma4ForCausalLM"]})
    model = Gemma4ForCausalLM(cfg, torch.float32, 300, TorchOps())
    rotary = Gemma4TextRotaryEmbedding(hf)
    positions = torch.arange(300)[None]
    for kind in (S, F):
        cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions, kind)
        half = cos.shape[-1] // 2
        table = model.rotary[kind].cos_sin_cache
        assert torch.equal(table[:, :half], cos[0, :, :half]) and torch.equal(table[:, half:], sin[0, :, :half])
        assert torch.equal(cos[0, :, :half], cos[0, :, half:])  # rotate-half pairs i with i + D/2


def test_checkpoint_shapes_are_an_hf_checkpoints_tensors(checkpoints):
    """The names and shapes ``checkpoint_shapes`` lists (what dummy weights draw) are those HF saved, shared
    layers' missing k/v projections and norms included; and a dummy load finds every parameter."""
    folder = checkpoints["gemma4"]
    cfg = load_model_config(folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        saved = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert Gemma4ForCausalLM.checkpoint_shapes(cfg) == saved
    model = build_model(folder, cfg, torch.float32, torch.device("cpu"), 64, TorchOps(), load_format="dummy")
    owners = model.attention_layers()
    assert [(a.num_kv_heads, a.head_dim, a.window) for a in owners] == [(2, 16, 21), (1, 32, 0), (2, 16, 21)]
    sources = cfg.extra["kv_sources"]
    for i, layer in enumerate(model.layers):  # the shared layers attend over their producer's cache
        attn = layer.self_attn
        assert (attn.attn is None) == (sources[i] != i)
        if attn.attn is None:
            assert attn.source is model.layers[sources[i]].self_attn.attn


@pytest.mark.parametrize("fields,match", [
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16), "enable_moe_block"),
    (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
    (dict(use_bidirectional_attention="vision"), "use_bidirectional_attention"),
    (dict(hidden_activation="gelu"), "hidden_activation"),
    (dict(per_layer_config={"1": {"intermediate_size": 64}}), "per_layer_config"),
    (dict(num_kv_shared_layers=2), "num_kv_shared_layers"),
    (dict(layer_types=[S, S], num_kv_shared_layers=1), "shared-KV layer 1"),
    (dict(rope_parameters={S: {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
                           F: {"rope_type": "default", "rope_theta": 1e4}}), "yarn"),
])
def test_unsupported_settings_are_refused_by_name(fields, match):
    with pytest.raises(ValueError, match=match):
        Gemma4ForCausalLM.read_config({**TINY, "num_hidden_layers": 2, **fields})


def test_the_kernels_are_chosen_by_the_largest_head():
    """HF's default layout has global heads of 512: past the Triton kernels' 256, so 'auto' takes the torch ops
    and 'triton' is refused, where the local heads alone would have passed."""
    from minfer.ops import select_ops

    cfg = Gemma4ForCausalLM.read_config({**LAYOUTS[0], "architectures": ["Gemma4ForCausalLM"]})
    assert (cfg.head_dim, cfg.max_head_dim) == (16, 512)
    assert select_ops("auto", torch.device("cpu"), 16, cfg.max_head_dim).name == "torch"
    with pytest.raises(ValueError, match="head_dim"):
        select_ops("triton", torch.device("cpu"), 16, cfg.max_head_dim)
