"""Gemma 2 / 3: configs read as HF's config classes read them (written by transformers 5, by older versions
with only the fields that differ from the defaults, and the released checkpoints' own keys), each layer's
rotary table equal to HF's for its layer type, the embedding normalizer rounded as HF rounds it, and the
benchmark shapes. The engine's tokens and logprobs against HF are in tests/engine (archs gemma2, gemma3)."""
from __future__ import annotations

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.benchmark import shapes
from minfer.model.loader import build_model
from minfer.model.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from minfer.model.random_weights import tensor_shapes
from minfer.model.registry import load_model_config, model_config
from minfer.ops import TorchOps

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16)
GEMMA2 = [
    dict(TINY, num_hidden_layers=5),  # only what differs from Gemma2Config's defaults (older save_pretrained)
    dict(TINY, num_hidden_layers=3, sliding_window=21, query_pre_attn_scalar=24, final_logit_softcapping=None,
         attn_logit_softcapping=20.0, rope_theta=5000.0),
]
GEMMA3 = [
    dict(TINY, num_hidden_layers=13),  # defaults: pattern 6, bases 1e6 and 1e4, no soft-caps
    # the released 4B+ text configs' keys: rope_theta + rope_scaling (global), rope_local_base_freq
    dict(TINY, num_hidden_layers=7, sliding_window=512, sliding_window_pattern=3, rope_theta=1e6,
         rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=168),
    # transformers 5: one rope_parameters dict per layer type, and layer_types written out
    dict(TINY, num_hidden_layers=4, layer_types=["full_attention", "sliding_attention"] * 2,
         rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 2e5},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 3e3}},
         final_logit_softcapping=25.0),
]


def _hf_config(model_type: str, fields: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, **fields)


def _rope(params: dict) -> tuple[float, dict | None]:
    kind = params.get("rope_type", "default")
    scaling = None if kind == "default" else {k: v for k, v in params.items() if k != "rope_theta"}
    return float(params["rope_theta"]), scaling


@pytest.mark.parametrize("model_type,cls,fields", [("gemma2", Gemma2ForCausalLM, f) for f in GEMMA2] +
                         [("gemma3_text", Gemma3ForCausalLM, f) for f in GEMMA3])
def test_config_reads_as_hf_reads_it(model_type, cls, fields):
    hf = _hf_config(model_type, fields)
    cfg = cls.read_config({**fields, "architectures": [cls.__name__]})
    assert cfg.layer_types == tuple(hf.layer_types)
    assert [cfg.layer_window(i) for i in range(cfg.num_hidden_layers)] == \
        [hf.sliding_window if t == "sliding_attention" else 0 for t in hf.layer_types]
    assert cfg.extra["query_pre_attn_scalar"] == hf.query_pre_attn_scalar
    assert cfg.extra["attn_logit_softcapping"] == (hf.attn_logit_softcapping or 0.0)
    assert cfg.extra["final_logit_softcapping"] == (hf.final_logit_softcapping or 0.0)
    assert (cfg.tie_word_embeddings, cfg.head_dim, cfg.rms_norm_eps, cfg.qk_norm) == \
        (hf.tie_word_embeddings, hf.head_dim, hf.rms_norm_eps, model_type == "gemma3_text")
    for i, kind in enumerate(hf.layer_types):
        params = hf.rope_parameters[kind] if model_type == "gemma3_text" else hf.rope_parameters
        assert cls.layer_rope(cfg, i) == _rope(params), (i, kind)


@pytest.mark.parametrize("fields,match", [(dict(attention_bias=True), "attention_bias"),
                                          (dict(use_bidirectional_attention=True), "bidirectional"),
                                          (dict(hidden_activation="gelu"), "hidden_activation")])
def test_unsupported_settings_are_refused_by_name(fields, match):
    with pytest.raises(ValueError, match=match):
        Gemma3ForCausalLM.read_config({**TINY, "num_hidden_layers": 2, **fields})


def test_each_layer_rotates_with_its_layer_types_table_as_hf(checkpoints):
    """Sliding layers share the local table, global layers the (linearly scaled) global one, each equal to
    HF's cos/sin for that layer type at every position."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    from conftest import _hf_model

    path = checkpoints["gemma3"]
    cfg = load_model_config(path)
    model = build_model(path, cfg, torch.float32, torch.device("cpu"), 512, TorchOps())
    hf_rotary = Gemma3RotaryEmbedding(_hf_model(path).config)
    positions = torch.arange(512)[None]
    tables = {}
    for layer, kind in zip(model.layers, cfg.layer_types):
        table = layer.self_attn.rotary.cos_sin_cache
        assert tables.setdefault(kind, table) is table  # one table per layer type
        cos, sin = hf_rotary(torch.zeros(1, dtype=torch.float32), positions, kind)
        half = cfg.head_dim // 2
        torch.testing.assert_close(table, torch.cat([cos[0, :, :half], sin[0, :, :half]], -1), rtol=0, atol=0)
    assert len(tables) == 2


def test_tied_head_logprobs_match_hf(tmp_path, monkeypatch):
    """The released Gemmas tie the LM head to the embedding (the engine archs are untied: see conftest)."""
    from conftest import ARCHS, hf_greedy, make_checkpoint

    monkeypatch.setitem(ARCHS, "gemma2_tied", dict(ARCHS["gemma2"], tie=True))
    path = make_checkpoint(tmp_path / "tied", "gemma2_tied")
    prompt = [(i * 7) % 300 + 2 for i in range(50)]
    with LLM(str(path), num_kv_blocks=64) as llm:
        assert llm.llm_engine.runner.model.lm_head is llm.llm_engine.runner.model.embed_tokens
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                                         logprobs=3), use_tqdm=False)[0].outputs[0]
    ref_tokens, ref_logits = hf_greedy(path, prompt, 4)
    assert out.token_ids == ref_tokens
    for entry, logits in zip(out.logprobs, ref_logits):
        ref = logits.log_softmax(-1)
        assert set(ref.topk(3).indices.tolist()) <= set(entry)
        assert max(abs(lp - float(ref[t])) for t, lp in entry.items()) < 1e-4


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_bfloat16_pieces_round_as_hf(checkpoints, arch):
    """In bfloat16 (a float32 checkpoint, as google's Gemma 2 repos hold) the parts this family wires are bit
    for bit HF's: the scaled embedding, every (1 + w) norm (w rounded to the model dtype before the one is added),
    q/k norms, GeGLU, and the final norm + LM head + logit soft-cap (also into a CUDA graph's ``out`` buffer).
    (Attention's own rounding is the ops' and is compared end to end in tests/engine.)"""
    from transformers import AutoModelForCausalLM

    from minfer.ops.torch_ops import rms_norm_hf

    path = checkpoints[arch]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()
    ours = build_model(path, load_model_config(path), torch.bfloat16, torch.device("cpu"), 64, TorchOps())
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(9, 64, generator=gen) * 3).to(torch.bfloat16)
    with torch.no_grad():
        ids = torch.arange(hf.config.vocab_size)
        assert torch.equal(ours.embed(ids), hf.model.embed_tokens(ids[None])[0])
        for layer, ref in zip(ours.layers, hf.model.layers):
            for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm"):
                assert torch.equal(getattr(layer, name)(x), getattr(ref, name)(x)), name
            assert torch.equal(layer.mlp(x), ref.mlp(x))
            if hasattr(ref.self_attn, "q_norm"):
                heads = x.view(9, 2, 32)
                for norm in ("q_norm", "k_norm"):
                    got = rms_norm_hf(heads, getattr(layer.self_attn, norm).weight, layer.self_attn.q_norm.eps)
                    assert torch.equal(got, getattr(ref.self_attn, norm)(heads)), norm
        expected = hf.lm_head(hf.model.norm(x))
        if hf.config.final_logit_softcapping:
            cap = hf.config.final_logit_softcapping
            expected = torch.tanh(expected / cap) * cap
        assert torch.equal(ours.compute_logits(x, float32=False), expected)
        out = torch.empty_like(expected)
        ours.compute_logits(x, float32=False, out=out)
        assert torch.equal(out, expected)


@pytest.mark.parametrize("hidden,dtype", [(3840, torch.bfloat16), (5376, torch.bfloat16), (64, torch.float32)])
def test_embedding_normalizer_is_rounded_to_the_model_dtype_as_hf(hidden, dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    cfg = Gemma3ForCausalLM.read_config(dict(TINY, hidden_size=hidden, num_attention_heads=1, num_key_value_heads=1,
                                             vocab_size=8, intermediate_size=8, num_hidden_layers=1))
    model = Gemma3ForCausalLM(cfg, dtype, 8, TorchOps())
    hf = Gemma3TextScaledWordEmbedding(8, hidden, 0, embed_scale=hidden ** 0.5)
    assert model.embed_scale.dtype == dtype
    assert float(model.embed_scale) == float(hf.embed_scale.to(dtype))


@pytest.mark.parametrize("shape,params_b", [("gemma-3-12b", 11.77), ("gemma-3-27b", 27.01)])
def test_gemma3_shapes(shape, params_b):
    """The released text models' layout: 5 sliding (1024) : 1 global, local base 1e4, global 1e6 x8 (linear),
    tied head; their weights (the language model without the vision tower) counted by checkpoint_shapes."""
    cfg = model_config(shapes.shape_config(shape))
    assert cfg.architecture == "Gemma3ForCausalLM" and cfg.qk_norm and cfg.tie_word_embeddings
    assert [cfg.layer_window(i) for i in range(12)] == [1024] * 5 + [0] + [1024] * 5 + [0]
    assert (cfg.rope_theta, cfg.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert Gemma3ForCausalLM.layer_rope(cfg, 0) == (1e4, None)
    assert cfg.extra["attn_logit_softcapping"] == cfg.extra["final_logit_softcapping"] == 0.0
    total = sum(torch.Size(s).numel() for s in tensor_shapes(cfg).values())
    assert abs(total / 1e9 - params_b) < 0.01


def test_scaled_down_gemma3_shape_writes_and_dummy_loads_the_same_weights(tmp_path):
    small = dict(TINY, vocab_size=512)
    written = shapes.write_random_checkpoint("gemma-3-27b", tmp_path / "ck", torch.float32, layers=6, overrides=small)
    dummy = shapes.write_shape_config("gemma-3-27b", tmp_path / "dummy", torch.float32, layers=6, overrides=small)
    models = [build_model(path, load_model_config(path), torch.float32, torch.device("cpu"), 64, TorchOps(),
                          load_format=fmt) for path, fmt in ((written, "auto"), (dummy, "dummy"))]
    real, drawn = (dict(m.named_parameters()) for m in models)
    assert real.keys() == drawn.keys()
    for name, p in real.items():
        assert torch.equal(p, drawn[name]), name
        if "norm" in name:
            assert torch.equal(p, torch.full_like(p, 2.0)), name  # the checkpoint's 1, as 1 + w
