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


def _gated_run(llm: LLM, params: SamplingParams, gate: tuple[int, ...] | None) -> list[int]:
    """One request through the engine with its structured output waiting for the tokens ``gate``."""
    engine = llm.llm_engine
    request = engine.processor.process("gated", {"prompt_token_ids": [5, 17, 42, 9]}, params)
    request.grammar_after = gate
    engine.add_processed_request(request)
    out = None
    while engine.has_unfinished_requests():
        out = next((o for o in engine.step() if o.finished), out)
    return out.outputs[0].token_ids


def test_structured_output_waits_for_the_end_of_reasoning(llm: LLM) -> None:
    """The grammar holds from the gate token on (the reasoning's end), and not before: the first token here is
    the model's own unconstrained choice, the gate; after it the output is one of the choices. A gate the model
    never samples leaves the whole output unconstrained (reasoning cut by max_tokens)."""
    free = llm.generate({"prompt_token_ids": [5, 17, 42, 9]}, SamplingParams(max_tokens=6, temperature=0,
                                                                             ignore_eos=True), use_tqdm=False)
    free_ids = free[0].outputs[0].token_ids
    choice = SamplingParams(max_tokens=20, temperature=0,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    tok = llm.get_tokenizer()
    gated = _gated_run(llm, choice, (free_ids[0],))
    assert gated[0] == free_ids[0] and tok.decode(gated[1:], skip_special_tokens=True) in ("yes", "no")
    assert tok.decode(_gated_run(llm, choice, None), skip_special_tokens=True) in ("yes", "no")
    # a marker of several tokens (harmony's final-channel header): the grammar waits for all of them in a row
    two = _gated_run(llm, choice, (free_ids[0], free_ids[1]))
    assert two[:2] == free_ids[:2] and tok.decode(two[2:], skip_special_tokens=True) in ("yes", "no")
    never = next(t for t in range(2, 300) if t not in free_ids)
    capped = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert _gated_run(llm, capped, (never,)) == free_ids
    assert _gated_run(llm, capped, (free_ids[0], never)) == free_ids  # its first token alone opens nothing


def test_grammar_gate_reads_the_prompt() -> None:
    from minfer.reasoning import grammar_gate

    class Tok:
        unk_token_id = 0
        ids = {"<think>": 7, "</think>": 8}

        def convert_tokens_to_ids(self, token: str) -> int:
            return self.ids.get(token, 0)

    assert grammar_gate(Tok(), [1, 2, 3]) == (8,)  # the model is to think first
    assert grammar_gate(Tok(), [1, 7, 3]) == (8,)  # the prompt opened the thinking (deepseek_r1)
    assert grammar_gate(Tok(), [1, 7, 8, 3]) is None  # the template closed it (thinking disabled)
    assert grammar_gate(Tok(), [7, 8, 5, 7, 2]) == (8,)  # a later turn opened it again
    Tok.ids = {"<|channel|>": 20, "<|message|>": 21}
    Tok.encode = lambda self, text, add_special_tokens: [30, 31] if text == "final" else []
    assert grammar_gate(Tok(), [1, 2], "gpt_oss") == (20, 30, 31, 21)  # harmony: after the final channel's header
    assert grammar_gate(Tok(), [1, 20, 30, 31, 21], "gpt_oss") is None  # the prompt opened the final channel
    Tok.ids = {}
    assert grammar_gate(Tok(), [1, 2]) is None  # no such single tokens: the grammar holds from the start
    assert grammar_gate(Tok(), [1, 2], "gpt_oss") is None
