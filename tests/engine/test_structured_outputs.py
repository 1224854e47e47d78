"""Structured outputs end to end on the CPU, on the built-in model (a real byte-level BPE tokenizer, weights
trained on Python code, not on JSON): whatever the model prefers, every output must take the requested shape.

JSON outputs are checked by ``json.loads`` and ``jsonschema`` (formats included), regexes by ``re.fullmatch``,
EBNF grammars by an independent check (a regex of the same language, or xgrammar's matcher fed the output's
token ids). The schemas bound their outputs' length (``maxLength``, ``maxItems``, integer ranges) so that every
sample ends by its grammar, with finish_reason "stop", within ``max_tokens``. One engine is shared by the
module; the tests that need other engine settings (a tiny KV cache, sync scheduling) build a second one.
"""
from __future__ import annotations

import json
import re
import threading
import uuid

import jsonschema
import pytest
import xgrammar

from minfer import LLM, SamplingParams, StructuredOutputsParams
from minfer.engine import grammar_worker

PROMPT = "data = "
FORMATS = jsonschema.FormatChecker()  # checks date, email, ipv4, ipv6, uuid (date-time needs an extra package)

_INT = {"type": "integer", "minimum": -1000, "maximum": 1000}
_NAME = {"type": "string", "minLength": 1, "maxLength": 12}
_POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                           "y": {"type": "integer", "minimum": -9, "maximum": 9}},
          "required": ["x", "y"], "additionalProperties": False}

SCHEMAS: dict[str, dict] = {
    "flat object": {"type": "object", "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0,
                                                                            "maximum": 120}},
                    "required": ["name", "age"], "additionalProperties": False},
    "nested objects": {"type": "object", "additionalProperties": False, "required": ["user"], "properties": {
        "user": {"type": "object", "additionalProperties": False, "required": ["id", "address"], "properties": {
            "id": _INT,
            "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                        "properties": {"city": {"type": "string", "maxLength": 16},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}},
    "array min/maxItems": {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50},
                           "minItems": 2, "maxItems": 5},
    "array of objects": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "additionalProperties": False, "required": ["id", "kind"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                       "kind": {"enum": ["a", "b", "c"]}}}},
    "string enum": {"enum": ["red", "green", "blue"]},
    "mixed enum": {"enum": [1, "two", None, True, {"k": [3]}]},
    "const": {"type": "object", "additionalProperties": False, "required": ["version", "ok"],
              "properties": {"version": {"const": "1.0"}, "ok": {"const": True}}},
    "integer range": {"type": "integer", "minimum": -5, "maximum": 250},
    "integer exclusive bounds": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
    "integer multipleOf": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
    "number bounds": {"type": "object", "additionalProperties": False, "required": ["p", "t"], "properties": {
        "p": {"type": "number", "minimum": 0, "maximum": 1},
        "t": {"type": "number", "exclusiveMinimum": -40, "exclusiveMaximum": 60}}},
    "string min/maxLength": {"type": "string", "minLength": 3, "maxLength": 8},
    "string pattern": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
    "formats date and uuid": {"type": "object", "additionalProperties": False, "required": ["d", "u"],
                              "properties": {"d": {"type": "string", "format": "date"},
                                             "u": {"type": "string", "format": "uuid"}}},
    "required and optional": {"type": "object", "additionalProperties": False, "required": ["id"],
                              "properties": {"id": _INT, "note": {"type": "string", "maxLength": 10},
                                             "flag": {"type": "boolean"}}},
    "booleans and null": {"type": "object", "additionalProperties": False, "required": ["a", "b", "n"],
                          "properties": {"a": {"type": "boolean"}, "b": {"type": "boolean"},
                                         "n": {"type": "null"}}},
    "type list": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
    "anyOf": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "maxLength": 5},
                        {"type": "null"}]},
    "oneOf (disjoint)": {"oneOf": [
        {"type": "object", "additionalProperties": False, "required": ["kind", "r"],
         "properties": {"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 10}}},
        {"type": "object", "additionalProperties": False, "required": ["kind", "side"],
         "properties": {"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1, "maximum": 10}}}]},
    "$ref and $defs": {"$defs": {"point": _POINT}, "type": "object", "additionalProperties": False,
                       "required": ["a", "b"], "properties": {"a": {"$ref": "#/$defs/point"},
                                                              "b": {"$ref": "#/$defs/point"}}},
    "tree of depth 3 ($defs chain)": {
        "$defs": {"leaf": {"type": "object", "additionalProperties": False, "required": ["v"],
                           "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}}},
                  "mid": {"type": "object", "additionalProperties": False, "required": ["v", "kids"],
                          "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "kids": {"type": "array", "items": {"$ref": "#/$defs/leaf"},
                                                  "maxItems": 2}}}},
        "type": "object", "additionalProperties": False, "required": ["v", "kids"],
        "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                       "kids": {"type": "array", "items": {"$ref": "#/$defs/mid"}, "maxItems": 2}}},
    "tuple (prefixItems)": {"type": "array", "prefixItems": [{"type": "string", "maxLength": 5},
                                                             {"type": "integer", "minimum": 0, "maximum": 9},
                                                             {"type": "boolean"}], "items": False},
    "map (additionalProperties schema)": {"type": "object", "propertyNames": {"pattern": "^[a-z]{1,6}$"},
                                          "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "minProperties": 1, "maxProperties": 3},
    "annotations": {"title": "T", "description": "annotations constrain nothing", "type": "object",
                    "additionalProperties": False, "required": ["k"],
                    "properties": {"k": {"type": "string", "maxLength": 6, "description": "a key",
                                         "examples": ["abc"]}}},
}
# A recursive schema: maxItems bounds the breadth, nothing the depth (greedy decoding of this model nests
# forever), so only sampled outputs are asked for; see test_recursive_schema.
TREE = {"$defs": {"node": {"type": "object", "additionalProperties": False, "required": ["v", "kids"],
                           "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
                                                   "maxItems": 2}}}},
        "$ref": "#/$defs/node"}

SMALL = {"type": "object", "additionalProperties": False, "required": ["id", "tag"],
         "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                        "tag": {"type": "string", "minLength": 1, "maxLength": 10}}}


@pytest.fixture(scope="module")
def llm() -> LLM:
    engine = LLM(num_kv_blocks=512)  # the built-in model; async scheduling and prefix caching on (defaults)
    yield engine
    engine.llm_engine.shutdown()


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def check_json(text: str, schema: dict) -> object:
    value = json.loads(text)
    jsonschema.validate(value, schema, cls=jsonschema.Draft202012Validator, format_checker=FORMATS)
    return value


def assert_stopped_and_valid(outputs, schemas, labels) -> None:
    for out, schema, label in zip(outputs, schemas, labels):
        for c in out.outputs:
            assert c.finish_reason == "stop", f"{label}: {c.finish_reason} after {len(c.token_ids)} tokens: {c.text!r}"
            try:
                check_json(c.text, schema)
            except (ValueError, jsonschema.ValidationError) as exc:
                raise AssertionError(f"{label}: {c.text!r} does not fit: {exc}") from None


# ------------------------------------------------------------------------------------------- construction

@pytest.mark.parametrize("kwargs, field", [
    (dict(json={"type": "integer"}, regex="[0-9]+"), "structured_outputs"),
    (dict(choice=["a"], grammar='root ::= "a"'), "structured_outputs"),
    (dict(), "structured_outputs"),
    (dict(json={"type": "foo"}), "structured_outputs.json"),
    (dict(json='{"type": "object",'), "structured_outputs.json"),
    (dict(json={"type": "array", "uniqueItems": True}), "structured_outputs.json"),
    (dict(json={"not": {"type": "string"}}), "structured_outputs.json"),
    (dict(json={"if": {"type": "string"}, "then": {"maxLength": 3}}), "structured_outputs.json"),
    (dict(json={"type": "string", "format": "credit-card"}), "structured_outputs.json"),
    (dict(json={"$ref": "#/$defs/missing"}), "structured_outputs.json"),
    (dict(regex="[a-z"), "structured_outputs.regex"),
    (dict(regex=""), "structured_outputs.regex"),
    (dict(grammar="root ::= ( 'a'"), "structured_outputs.grammar"),
    (dict(grammar="start ::= \"a\""), "structured_outputs.grammar"),  # no root rule
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice=["a", ""]), "structured_outputs.choice"),
])
def test_invalid_constraints_fail_at_construction_naming_the_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams(**kwargs)
    assert str(info.value).startswith(field), str(info.value)
    if field == "structured_outputs":
        assert str(info.value).startswith("structured_outputs:")
    if "uniqueItems" in str(kwargs) or "not" in kwargs.get("json", {}):
        assert ("uniqueItems" if "uniqueItems" in str(kwargs) else "'not'") in str(info.value)


@pytest.mark.parametrize("schema, why", [
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "string"}}, "required": ["b"]}]},
     "xgrammar 0.2.9 drops an allOf of several schemas (the output may be any JSON)"),
    ({"type": "number", "multipleOf": 0.5}, "xgrammar ignores multipleOf on numbers"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 5}, "xgrammar ignores min/maxLength beside a pattern"),
    ({"type": "string", "format": "email", "maxLength": 20}, "xgrammar ignores min/maxLength beside a format"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]},
     "overlapping oneOf branches are enforced as anyOf: 3 fits both, so it breaks oneOf"),
    ({"$defs": {"p": {"type": "integer"}}, "$ref": "#/$defs/p", "maximum": 3}, "xgrammar ignores $ref's siblings"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]},
     "a required property that properties lacks can never be written (strict mode)"),
    ({"type": "string", "format": "ipv4"},
     "xgrammar's ipv4 allows leading zeros (this model writes \"80.04.3.0\"), which JSON Schema's ipv4 rejects"),
], ids=["allOf", "number multipleOf", "pattern+maxLength", "format+maxLength", "overlapping oneOf", "$ref siblings",
        "required not in properties", "format ipv4"])
def test_schemas_xgrammar_would_not_enforce_are_refused(schema, why):
    """xgrammar (0.2.9) compiles these but does not enforce all of them (it logs a warning, or not even that):
    an output that "followed" one could fail validation, so like uniqueItems they must be refused."""
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutputsParams(json=schema)
        pytest.fail(f"accepted, though {why}")


def test_sampling_params_takes_only_structured_outputs_params():
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {"type": "object"}})
    assert SamplingParams(structured_outputs=so(json_object=True)).structured_outputs.json_object


def test_a_resent_constraint_skips_the_check_and_a_bad_one_fails_every_time(monkeypatch):
    """The check is cached by key (a schema as a dict or as its text is the same key); a failure is not."""
    from minfer import structured_outputs

    calls = []
    real = structured_outputs._check_meta_schema
    monkeypatch.setattr(structured_outputs, "_check_meta_schema", lambda s: (calls.append(s), real(s))[1])
    schema = dict(SMALL, title=f"resent {uuid.uuid4()}")
    first, second = so(json=schema), so(json=json.dumps(schema))
    assert first.key == second.key and len(calls) == 1
    assert so(json=schema, disable_any_whitespace=True).key[0] == "json_compact" and len(calls) == 2
    bad = {"type": "array", "uniqueItems": True, "title": f"bad {uuid.uuid4()}"}
    for i in range(2):
        with pytest.raises(ValueError, match="structured_outputs.json: the keyword 'uniqueItems'"):
            so(json=bad)
        assert len(calls) == 3 + i


def test_min_tokens_of_constrained_rows_only_skips_the_early_stop_pass():
    """A grammar decides when a constrained output ends, so its min_tokens asks the sampler for nothing."""
    import torch

    from minfer.engine.input_batch import SamplingMetadata

    constrained = SamplingParams(min_tokens=4, structured_outputs=so(json_object=True))
    plain = SamplingParams(min_tokens=4)
    def facts(ps):
        return SamplingMetadata.from_params(ps, [0] * len(ps), [0] * len(ps), torch.device("cpu")).rows

    assert not facts([constrained, constrained]).any_min_tokens
    assert facts([constrained, plain]).any_min_tokens


# ------------------------------------------------------------------------------------------------ outputs

def test_json_schemas_greedy_and_sampled(llm):
    """Every schema of SCHEMAS in one batch: greedy and sampled (temperature 1, seeded) with the default
    whitespace (up to MAX_WHITESPACE characters between tokens: this model writes a lot of it), and sampled
    compact (``disable_any_whitespace``)."""
    params, schemas, labels = [], [], []
    variants = (("greedy", False, dict(temperature=0)), ("sampled", False, dict(temperature=1.0, seed=11)),
                ("sampled, compact", True, dict(temperature=1.0, seed=12)))
    for name, schema in SCHEMAS.items():
        for variant, compact, kw in variants:
            constraint = so(json=schema, disable_any_whitespace=compact)
            params.append(SamplingParams(max_tokens=400, structured_outputs=constraint, **kw))
            schemas.append(schema)
            labels.append(f"{name} ({variant})")
    outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    assert_stopped_and_valid(outputs, schemas, labels)
    for out, p in zip(outputs, params):
        if p.structured_outputs.disable_any_whitespace:  # compact: no whitespace outside strings
            text = out.outputs[0].text
            assert json.dumps(json.loads(text), ensure_ascii=False) == text, text
    # the schema's text may come as JSON text too
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=64,
                                              structured_outputs=so(json=json.dumps(SMALL))), use_tqdm=False)
    assert_stopped_and_valid(out, [SMALL], ["schema as text"])


@pytest.fixture(scope="module")
def xgr_compiler(llm):
    """An xgrammar compiler of the engine's vocabulary, independent of the engine's: to check outputs."""
    tok = llm.get_tokenizer()
    info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=llm.llm_engine.model_config.vocab_size,
                                                   stop_token_ids=sorted(llm.llm_engine.eos_token_ids))
    return xgrammar.GrammarCompiler(info)


def accepted(compiled, token_ids: list[int], complete: bool) -> bool:
    """Whether xgrammar's matcher takes these tokens (and, if ``complete``, ends in an accepting state)."""
    matcher = xgrammar.GrammarMatcher(compiled)
    return all(matcher.accept_token(t) for t in token_ids) and (matcher.is_completed() or not complete)


def test_recursive_schema(llm, xgr_compiler):
    """Sampled trees: the ones that end are valid; the ones cut by max_tokens are a valid prefix."""
    from minfer.structured_grammar import MAX_WHITESPACE

    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=200,
                             structured_outputs=so(json=TREE, disable_any_whitespace=s % 2 == 1)) for s in range(6)]
    outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    ended = [o for o in outputs if o.outputs[0].finish_reason == "stop"]
    assert_stopped_and_valid(ended, [TREE] * len(ended), [f"tree {o.request_id}" for o in ended])
    assert len(ended) >= 3, [o.outputs[0].text for o in outputs]
    for out, p in zip(outputs, params):
        if out.outputs[0].finish_reason == "length":
            compact = p.structured_outputs.disable_any_whitespace
            compiled = xgr_compiler.compile_json_schema(json.dumps(TREE), any_whitespace=not compact,
                                                        max_whitespace_cnt=None if compact else MAX_WHITESPACE)
            assert accepted(compiled, out.outputs[0].token_ids, complete=False), out.outputs[0].text
    assert any(o.outputs[0].text.count('"v"') > 1 for o in outputs), "no sample nested at all"


def test_json_object_regex_choice(llm):
    regexes = [r"[A-Z][a-z]{2,8} [0-9]{1,3}", r"(\+|-)?[0-9]{1,4}\.[0-9]{2}", r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
               r"[a-z]{1,10}@[a-z]{1,8}\.(com|org|net)", r"(yes|no)(, (yes|no)){0,3}"]
    choices = [["yes", "no", "maybe"], ["def", "define", "default"], ["α", "β γ", "{\"json\": 1}"]]
    params = [SamplingParams(max_tokens=64, structured_outputs=so(regex=r), **kw)
              for r in regexes for kw in (dict(temperature=0), dict(temperature=1.0, seed=5))]
    params += [SamplingParams(max_tokens=32, structured_outputs=so(choice=c), **kw)
               for c in choices for kw in (dict(temperature=0), dict(temperature=1.0, seed=5))]
    outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for out, p in zip(outputs, params):
        c, s = out.outputs[0], p.structured_outputs
        assert c.finish_reason == "stop", (s, c.text)
        if s.regex is not None:
            assert re.fullmatch(s.regex, c.text), (s.regex, c.text)
        else:
            assert c.text in s.choice, (s.choice, c.text)


def test_a_masked_token_is_never_drawn_whatever_its_noise(llm):
    """The Gumbel draw adds -log(-log u) to each logit; a masked token's logit is -inf, so no noise value may
    bring it back. The test takes the (seed, token) with the largest u among 8,192 seeds' first draws (u is
    a pure function of the seed, the output index and the token id) and masks that token out: u rounding to
    1.0 in float32 makes the noise +inf, -inf + inf is NaN, and argmax picks a NaN."""
    import torch

    from minfer.engine.sampler import uniform_noise

    vocab = llm.llm_engine.model_config.vocab_size
    best = (0.0, 0, 0)
    for lo in range(0, 8192, 1024):
        seeds = torch.arange(lo, lo + 1024, dtype=torch.int64)
        u = uniform_noise(seeds, torch.zeros_like(seeds), vocab)
        top, col = u.max(-1)
        r = int(top.argmax())
        best = max(best, (float(top[r]), lo + r, int(col[r])))
    _, seed, token = best
    choices = ["yes", "no"]
    tok = llm.get_tokenizer()
    assert all(token not in tok.encode(c, add_special_tokens=False)[:1] for c in choices)
    (out,) = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=seed, max_tokens=8,
                                                 structured_outputs=so(choice=choices)), use_tqdm=False)
    assert out.outputs[0].text in choices, (best, out.outputs[0])


def test_json_object_is_an_object(llm):
    """json_object (OpenAI's response_format "json_object"): any JSON object, not any JSON value. Free-form
    JSON has no length bound and greedy decoding of this model repeats a key forever, so samples are asked for;
    the ones that end must parse to a dict, and most must end."""
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=160, structured_outputs=so(json_object=True))
              for s in range(6)]
    outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    ended = 0
    for out in outputs:
        c = out.outputs[0]
        assert c.text.lstrip().startswith("{"), c.text
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict), c.text
            ended += 1
    assert ended >= 3, [o.outputs[0].text for o in outputs]


ARITH = """root ::= expr
expr ::= term (("+" | "-") term){0,5}
term ::= factor (("*" | "/") factor){0,2}
factor ::= num | "(" num (("+" | "-") num){1,3} ")"
num ::= [1-9] [0-9]{0,2} | "0"
"""
_NUM = r"(?:[1-9][0-9]{0,2}|0)"
_FACTOR = rf"(?:{_NUM}|\({_NUM}(?:[-+]{_NUM}){{1,3}}\))"
_TERM = rf"{_FACTOR}(?:[*/]{_FACTOR}){{0,2}}"
ARITH_RE = rf"{_TERM}(?:[-+]{_TERM}){{0,5}}"

KEY_VALUES = r"""root ::= pair ("; " pair){0,3} "."
pair ::= key "=" value
key ::= [a-z] [a-z_]{0,7}
value ::= [0-9]{1,4} | "\"" [A-Za-z ]{0,10} "\"" | "true" | "false"
"""


def test_ebnf_grammars(llm, xgr_compiler):
    params = [SamplingParams(max_tokens=96, structured_outputs=so(grammar=g), **kw)
              for g in (ARITH, KEY_VALUES) for kw in (dict(temperature=0), dict(temperature=1.0, seed=3),
                                                      dict(temperature=1.0, seed=4))]
    outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    for out, p in zip(outputs, params):
        c, grammar = out.outputs[0], p.structured_outputs.grammar
        assert c.finish_reason == "stop", c.text
        if grammar == ARITH:  # an independent check: a regex of the same (bounded) language
            assert re.fullmatch(ARITH_RE, c.text), c.text
        assert accepted(xgr_compiler.compile_grammar(grammar), c.token_ids, complete=True), c.text


# ------------------------------------------------------------------------------------- with other features

def test_batch_with_unconstrained_requests_leaves_them_unchanged(llm):
    """Constrained and unconstrained requests share steps; the unconstrained ones decode exactly as alone."""
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:", PROMPT]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    params, ps = [], []
    for p in prompts:
        params += [plain, SamplingParams(temperature=0, max_tokens=128, structured_outputs=so(json=SMALL))]
        ps += [p, p]
    mixed = llm.generate(ps, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[::2]] == alone
    assert_stopped_and_valid(mixed[1::2], [SMALL] * len(prompts), prompts)


def test_n_samples_each_follow_the_grammar(llm):
    p = SamplingParams(n=2, temperature=1.0, seed=21, max_tokens=128, structured_outputs=so(json=SMALL))
    (out,) = llm.generate(PROMPT, p, use_tqdm=False)
    assert len(out.outputs) == 2
    assert_stopped_and_valid([out], [SMALL], ["n=2"])
    assert out.outputs[0].text != out.outputs[1].text  # seed 21: two different samples
    again = llm.generate(PROMPT, p, use_tqdm=False)[0]
    assert [c.text for c in again.outputs] == [c.text for c in out.outputs]  # seeded: reproducible


def test_stop_strings_cut_a_constrained_output(llm):
    p = SamplingParams(temperature=1.0, seed=2, max_tokens=64, stop=["X"],
                       structured_outputs=so(regex=r"[a-z]{5,10}X[a-z]{3}"))
    (out,) = llm.generate(PROMPT, p, use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "X" and re.fullmatch(r"[a-z]{5,10}", c.text), c


def test_penalties_with_a_schema(llm):
    schema = SCHEMAS["nested objects"]
    params = [SamplingParams(temperature=t, seed=8, max_tokens=200, repetition_penalty=1.3, frequency_penalty=0.5,
                             structured_outputs=so(json=schema)) for t in (0, 1.0)]
    outputs = llm.generate([PROMPT] * 2, params, use_tqdm=False)
    assert_stopped_and_valid(outputs, [schema] * 2, ["penalties greedy", "penalties sampled"])


def test_prefix_caching_with_repeated_prompts(llm):
    prompt = "def parse(config):\n    " * 6  # several full blocks
    p = SamplingParams(temperature=0, max_tokens=128, structured_outputs=so(json=SMALL))
    first = llm.generate([prompt] * 2, p, use_tqdm=False)
    hits = llm.get_stats()["prefix_cache_hit_tokens"]
    second = llm.generate([prompt] * 2, p, use_tqdm=False)
    assert llm.get_stats()["prefix_cache_hit_tokens"] > hits
    assert_stopped_and_valid(first + second, [SMALL] * 4, ["first", "first", "cached", "cached"])
    assert len({o.outputs[0].text for o in first + second}) == 1


def test_compiled_grammars_are_cached(llm):
    """``grammar_compile_seconds`` counts compiles: a constraint seen before (the same key) costs none."""
    schema = dict(SMALL, title=f"unique {uuid.uuid4()}")  # a key this engine has never compiled
    count = lambda: llm.get_stats()["grammar_compile_seconds"]["count"]  # noqa: E731
    p = SamplingParams(temperature=0, max_tokens=64, structured_outputs=so(json=schema))
    before = count()
    llm.generate([PROMPT] * 2, p, use_tqdm=False)  # two requests, one compile
    assert count() == before + 1
    llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=1, max_tokens=64,
                                        structured_outputs=so(json=json.dumps(schema))), use_tqdm=False)
    assert count() == before + 1
    stats = llm.get_stats()["grammar_compile_seconds"]
    assert stats["buckets"][-1][1] == stats["count"] and stats["sum"] > 0
    assert llm.get_stats()["num_constrained_running"] == 0


def test_a_slow_compile_does_not_hold_up_other_requests(llm, monkeypatch):
    """A constrained request waits for its grammar outside the scheduler: an unconstrained request added after
    it runs to its end meanwhile. The compiled grammar is held on a gate before it reaches the engine (not a
    timing guess): it is released only once the unconstrained request has finished, and the constrained one
    then completes validly."""
    gate = threading.Event()
    real = grammar_worker.CompilerPool._load

    def gated(self, *args, **kwargs):
        if not gate.wait(timeout=60):
            raise TimeoutError("the gate was never opened")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(grammar_worker.CompilerPool, "_load", gated)
    engine = llm.llm_engine
    schema = dict(SMALL, title=f"slow {uuid.uuid4()}")
    try:
        engine.add_request("slow", PROMPT, SamplingParams(temperature=0, max_tokens=64,
                                                          structured_outputs=so(json=schema)))
        engine.add_request("plain", "def f(x):", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        finished: dict[str, object] = {}
        for _ in range(200):
            finished |= {o.request_id: o for o in engine.step() if o.finished}
            if "plain" in finished:
                break
        assert "plain" in finished and "slow" not in finished
        assert len(finished["plain"].outputs[0].token_ids) == 12
        assert engine.get_stats()["num_grammars_compiling"] == 1  # the slow one: never scheduled yet
    finally:
        gate.set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert_stopped_and_valid([finished["slow"]], [schema], ["slow"])


def test_abort_while_compiling(llm, monkeypatch):
    gate = threading.Event()
    real = grammar_worker.CompilerPool._load
    monkeypatch.setattr(grammar_worker.CompilerPool, "_load",
                        lambda self, *a, **k: (gate.wait(60), real(self, *a, **k))[1])
    engine = llm.llm_engine
    try:
        engine.add_request("doomed", PROMPT, SamplingParams(max_tokens=8, structured_outputs=so(
            json=dict(SMALL, title=f"abort {uuid.uuid4()}"))))
        engine.abort_request("doomed")
        assert not engine.has_unfinished_requests() and engine.get_stats()["num_grammars_compiling"] == 0
    finally:
        gate.set()
    assert engine.step() == []


@pytest.fixture(scope="module")
def small_cache_sync_llm() -> LLM:
    """A KV cache of 12 blocks (192 tokens) and sync scheduling: preemption and the non-async step path."""
    engine = LLM(num_kv_blocks=12, async_scheduling=False, max_num_seqs=8)
    yield engine
    engine.llm_engine.shutdown()


def test_preemption_and_sync_scheduling(small_cache_sync_llm):
    llm = small_cache_sync_llm
    schema = SCHEMAS["array of objects"]
    constraint = so(json=schema, disable_any_whitespace=True)
    llm.generate("x", SamplingParams(max_tokens=1, structured_outputs=constraint), use_tqdm=False)  # compiled now
    # Three plain requests of 76 tokens need 15 blocks of the 12 whatever the constrained ones do (a compile
    # no longer pending, those run beside them from the first step): something is preempted.
    params = [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True) for _ in range(3)]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=120, structured_outputs=constraint)
               for s in range(5)]
    prompts = [f"def handler_{i}(request, response):\n    " for i in range(len(params))]
    before = llm.get_stats()["num_preemptions"]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.get_stats()["num_preemptions"] > before, "the cache was large enough: nothing was preempted"
    assert all(len(o.outputs[0].token_ids) == 64 for o in outputs[:3])
    assert_stopped_and_valid(outputs[3:], [schema] * 5, [f"seed {s}" for s in range(5)])


# ------------------------------------------------------------------------- strict JSON, emptiness, limits

def _accepts(schema: dict, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    from minfer.structured_grammar import build_grammar
    return _is_grammar_accept_string(build_grammar(*so(json=schema, disable_any_whitespace=True).key), text)


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "string", "maxLength": 3}, ['"a\\"b"', '"\\n\\t\\\\"', '"\\u00e9x"', '"日本語"', '""'],
     ['"a\x01"', '"\t"', '"a\\"bc"', '"\\ud800"', '"abcd"']),
    ({"type": "string", "minLength": 2}, ['"\\n\\u0001"', '"ab"'], ['"a"', '"\x1b\x1b"', '"\\n"']),
    ({"type": "string", "pattern": '^a"b$'}, ['"a\\"b"'], ['"a"b"']),
    ({"type": "string", "pattern": "^[\\x00-\\x1f]+$"}, ['"\\u0001\\n"'], ['"\x01"', '"\n"']),
    ({"type": "string", "pattern": "^a.b$"}, ['"a\\\\b"', '"a\\tb"'], ['"a\\nb"', '"a\nb"']),  # re's . is not \n
    ({"type": "string", "pattern": "^\\Wx$"}, ['"!x"'], ['"éx"']),  # é is a word character to re
    ({"type": "object", "propertyNames": {"maxLength": 2}, "additionalProperties": {"type": "integer"}},
     ['{"\\n": 1}'], ['{"\x01": 1}']),
    ({"type": "object", "patternProperties": {"^\\s$": {"type": "integer"}}}, ['{"\\t": 1}', '{" ": 1}'],
     ['{"\t": 1}']),
], ids=["maxLength", "minLength", "pattern quote", "pattern controls", "pattern dot", "pattern \\W",
        "propertyNames", "patternProperties"])
def test_string_rules_write_strict_json_only(schema, good, bad):
    """xgrammar 0.2.9 writes a bounded string as raw characters but '"', '\\', CR and LF (control characters
    in, escapes out) and a pattern's quotes, backslashes and control characters raw: every one of ``bad``
    was accepted before the grammar was mended. An escape is one character of maxLength."""
    for text in good:
        assert _accepts(schema, text), text
        assert "pattern" not in schema or re.fullmatch(schema["pattern"], json.loads(text))
    for text in bad:
        assert not _accepts(schema, text), text


@pytest.mark.parametrize("kwargs, field", [
    (dict(grammar="root ::= [^\\x00-\\U0010ffff]"), "structured_outputs.grammar"),
    (dict(grammar="root ::= root"), "structured_outputs.grammar"),
    (dict(grammar='root ::= a "x"\na ::= b\nb ::= a | "(" a ")"'), "structured_outputs.grammar"),
    (dict(grammar='root ::= "x" | y\ny ::= Regex("[^\\\\s\\\\S]") "y"'), None),  # "x" is derivable
    (dict(regex="[^\\s\\S]"), "structured_outputs.regex"),
    (dict(regex="a[^\\s\\S]+b"), "structured_outputs.regex"),
    (dict(json={"type": "string", "pattern": "^[^\\s\\S]$"}), "structured_outputs.json"),
    (dict(json={"type": "object", "properties": {"a": False}, "required": ["a"]}), "structured_outputs.json"),
])
def test_an_empty_language_is_refused(kwargs, field):
    if field is None:
        so(**kwargs)
        return
    with pytest.raises(ValueError, match=f"^{re.escape(field)}: .*(empty|no string|no value|any value)"):
        so(**kwargs)


@pytest.mark.parametrize("ref", ["http://example.com/s.json", "https://example.com/s.json#/$defs/a",
                                 "file:///etc/passwd", "other.json", "#anchor"])
def test_a_ref_outside_the_schema_is_refused(ref):
    with pytest.raises(ValueError, match=f"^structured_outputs.json: the \\$ref {re.escape(repr(ref))}"):
        so(json={"type": "object", "properties": {"a": {"$ref": ref}}})


def _chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def _nested(n: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema


OVER_LIMITS = [  # (a constraint just past one default limit, the flag its refusal names)
    (dict(json=_chain(5_000)), "max-depth"),  # (10,000 links killed the process in xgrammar, SIGSEGV)
    (dict(json=_chain(10_000)), "max-nodes"),
    (dict(json=_nested(150)), "max-depth"),  # jsonschema's meta-schema check raised RecursionError
    (dict(json={"type": "object", "properties": {"a": {"enum": list(range(6000))},
                                                 "b": {"enum": list(range(6000))}}}), "max-enum-entries"),
    (dict(json={"type": "object", "properties": {f"p{i}": {"type": "array"} for i in range(11_000)}}),
     "max-nodes"),
    (dict(json={"type": "string", "description": "x" * (1 << 20)}), "max-bytes"),
    (dict(grammar="root ::= r0\n" + "\n".join(f"r{i} ::= \"{i}\" | r{i + 1}" for i in range(6000)) +
          '\nr6000 ::= "e"'), "max-rules"),
    (dict(regex="a" * 10_001), "max-regex-length"),
    (dict(json={"type": "string", "pattern": "b" * 10_001}), "max-regex-length"),
    (dict(regex="(" * 70 + ")" * 70), "max-depth"),
]


@pytest.mark.parametrize("kwargs, flag", OVER_LIMITS, ids=[f for _, f in OVER_LIMITS])
def test_limits_refuse_before_jsonschema_or_xgrammar(kwargs, flag):
    """Past a default limit, construction defers (the engine's limits may be higher) and the check against
    the defaults refuses, naming the limit and its flag, before jsonschema or xgrammar reads the input."""
    from minfer.structured_limits import DEFAULT_LIMITS

    params = so(**kwargs)
    with pytest.raises(ValueError, match=f"over the limit of .*--structured-outputs-{flag}"):
        params.check(DEFAULT_LIMITS)


def test_the_engines_limits_decide(monkeypatch):
    """The Processor checks with the engine's limits: a raised limit admits what the default refuses, a lowered
    one refuses what the default admits; a server-built constraint's refusal names the request's field."""
    from minfer.engine.processor import Processor, PromptError
    from minfer.structured_limits import StructuredOutputsLimits

    def processor(**limits) -> Processor:
        return Processor(None, 320, 64, 16, 16, structured_outputs_limits=StructuredOutputsLimits(**limits))

    deep = so(json=_nested(80))
    with pytest.raises(ValueError, match="--structured-outputs-max-depth"):
        processor().check_params(SamplingParams(structured_outputs=deep))
    processor(max_depth=100).check_params(SamplingParams(structured_outputs=deep))
    small = so(json=_nested(10))
    with pytest.raises(ValueError, match="--structured-outputs-max-depth"):
        processor(max_depth=5).check_params(SamplingParams(structured_outputs=small))
    small.source = "response_format.json_schema.schema"
    with pytest.raises(PromptError, match="^response_format.json_schema.schema: the nesting depth") as info:
        processor(max_depth=5).check_params(SamplingParams(structured_outputs=small))
    assert info.value.field == "response_format.json_schema.schema"


def test_engine_config_carries_the_limits():
    import argparse

    from minfer.config import EngineConfig
    from minfer.engine_args import add_engine_args

    assert EngineConfig(structured_outputs_max_depth=100).structured_outputs_limits().max_depth == 100
    with pytest.raises(ValueError, match="structured_outputs_max_rules must be an integer >= 1"):
        EngineConfig(structured_outputs_max_rules=0)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args(["--structured-outputs-max-enum-entries", "7"]).structured_outputs_max_enum_entries == 7


def test_inputs_nested_past_pythons_recursion_are_an_error_not_a_crash():
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ValueError, match="structured_outputs.json"):
        so(json='{"enum": ' + deep + "}")
    with pytest.raises(ValueError, match="structured_outputs.grammar: the nesting depth"):
        so(grammar="root ::= " + "(" * 5000 + '"a"' + ")" * 5000).check()


def test_the_engine_refuses_a_constraint_past_its_limits(llm):
    with pytest.raises(ValueError, match="--structured-outputs-max-depth"):
        llm.generate(PROMPT, SamplingParams(max_tokens=4, structured_outputs=so(json=_chain(100))), use_tqdm=False)
