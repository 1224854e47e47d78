"""EAGLE-3 heads: each draft is the head's over HF's hidden states of the target (a reference written here from
the checkpoint's tensors), the output is the target's whatever the head drafts, and a head that predicts the
target gets its drafts accepted."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import minfer.engine.spec.speculator as speculator_module
from conftest import VOCAB, _hf_model, assert_greedy_match, hf_greedy, make_checkpoint
from minfer import LLM, SamplingParams
from test_speculative import PROMPTS, SCENARIOS, _all_free

AUX = [0, 2, 3]  # the target's layers the head reads (4-layer targets)
K = 3
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def write_head(out: Path, target: Path, *, draft_vocab: int = 256, seed: int = 3,
               tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """An EAGLE-3 head for ``target`` in the public checkpoint format: random weights (or ``tensors``), a draft
    vocabulary of ``draft_vocab`` target ids (``d2t``)."""
    cfg = json.loads((target / "config.json").read_text())
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d, inter = h // heads, cfg["intermediate_size"]
    head_cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
                "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
                "num_key_value_heads": kv, "head_dim": d, "rms_norm_eps": cfg["rms_norm_eps"],
                "max_position_embeddings": cfg["max_position_embeddings"], "vocab_size": cfg["vocab_size"],
                "draft_vocab_size": draft_vocab, "tie_word_embeddings": False, "torch_dtype": "float32",
                "rope_parameters": cfg.get("rope_parameters"), "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX}}
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) / shape[-1] ** 0.5  # noqa: E731
    ids = torch.randperm(cfg["vocab_size"], generator=gen)[:draft_vocab].sort().values
    p = "midlayer."
    weights = {"fc.weight": rand(h, 3 * h), "norm.weight": 1 + 0.2 * torch.randn(h, generator=gen),
               "lm_head.weight": 2 * rand(draft_vocab, h), "d2t": ids - torch.arange(draft_vocab),
               "t2d": torch.zeros(cfg["vocab_size"], dtype=torch.bool).index_fill_(0, ids, True),
               p + "hidden_norm.weight": 1 + 0.2 * torch.randn(h, generator=gen),
               p + "input_layernorm.weight": 1 + 0.2 * torch.randn(h, generator=gen),
               p + "post_attention_layernorm.weight": 1 + 0.2 * torch.randn(h, generator=gen),
               p + "self_attn.q_proj.weight": rand(heads * d, 2 * h), p + "self_attn.k_proj.weight": rand(kv * d, 2 * h),
               p + "self_attn.v_proj.weight": rand(kv * d, 2 * h), p + "self_attn.o_proj.weight": rand(h, heads * d),
               p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
               p + "mlp.down_proj.weight": rand(h, inter)} | (tensors or {})
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(head_cfg))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_drafts(target: Path, head: Path, tokens: list[int], k: int) -> list[torch.Tensor]:
    """The head's k draft distributions (logits over the target's vocabulary) after ``tokens``, from scratch: HF's
    hidden states of every position but the last, each with the next token, then the head's own features."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf = _hf_model(target)
    w = load_file(str(head / "model.safetensors"))
    cfg = json.loads((head / "config.json").read_text())
    eps, nh, nkv, d = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    with torch.no_grad():
        states = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        feats = torch.cat([states[i][0] for i in AUX], -1) @ w["fc.weight"].T
        inputs, logits = list(tokens[1:]), []
        embed = hf.get_input_embeddings().weight
        for _ in range(k):
            n = len(inputs)
            p = "midlayer."
            x = torch.cat([_rms(embed[inputs], w[p + "input_layernorm.weight"], eps),
                           _rms(feats, w[p + "hidden_norm.weight"], eps)], -1)
            q = (x @ w[p + "self_attn.q_proj.weight"].T).view(1, n, nh, d).transpose(1, 2)
            kk = (x @ w[p + "self_attn.k_proj.weight"].T).view(1, n, nkv, d).transpose(1, 2)
            v = (x @ w[p + "self_attn.v_proj.weight"].T).view(1, n, nkv, d).transpose(1, 2)
            cos, sin = hf.model.rotary_emb(v, torch.arange(n)[None])
            q, kk = apply_rotary_pos_emb(q, kk, cos, sin)
            attn = F.scaled_dot_product_attention(q, kk, v, is_causal=True, enable_gqa=True)
            h = attn.transpose(1, 2).reshape(n, nh * d) @ w[p + "self_attn.o_proj.weight"].T + feats
            m = _rms(h, w[p + "post_attention_layernorm.weight"], eps)
            out = (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) \
                @ w[p + "mlp.down_proj.weight"].T + h
            draft = _rms(out[-1], w["norm.weight"], eps) @ w["lm_head.weight"].T
            full = torch.full((len(w["t2d"]),), float("-inf")).index_copy_(
                0, torch.arange(len(draft)) + w["d2t"], draft)
            logits.append(full)
            inputs.append(int(full.argmax()))
            feats = torch.cat([feats, out[-1:]])
    return logits


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("eagle3")
    target = make_checkpoint(root / "target", "llama3", layers=4)
    return target, write_head(root / "head", target)


def _eagle(head: Path) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}


@pytest.mark.parametrize("scenario", ["default", "chunked"])
def test_drafts_are_the_heads_over_the_targets_hidden_states(pair, scenario, monkeypatch):
    """With the back-off off every step drafts, so the head is fed every position: each step's drafts are the
    reference's, whatever the target accepted of the last ones (a sampled step may draw anything: greedy here)."""
    target, head = pair
    monkeypatch.setattr(speculator_module, "BACKOFF_AFTER", 10**9)
    llm = LLM(str(target), speculative_config=_eagle(head), **SCENARIOS[scenario])
    drafter = llm.llm_engine.speculator.drafter
    seen: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose

    def spy(seqs, room, batch):
        probs = propose(seqs, room, batch)
        seen.extend((list(s.token_ids), list(s.spec_token_ids)) for s in seqs if s.spec_token_ids)
        return probs

    monkeypatch.setattr(drafter, "propose", spy)
    prompts = PROMPTS[2:]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref, ref_logits = hf_greedy(target, prompt, GREEDY.max_tokens)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
    assert len(seen) >= 2 * GREEDY.max_tokens // (K + 1)
    for tokens, drafts in seen:
        for logits, draft in zip(reference_drafts(target, head, tokens, len(drafts)), drafts):
            assert logits[draft] >= logits.max() - 1e-3, (tokens, drafts)
    assert _all_free(llm)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_equals_the_target(pair, scenario, async_scheduling):
    target, head = pair
    llm = LLM(str(target), speculative_config=_eagle(head), async_scheduling=async_scheduling, **SCENARIOS[scenario])
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    if scenario == "prefix":
        outs += llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS * 2, outs):
        ref, ref_logits = hf_greedy(target, prompt, GREEDY.max_tokens)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
    assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0
    assert _all_free(llm)


def test_a_head_that_predicts_the_target_is_accepted(tmp_path):
    """A target whose layers add nothing (o_proj, down_proj zero) with tied embeddings repeats its last token;
    a head that reads the embedding back (fc picks the last aux layer, its layer adds nothing, lm_head is the
    embedding) predicts exactly that: nearly every draft is accepted, and the output is still HF's."""
    target = make_checkpoint(tmp_path / "target", "llama_linear", layers=4)
    weights = load_file(str(target / "model.safetensors"))
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, str(target / "model.safetensors"))
    h = weights["model.embed_tokens.weight"].shape[1]
    fc = torch.zeros(h, 3 * h)
    fc[:, 2 * h:] = torch.eye(h)
    head = write_head(tmp_path / "head", target, draft_vocab=VOCAB, tensors={
        "fc.weight": fc, "lm_head.weight": weights["model.embed_tokens.weight"],
        "norm.weight": weights["model.norm.weight"], "d2t": torch.zeros(VOCAB, dtype=torch.int64),
        "midlayer.self_attn.o_proj.weight": torch.zeros(h, h), "midlayer.mlp.down_proj.weight": torch.zeros(h, 128)})
    llm = LLM(str(target), speculative_config=_eagle(head), num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref, ref_logits = hf_greedy(target, prompt, GREEDY.max_tokens)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
    stats = llm.get_stats()
    assert stats["spec_decode_acceptance_rate"] > 0.9, stats
    assert _all_free(llm)


@pytest.mark.parametrize("change, field", [
    (lambda c: c.update(vocab_size=VOCAB + 1), "vocab_size"),
    (lambda c: c.update(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 9]}), "layer_ids"),
    (lambda c: c.update(target_hidden_size=32), "hidden states of width"),
])
def test_a_head_for_another_target_is_refused(pair, tmp_path, change, field):
    target, head = pair
    bad = tmp_path / "head"
    bad.mkdir()
    cfg = json.loads((head / "config.json").read_text())
    change(cfg)
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").symlink_to(head / "model.safetensors")
    with pytest.raises(ValueError, match=field):
        LLM(str(target), speculative_config=_eagle(bad), num_kv_blocks=64)


def test_a_head_does_not_serve_alone_nor_a_model_head(pair):
    target, head = pair
    with pytest.raises(ValueError, match="a draft head, not a model"):
        LLM(str(head), num_kv_blocks=64)
    with pytest.raises(ValueError, match="not an EAGLE-3 draft head"):
        LLM(str(target), speculative_config=_eagle(target), num_kv_blocks=64)


def test_sampling_structured_outputs_and_aborts_through_a_head(pair):
    """Seeded sampling (n = 2, logprobs, top-k/p, penalties) repeats itself through the head's drafts and
    rejection sampling, a JSON schema holds over drafted tokens, an abort mid-speculation leaks nothing."""
    from minfer.structured_outputs import StructuredOutputsParams

    target, head = pair
    llm = LLM(str(target), speculative_config=_eagle(head), num_kv_blocks=64)
    params = [SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12),
              SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=9, max_tokens=10, repetition_penalty=1.3,
                             logprobs=2)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    first, again = (llm.generate(prompts, params, use_tqdm=False) for _ in range(2))
    for a, b in zip(first, again):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert all(t in entry for t, entry in zip(first[1].outputs[0].token_ids, first[1].outputs[0].logprobs))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    out = llm.generate(["x"], SamplingParams(max_tokens=40, temperature=0,
                                             structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False)
    assert set(json.loads(out[0].outputs[0].text)) == {"a"}
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort_request("1")
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0
    assert _all_free(llm)
