"""StructuredOutputsParams: the shape a request's output must take (vLLM's names), checked at construction.

The engine forces the output through xgrammar (``minfer.engine.grammar``); this module decides whether a
request's constraint is acceptable, so a bad one is an error naming its field before it is queued, and
builds its xgrammar ``Grammar`` (``build_grammar``: the same one for that check and the engine's compile).
xgrammar compiles JSON Schema by itself but silently ignores keywords it does not implement
(``uniqueItems``, ``not``, ``if``/``then``/``else``, unknown ``format`` values, ...): an output that
"followed" such a schema could still fail to validate, so those are refused here, by an allow-list.
"""
from __future__ import annotations

import functools
import json as jsonlib
from dataclasses import dataclass, field
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_WHITESPACE = 16  # characters of whitespace in a row that JSON output may carry (room for indentation)
CHECK_CACHE_SIZE = 256  # constraints whose check passed, kept so that a resent one skips it

# Keywords whose meaning xgrammar's JSON-Schema converter implements, and annotations that constrain nothing.
_SUPPORTED_KEYWORDS = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
    "minProperties", "maxProperties", "items", "prefixItems", "minItems", "maxItems",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minLength", "maxLength", "pattern", "format",
})
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                          "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding"})
# (not ipv4: xgrammar's allows leading zeros, "80.04.3.0", which JSON Schema's does not)
_FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv6", "uri",
                      "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer"})
# keywords whose value is a schema, a list of schemas, or a name -> schema map
_SUB_SCHEMA = ("items", "additionalProperties", "propertyNames")
_SUB_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON Schema, as a dict or its JSON text), ``regex`` (the whole output
    matches it), ``choice`` (the output is one of these strings), ``grammar`` (an EBNF grammar in
    xgrammar's syntax, ``root ::= ...``), ``json_object=True`` (any JSON object).

    JSON may carry whitespace between tokens (at most ``MAX_WHITESPACE`` characters in a row: models,
    weak ones especially, can otherwise emit whitespace until ``max_tokens``); ``disable_any_whitespace``
    (vLLM's name) allows no free whitespace: only xgrammar's fixed separators ``", "`` and ``": "``.

    ``key`` (kind, canonical text) identifies the compiled grammar: requests with equal keys share one."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    key: tuple[str, str] = field(default=("", ""), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs: set exactly one of {', '.join(KINDS)} (got "
                             f"{', '.join(given) if given else 'none'})")
        kind = given[0]
        if kind == "json":
            self.key = ("json_compact" if self.disable_any_whitespace else "json", _schema_text(self.json))
        elif kind == "regex":
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError(f"structured_outputs.regex must be a non-empty string, got {self.regex!r}")
            self.key = ("regex", self.regex)
        elif kind == "choice":
            c = self.choice
            if not isinstance(c, (list, tuple)) or not c or not all(isinstance(s, str) and s for s in c):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {c!r}")
            self.choice = list(c)
            self.key = ("grammar", choice_grammar(self.choice))
        elif kind == "grammar":
            if not isinstance(self.grammar, str) or not self.grammar.strip():
                raise ValueError(f"structured_outputs.grammar must be a non-empty EBNF string, got {self.grammar!r}")
            self.key = ("grammar", self.grammar)
        else:
            if self.json_object is not True:
                raise ValueError(f"structured_outputs.json_object must be true or unset, got {self.json_object!r}")
            self.key = ("json_object", "")
        _check(kind, *self.key)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices`` (JSON string escapes are valid EBNF literals)."""
    return "root ::= " + " | ".join(jsonlib.dumps(c, ensure_ascii=False) for c in choices)


def _schema_text(schema: object) -> str:
    """The schema as compact JSON text (its canonical form: ``_check`` reads it back)."""
    if isinstance(schema, str):
        try:
            schema = jsonlib.loads(schema)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json: not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured_outputs.json must be a JSON Schema object, got {type(schema).__name__}")
    try:  # property order kept: it is the output's
        return jsonlib.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs.json: not valid JSON: {exc}") from None


@functools.lru_cache(maxsize=CHECK_CACHE_SIZE)
def _check(kind: str, grammar_kind: str, text: str) -> None:
    """Whether the constraint ``(grammar_kind, text)`` (``StructuredOutputsParams.key``; ``kind``, the field
    that set it, names it in errors) is one minfer can enforce: a schema must be valid JSON Schema whose every
    keyword xgrammar enforces, and the grammar must build (``_check_builds``). Cached: agents resend the same
    schema every turn. A failure raises each time (``lru_cache`` keeps results only)."""
    if grammar_kind in ("json", "json_compact"):
        schema = jsonlib.loads(text)
        _check_meta_schema(schema)
        if isinstance(schema, dict):
            _check_keywords(schema, "#")
    _check_builds(kind, grammar_kind, text)


def _check_meta_schema(schema: dict | bool) -> None:
    """Validity as JSON Schema (the draft its ``$schema`` names, else 2020-12), with the ``jsonschema``
    library's meta-schemas."""
    import jsonschema

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(f"structured_outputs.json: not a valid JSON Schema at #/{where}: {exc.message}") from None


def _check_keywords(schema: dict[str, Any], path: str) -> None:
    """Every keyword is one xgrammar enforces, in a combination it enforces."""
    def refuse(what: str) -> None:
        raise ValueError(f"structured_outputs.json: {what} at {path} is not enforced by the grammar engine")

    for key, value in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key not in _SUPPORTED_KEYWORDS:
            raise ValueError(f"structured_outputs.json: the keyword {key!r} at {path} is not supported "
                             f"(supported: {', '.join(sorted(_SUPPORTED_KEYWORDS))})")
        if key == "format" and value not in _FORMATS:
            raise ValueError(f"structured_outputs.json: format {value!r} at {path} is not supported "
                             f"(supported: {', '.join(sorted(_FORMATS))})")
        if key in _SUB_SCHEMA and isinstance(value, dict):
            _check_keywords(value, f"{path}/{key}")
        elif key in _SUB_SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                if isinstance(sub, dict):
                    _check_keywords(sub, f"{path}/{key}/{i}")
        elif key in _SUB_SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, dict):
                    _check_keywords(sub, f"{path}/{key}/{name}")
    constraints = set(schema) - _ANNOTATIONS - {"$defs", "definitions"}
    if "$ref" in schema and constraints - {"$ref"}:
        refuse(f"a keyword beside $ref ({', '.join(sorted(constraints - {'$ref'}))})")
    if len(schema.get("allOf") or []) > 1:
        refuse("allOf with more than one schema")
    if "multipleOf" in schema and schema.get("type") != "integer":
        refuse("multipleOf on a non-integer")
    if {"minLength", "maxLength"} & set(schema) and {"pattern", "format"} & set(schema):
        refuse("minLength/maxLength beside a pattern or format")
    properties = schema.get("properties") or {}
    missing = [name for name in schema.get("required") or [] if name not in properties]
    if missing and schema.get("additionalProperties") in (None, False):
        refuse(f"required {missing} without properties (additional properties are closed)")
    if "oneOf" in schema and not _exclusive(schema["oneOf"]):
        refuse("oneOf whose branches may overlap (the grammar enforces any-of; use anyOf, distinct types or "
               "a const discriminator)")


def _exclusive(branches: list[Any]) -> bool:
    """Whether no value can match two ``oneOf`` branches, by a check that is sure when it says yes: the
    branches' types are disjoint (integer counts as a number), or they are objects with one required
    property whose ``const`` differs in each."""
    types: list[set[str]] = []
    for b in branches:
        t = b.get("type") if isinstance(b, dict) else None
        t = {t} if isinstance(t, str) else set(t) if isinstance(t, list) else None
        if t is None:
            break
        types.append(t | ({"integer"} if "number" in t else set()))
    else:
        if sum(len(t) for t in types) == len(set().union(*types)):
            return True
    if not all(isinstance(b, dict) for b in branches):
        return False
    common = set.intersection(*(set(b.get("required") or []) for b in branches)) if branches else set()
    for name in common:
        consts = [((b.get("properties") or {}).get(name) or {}).get("const", _MISSING) for b in branches]
        if _MISSING not in consts and len({jsonlib.dumps(c) for c in consts}) == len(consts):
            return True
    return False


_MISSING = object()


def build_grammar(grammar_kind: str, text: str) -> Any:
    """The ``xgrammar.Grammar`` of a constraint's key (``StructuredOutputsParams.key``): what the engine
    compiles (``GrammarCompiler``) and what construction checks, built with the same settings."""
    import xgrammar

    if grammar_kind in ("json", "json_compact"):
        loose = grammar_kind == "json"
        return xgrammar.Grammar.from_json_schema(text, strict_mode=True, any_whitespace=loose,
                                                 max_whitespace_cnt=MAX_WHITESPACE if loose else None)
    if grammar_kind == "regex":
        return xgrammar.Grammar.from_regex(text)
    if grammar_kind == "grammar":
        return xgrammar.Grammar.from_ebnf(text)
    if grammar_kind == "json_object":  # any object (xgrammar's built-in JSON grammar allows any value)
        return xgrammar.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=True,
                                                 max_whitespace_cnt=MAX_WHITESPACE)
    raise ValueError(f"unknown structured-outputs grammar kind {grammar_kind!r}")


def _check_builds(kind: str, grammar_kind: str, text: str) -> None:
    """Build the grammar (tokenizer-independent, milliseconds): a regex or EBNF that does not parse, or a
    schema xgrammar cannot convert (an unresolvable ``$ref``), is the caller's error now, not a failed
    compile later. The tokenizer-dependent compile runs in the engine, off its step loop."""
    try:
        build_grammar(grammar_kind, text)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError with the parser's message
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "]" in message and message.startswith("["):  # "[hh:mm:ss] /path/file.cc:123: what" -> what
            message = message.split(": ", 1)[-1]
        raise ValueError(f"structured_outputs.{kind}: {message}") from None
