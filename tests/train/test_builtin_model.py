"""The model shipped in the package: loads offline, matches HF transformers, eval-ppl agrees with HF."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_greedy_match, hf_greedy, _hf_model
from minfer import LLM, SamplingParams
from minfer.eval_ppl import evaluate_perplexity, text_windows
from minfer.llm import builtin_model_path
from minfer.train.corpus import heldout_files

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\nimport sys\n\n",
           "for i in range(10):"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(num_kv_blocks=64, max_model_len=512)


def test_builtin_model_is_shipped_and_small():
    path = builtin_model_path()
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    assert sum(f.stat().st_size for f in path.iterdir()) <= 16 * 2**20


def test_greedy_matches_hf(llm):
    for prompt in PROMPTS:
        out = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)[0]
        ref, ref_logits = hf_greedy(builtin_model_path(), out.prompt_token_ids, 24)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
    text = llm.generate(PROMPTS[0], SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0].outputs[0].text
    assert "return" in text or "\n    " in text  # Python-shaped


def test_eval_ppl_on_heldout_files_agrees_with_hf(llm):
    files = [f for f in heldout_files() if f.parent.name == "json" and f.name in ("scanner.py", "tool.py")]
    if len(files) != 2:  # the held-out packages belong to the stdlib of the running interpreter
        pytest.fail(f"held-out files not found in this interpreter's stdlib: {heldout_files()[:3]}")
    result = evaluate_perplexity(llm, files, window=256)
    model = _hf_model(builtin_model_path())
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in text_windows(llm, files, 256):
            lp = model(torch.tensor([w])).logits[0].float().log_softmax(-1)
            nll -= float(lp[torch.arange(len(w) - 1), torch.tensor(w[1:])].sum())
            count += len(w) - 1
    hf_ppl = math.exp(nll / count)
    assert abs(result.perplexity / hf_ppl - 1) < 0.005
    assert 1.5 < result.perplexity < 40  # a trained model, not noise (ln 4096 = 8.3 nats is chance)
