"""``LLM.chat(..., reasoning_parser=...)``: each completion's ``<think>`` text in ``reasoning_content`` and the
answer alone in ``text``; the tiny random model's output is forced by a regex, so the split is known exactly."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_checkpoint
from minfer import LLM, SamplingParams
from minfer.structured_outputs import StructuredOutputsParams

TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
MESSAGES = [{"role": "user", "content": "2 + 2?"}]


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path: Path = make_checkpoint(tmp_path_factory.mktemp("reasoning") / "llama3", "llama3")
    with LLM(str(path), num_kv_blocks=64) as llm:
        yield llm


def _forced(regex: str, max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=1, structured_outputs=StructuredOutputsParams(regex=regex))


def test_chat_splits_reasoning(llm: LLM) -> None:
    params = _forced(r"<think>Two and two\.</think>Four\.")
    out = llm.chat(MESSAGES, params, use_tqdm=False, chat_template=TEMPLATE, reasoning_parser="qwen3")[0].outputs[0]
    assert (out.reasoning_content, out.text) == ("Two and two.", "Four.")
    plain = llm.chat(MESSAGES, params, use_tqdm=False, chat_template=TEMPLATE)[0].outputs[0]
    assert (plain.reasoning_content, plain.text) == (None, "<think>Two and two.</think>Four.")  # no parser: as is
    r1 = llm.chat(MESSAGES, _forced(r"Opened by the prompt\.</think>Four\."), use_tqdm=False, chat_template=TEMPLATE,
                  reasoning_parser="deepseek_r1")[0].outputs[0]
    assert (r1.reasoning_content, r1.text) == ("Opened by the prompt.", "Four.")


def test_unterminated_reasoning_and_an_unknown_parser(llm: LLM) -> None:
    out = llm.chat(MESSAGES, _forced("<think>a{300}", max_tokens=8), use_tqdm=False, chat_template=TEMPLATE,
                   reasoning_parser="qwen3")[0].outputs[0]
    assert out.finish_reason == "length" and out.text == "" and set(out.reasoning_content or "x") == {"a"}
    with pytest.raises(ValueError, match="reasoning_parser: 'granite' is not one of qwen3, deepseek_r1"):
        llm.chat(MESSAGES, chat_template=TEMPLATE, reasoning_parser="granite")
    assert llm.get_stats()["num_waiting"] == 0  # refused before anything was queued
