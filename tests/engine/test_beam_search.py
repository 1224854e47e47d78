"""LLM.beam_search equals HF transformers' generate(num_beams=k, do_sample=False) on a tiny random model: the
same k sequences in the same order, the same length-penalised scores, with EOS inside the beams (the checkpoints
name as EOS tokens the model often proposes), one EOS id or two (HF then keeps 3k candidates), each early_stopping
mode; beams share their prompt's KV blocks through the prefix cache; the result has vLLM's shape."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import _hf_model, make_checkpoint

from minfer import LLM, BeamSearchParams
from minfer.beam_search import BeamSearchOutput

# Tokens the seed-0 llama3 checkpoint often proposes: as EOS they end some beams early and leave others running.
EOS_IDS = {"one_eos": [119], "two_eos": [119, 29]}
PROMPTS = [[5, 9, 17], [(i * 7) % 300 + 2 for i in range(20)], list(range(2, 40))]
TIE = 1e-3


def _checkpoint(root: Path, eos: list[int]) -> Path:
    path = make_checkpoint(root / "llama3", "llama3")
    for name in ("config.json", "generation_config.json"):  # HF and the engine both read either
        config = json.loads((path / name).read_text())
        config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
        (path / name).write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, LLM]]:
    paths = {name: _checkpoint(tmp_path_factory.mktemp(name), eos) for name, eos in EOS_IDS.items()}
    return {name: (path, LLM(str(path), num_kv_blocks=128)) for name, path in paths.items()}


def _hf_beams(path: Path, prompt: list[int], params: BeamSearchParams) -> list[tuple[list[int], float]]:
    k = params.beam_width
    out = _hf_model(path).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   num_beams=k, num_return_sequences=k, do_sample=False,
                                   max_new_tokens=params.max_tokens, length_penalty=params.length_penalty,
                                   early_stopping=params.early_stopping, return_dict_in_generate=True,
                                   output_scores=True, pad_token_id=0)
    lengths = (out.beam_indices >= 0).sum(1).tolist()  # generated tokens (the rest is padding)
    return [(out.sequences[i, len(prompt):len(prompt) + n].tolist(), float(out.sequences_scores[i]))
            for i, n in enumerate(lengths)]


def _assert_same_beams(ours: BeamSearchOutput, ref: list[tuple[list[int], float]]) -> None:
    """Rank by rank the same scores (to float32 rounding) and the same tokens; two ranks whose scores are a
    near-tie may come in either order."""
    got = [(s.output_token_ids, s.score) for s in ours.sequences]
    assert len(got) == len(ref)
    for j, ((tokens, score), (ref_tokens, ref_score)) in enumerate(zip(got, ref)):
        assert abs(score - ref_score) < TIE, (j, got, ref)
        tied = any(abs(ref_score - other) < TIE for i, (_, other) in enumerate(ref) if i != j)
        assert tokens == ref_tokens or tied, (j, got, ref)


CASES = [  # (beam_width, max_tokens, length_penalty, early_stopping)
    (2, 16, 1.0, True),
    (3, 16, 1.0, False),
    (4, 10, 0.5, "never"),
]


@pytest.mark.parametrize("eos", list(EOS_IDS))
def test_beam_search_equals_hf(models, eos):
    """Every case on every prompt (the prompts of a case search together); across the cases some sequences end in
    EOS (finish_reason 'stop', the EOS kept in tokens and counted in the length) and some searches stop before
    max_tokens."""
    path, llm = models[eos]
    stopped, early = [], 0
    for width, max_tokens, length_penalty, early_stopping in CASES:
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty,
                                  early_stopping=early_stopping)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
        assert len(outs) == len(PROMPTS)
        for prompt, out in zip(PROMPTS, outs):
            _assert_same_beams(out, _hf_beams(path, prompt, params))
            stopped += [(s, length_penalty) for s in out.sequences if s.finish_reason == "stop"]
            early += max(len(s.output_token_ids) for s in out.sequences) < max_tokens
    assert stopped and early
    for seq, length_penalty in stopped:
        assert seq.tokens[-1] in EOS_IDS[eos]
        assert seq.score == pytest.approx(seq.cum_logprob / len(seq.output_token_ids) ** length_penalty)
    stats = llm.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_output_has_vllms_shape_and_beams_share_blocks(models):
    _, llm = models["one_eos"]
    tok = llm.get_tokenizer()
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"  # a few full 16-token blocks
    before = llm.get_stats()["prefix_cache_hit_tokens"]
    (out,) = llm.beam_search(prompt, BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))
    ids = tok.encode(prompt)
    assert len(ids) >= 32
    # every round after the first reads the prompt's full blocks from the cache, once per beam
    assert llm.get_stats()["prefix_cache_hit_tokens"] - before >= 5 * 2 * (len(ids) // 16 * 16)
    for seq in out.sequences:
        assert seq.tokens[:len(ids)] == ids and seq.num_prompt_tokens == len(ids)
        assert len(seq.output_token_ids) == 6 and seq.finish_reason == "length"  # ignore_eos: every beam runs on
        assert seq.text == tok.decode(seq.tokens)
        chosen = [entry[t] for entry, t in zip(seq.logprobs, seq.output_token_ids)]
        assert seq.cum_logprob == pytest.approx(sum(chosen), abs=1e-5)
    assert out.sequences[0].score >= out.sequences[1].score


def test_max_tokens_past_the_context_is_cut_and_bad_params_refused(models):
    path, _ = models["one_eos"]
    llm = LLM(str(path), num_kv_blocks=16, max_model_len=32)
    (out,) = llm.beam_search({"prompt_token_ids": list(range(2, 30))}, BeamSearchParams(2, 10, ignore_eos=True))
    assert [len(s.output_token_ids) for s in out.sequences] == [4, 4]  # 28 + 4 = max_model_len
    for kw, field in [({"beam_width": 0, "max_tokens": 4}, "beam_width"),
                      ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
                      ({"beam_width": 2, "max_tokens": 4, "early_stopping": "sometimes"}, "early_stopping"),
                      ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty")]:
        with pytest.raises(ValueError, match=f"^{field}"):
            BeamSearchParams(**kw)
