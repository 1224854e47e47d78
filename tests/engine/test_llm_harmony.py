"""``LLM.chat(..., reasoning_parser="gpt_oss")`` on a tiny checkpoint with harmony's special tokens and gpt-oss's
chat template, its output scripted as token ids: the analysis channel in ``reasoning_content``, the final answer in
``text``, no marker in either (the completion is decoded with the markers kept for the parser, whatever the
SamplingParams say, and the caller's SamplingParams are left alone); tools and ``chat_template_kwargs`` reach the
template."""
from __future__ import annotations

from pathlib import Path

import pytest

from harmony_fixtures import MARKERS, ScriptedSampler, harmony_checkpoint
from minfer import LLM, SamplingParams

ANSWER = ("<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>Four."
          "<|return|>")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path: Path = harmony_checkpoint(tmp_path_factory.mktemp("harmony") / "gpt-oss-like")
    with LLM(str(path), num_kv_blocks=128) as llm:
        llm.llm_engine.runner.sampler = ScriptedSampler(llm.llm_engine.runner.sampler)
        llm.llm_engine.runner.sampler.script = llm.get_tokenizer().encode(ANSWER, add_special_tokens=False)
        yield llm


def test_chat_splits_harmony(llm: LLM) -> None:
    params = SamplingParams(max_tokens=100)
    (out,) = llm.chat([{"role": "user", "content": "2 + 2?"}], params, use_tqdm=False, tools=[WEATHER],
                      reasoning_parser="gpt_oss", chat_template_kwargs={"reasoning_effort": "low"})
    c = out.outputs[0]
    assert (c.reasoning_content, c.text, c.finish_reason) == ("Two and two.", "Four.", "stop")
    assert params.skip_special_tokens  # the caller's params are not changed
    assert "Reasoning: low" in out.prompt and "type get_weather = (_: {\ncity?: string,\n}) => any;" in out.prompt
    assert out.prompt.endswith("<|start|>user<|message|>2 + 2?<|end|><|start|>assistant")


def test_chat_without_a_parser_decodes_as_asked(llm: LLM) -> None:
    (plain,) = llm.chat([{"role": "user", "content": "2 + 2?"}], SamplingParams(max_tokens=100), use_tqdm=False)
    assert plain.outputs[0].reasoning_content is None
    assert plain.outputs[0].text == "analysisTwo and two.assistantfinalFour."  # markers skipped, as by default
    # no SamplingParams: the defaults (max_tokens 16) cut it while it reasons: all reasoning, no answer
    (default,) = llm.chat([{"role": "user", "content": "2 + 2?"}], use_tqdm=False, reasoning_parser="gpt_oss")
    c = default.outputs[0]
    assert (c.text, c.finish_reason) == ("", "length") and "Two and two.".startswith(c.reasoning_content)
    assert not any(m in c.reasoning_content for m in MARKERS)
