"""Multimodal checkpoints serve their language model: a tiny ``Gemma3ForConditionalGeneration`` written by
transformers (a one-layer vision tower beside the text model) gives HF's greedy tokens and logprobs on text
prompts under default, chunked and preempting settings, and no tower or projector tensor is ever read."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoint_reads import record_reads
from conftest import VOCAB, assert_greedy_match, hf_greedy, kv_settings, make_tokenizer
from minfer import LLM, SamplingParams
from minfer.model.models.multimodal import TextOfMultimodal

PROMPTS = [[5], list(range(3, 20)), [(i * 7) % 300 + 2 for i in range(50)]]
NEW = 10
SCENARIOS = {"default": dict(num_kv_blocks=64),
             "chunked": dict(num_kv_blocks=64, max_num_batched_tokens=6, max_num_seqs=4),
             "preempt": dict(num_kv_blocks=4, max_num_batched_tokens=16, max_num_seqs=4)}


@pytest.fixture(scope="module")
def gemma3_mm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, sliding_window=21, sliding_window_pattern=3,
                query_pre_attn_scalar=64, max_position_embeddings=512, rms_norm_eps=1e-6,
                bos_token_id=0, eos_token_id=1, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1,
                       boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3, tie_word_embeddings=False)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))  # Gemma's (1 + w) norms
            elif p.dim() > 1:
                p.copy_(torch.randn_like(p) * 2.0 / p.shape[-1] ** 0.5 * (2.0 if "embed" in name else 1.0))
    out = tmp_path_factory.mktemp("gemma3_mm")
    model.save_pretrained(str(out))
    make_tokenizer(out)
    return out


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_text_model_of_a_multimodal_checkpoint_matches_hf(gemma3_mm, scenario):
    llm = LLM(str(gemma3_mm), **kv_settings(gemma3_mm, SCENARIOS[scenario]))
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref, ref_logits = hf_greedy(gemma3_mm, prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
        for tok, entry, logits in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, ref_logits):
            assert abs(entry[tok] - float(logits.log_softmax(-1)[tok])) < 1e-4
    if scenario == "preempt":
        assert llm.get_stats()["num_preemptions"] > 0
    assert set(llm.get_stats()["kv_group_windows"]) == {0, 21}  # the text model's hybrid cache


@pytest.fixture(scope="module")
def gemma4_mm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 4 stores the text model under ``model.language_model.`` beside ``model.vision_tower.`` and
    ``model.embed_vision.``."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=21,
                layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=8,
                vocab_size_per_layer_input=VOCAB, max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
                pad_token_id=0, tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    cfg = Gemma4Config(text_config=text, vision_config=vision, audio_config=None, tie_word_embeddings=False)
    cfg.architectures = ["Gemma4ForConditionalGeneration"]
    torch.manual_seed(0)
    model = Gemma4ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.copy_(torch.randn_like(p) * 2.0 / p.shape[-1] ** 0.5)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("gemma4_mm")
    model.save_pretrained(str(out))
    make_tokenizer(out)
    return out


def test_gemma4_text_model_of_a_multimodal_checkpoint_matches_hf(gemma4_mm):
    outs = LLM(str(gemma4_mm), num_kv_blocks=64).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True),
        use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref, ref_logits = hf_greedy(gemma4_mm, prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)


def test_no_tower_or_projector_tensor_is_read(gemma3_mm, monkeypatch):
    read = record_reads(monkeypatch)
    LLM(str(gemma3_mm), num_kv_blocks=16)
    from safetensors import safe_open

    stored = [k for f in gemma3_mm.glob("*.safetensors") for k in safe_open(str(f), "pt").keys()]
    towers = [k for k in stored if "vision" in k or "multi_modal" in k]
    assert towers and not any(k in read for k in towers), [k for k in read if k in towers]
    assert {k for k in stored if k.startswith("language_model.")} <= set(read)


def test_config_and_names_of_both_layouts():
    hf = json.loads(json.dumps(dict(architectures=["Gemma3ForConditionalGeneration"], tie_word_embeddings=True,
                                    eos_token_id=[1, 106], text_config=dict(vocab_size=VOCAB, hidden_size=64,
                                    intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=32))))
    from minfer.model.registry import model_config

    cfg = model_config(hf)
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (1, 106) and cfg.layer_types[5] == "full_attention"
    name = TextOfMultimodal.checkpoint_name
    assert name("language_model.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert name("model.language_model.norm.weight") == "model.norm.weight"
    assert name("language_model.lm_head.weight") == name("lm_head.weight") == "lm_head.weight"
    for other in ("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", "model.vision_tower.x.weight",
                  "multi_modal_projector.mm_input_projection_weight", "model.embed_audio.embedding_projection.weight"):
        assert name(other) is None
    with pytest.raises(ValueError, match="text_config"):
        model_config(dict(architectures=["Gemma4ForConditionalGeneration"]))
