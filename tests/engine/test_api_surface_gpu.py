"""The API surface of issue 40 on a GPU: logit_bias and allowed_token_ids through the Triton sampler inside CUDA-graph
decode steps, beam search and embeddings on the CUDA engine, against the same references as their CPU tests."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_checkpoint
from test_beam_search import CASES, _assert_same_beams, _checkpoint, _hf_beams
from test_beam_search import PROMPTS as BEAM_PROMPTS
from test_embed import PROMPTS as EMBED_PROMPTS
from test_embed import assert_close, reference, write_st_config

from minfer import LLM, BeamSearchParams, SamplingParams

pytestmark = pytest.mark.gpu


def test_logit_bias_and_allowed_ids_through_the_gpu_sampler(tmp_path: Path) -> None:
    """One batch mixing a plain greedy row, a row forced by a +100 bias, a row banned from its greedy token, and a
    sampled row restricted to two ids; the plain row equals a run without the others."""
    path = make_checkpoint(tmp_path / "llama3", "llama3")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256)
    prompt = {"prompt_token_ids": [5, 9, 17, 33]}
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (ref,) = llm.generate([prompt], plain, use_tqdm=False)
    greedy = ref.outputs[0].token_ids
    forced = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias={77: 100.0})
    banned = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias={greedy[0]: -100.0})
    allowed = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, allowed_token_ids=[3, 250])
    outs = llm.generate([prompt] * 4, [plain, forced, banned, allowed], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == greedy
    assert set(outs[1].outputs[0].token_ids) == {77}
    assert outs[2].outputs[0].token_ids[0] != greedy[0]
    assert set(outs[3].outputs[0].token_ids) <= {3, 250}


def test_beam_search_on_the_gpu_equals_hf(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, [119])
    llm = LLM(str(path), dtype="float32", num_kv_blocks=256)
    for width, max_tokens, length_penalty, early_stopping in CASES:
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty,
                                  early_stopping=early_stopping)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in BEAM_PROMPTS], params)
        for prompt, out in zip(BEAM_PROMPTS, outs):
            _assert_same_beams(out, _hf_beams(path, prompt, params))


@pytest.mark.parametrize("mode", ["LAST", "MEAN"])
def test_embeddings_on_the_gpu_equal_hf(tmp_path: Path, mode: str) -> None:
    from transformers import AutoModel

    base = make_checkpoint(tmp_path / "default", "llama3")
    path = base if mode == "LAST" else write_st_config(Path(shutil.copytree(base, tmp_path / "mean")), mode, True)
    model = AutoModel.from_pretrained(str(base), dtype=torch.float32).eval()
    llm = LLM(str(path), runner="pooling", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24,
              max_num_seqs=4)
    outs = llm.embed([{"prompt_token_ids": p} for p in EMBED_PROMPTS])
    with torch.no_grad():
        for prompt, out in zip(EMBED_PROMPTS, outs):
            states = model(torch.tensor([prompt])).last_hidden_state[0]
            assert_close(out.outputs.embedding, reference(states, mode, True))
