"""Every finished constrained output parses with a strict ``json.loads`` and validates with ``jsonschema``
(formats asserted), over a corpus of schemas (``structured_corpus``) sampled at temperature 1 on the
built-in model, several seeds each, in one batch."""
from __future__ import annotations

import json

import jsonschema
import pytest

from minfer import LLM, SamplingParams, StructuredOutputsParams

from structured_corpus import corpus  # tests/engine is on the path (pytest prepends it)

SEEDS = (0, 1, 2)


@pytest.fixture(scope="module")
def llm() -> LLM:
    engine = LLM(num_kv_blocks=1024, max_num_seqs=512, max_num_batched_tokens=4096)
    yield engine
    engine.llm_engine.shutdown()


def invalid(text: str, schema: dict) -> str | None:
    """Why ``text`` is not a strict-JSON instance of ``schema`` (None when it is)."""
    try:
        value = json.loads(text)  # strict: a raw control character in a string is an error
    except ValueError as exc:
        return f"json.loads: {exc}"
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    return None if error is None else f"jsonschema: {error.message}"


def test_corpus_outputs_parse_strictly_and_validate(llm: LLM) -> None:
    schemas = corpus()
    assert len(schemas) >= 100
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for schema in schemas for seed in SEEDS]
    outputs = llm.generate(["{"] * len(params), params, use_tqdm=False)
    finished, bad = 0, []
    for i, out in enumerate(outputs):
        sample = out.outputs[0]
        if sample.finish_reason != "stop":
            continue
        finished += 1
        why = invalid(sample.text, schemas[i // len(SEEDS)])
        if why is not None:
            bad.append((schemas[i // len(SEEDS)], sample.text, why))
    assert not bad, f"{len(bad)} of {finished} finished outputs are not valid: {bad[:5]}"
    assert finished >= len(params) // 2, f"only {finished} of {len(params)} finished within max_tokens"
