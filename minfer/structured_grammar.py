"""What xgrammar can enforce of a constraint, and the grammar it is given.

xgrammar compiles JSON Schema by itself but silently ignores keywords it does not implement (``uniqueItems``,
``not``, ``if``/``then``/``else``, unknown ``format`` values, ...): an output that "followed" such a schema
could still fail to validate, so ``check_keywords`` refuses those, by an allow-list. ``build_grammar`` builds
a constraint's xgrammar ``Grammar``, the same one for the request's check and the engine's compile, with its
JSON string rules mended in the grammar text (``minfer.ebnf``, ``minfer.ebnf_regex``): a JSON output must
parse strictly. ``check_builds`` refuses a constraint that does not build or whose language is empty.

The keyword tables (``SUB_SCHEMA*``: which keywords hold schemas) also steer the size checks' walk
(``minfer.structured_limits``).
"""
from __future__ import annotations

import json as jsonlib
from typing import Any

import minfer.ebnf as ebnf
from minfer.ebnf_regex import regex_to_json_ebnf

MAX_WHITESPACE = 16  # characters of whitespace in a row that JSON output may carry (room for indentation)

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
SUB_SCHEMA = ("items", "additionalProperties", "propertyNames")
SUB_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUB_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def check_keywords(schema: dict[str, Any], path: str) -> None:
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
        if key in SUB_SCHEMA and isinstance(value, dict):
            check_keywords(value, f"{path}/{key}")
        elif key in SUB_SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                if isinstance(sub, dict):
                    check_keywords(sub, f"{path}/{key}/{i}")
        elif key in SUB_SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, dict):
                    check_keywords(sub, f"{path}/{key}/{name}")
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
    compiles (``GrammarCompiler``) and what construction checks, built with the same settings. A schema's
    grammar has its string rules mended (``_json_schema_grammar``)."""
    import xgrammar

    if grammar_kind in ("json", "json_compact"):
        return _json_schema_grammar(text, grammar_kind == "json")
    if grammar_kind == "regex":
        return xgrammar.Grammar.from_regex(text)
    if grammar_kind == "grammar":
        return xgrammar.Grammar.from_ebnf(text)
    if grammar_kind == "json_object":  # any object (xgrammar's built-in JSON grammar allows any value)
        grammar = xgrammar.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, any_whitespace=True,
                                                    max_whitespace_cnt=MAX_WHITESPACE)
        return xgrammar.Grammar.from_ebnf(ebnf.replace_terminals(
            str(grammar), lambda tok, _: ebnf.UNESCAPED_CLASS if tok == ebnf.XGRAMMAR_STRING_CLASS else None))
    raise ValueError(f"unknown structured-outputs grammar kind {grammar_kind!r}")


_PLACEHOLDER = "minfer_pattern_"


def _json_schema_grammar(text: str, loose: bool) -> Any:
    """xgrammar's grammar of a schema, with two of its string rules replaced (xgrammar 0.2.9 writes both so
    that a strict JSON parser can reject the output): a length-bounded string's character class
    (``ebnf.XGRAMMAR_BOUNDED_STRING_CLASS``: raw control characters, no escapes) by ``ebnf.JSON_CHAR``, and
    each ``pattern`` / ``patternProperties`` regex (its quotes, backslashes and control characters written
    raw; ``.`` and the negated classes read otherwise than ``re`` reads them) by
    ``regex_to_json_ebnf``'s rule. The patterns reach xgrammar as placeholders, found again in its
    text by name."""
    import xgrammar

    schema = jsonlib.loads(text)
    patterns: list[str] = []

    def placeholder(pattern: str) -> str:
        patterns.append(pattern)
        return f"{_PLACEHOLDER}{len(patterns) - 1}"

    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("pattern"), str):
            node["pattern"] = placeholder(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = {placeholder(k): v for k, v in node["patternProperties"].items()}
        for key in SUB_SCHEMA:
            stack.append(node.get(key))
        for key in SUB_SCHEMA_LISTS:
            stack.extend(node.get(key) or [] if isinstance(node.get(key), list) else [])
        for key in SUB_SCHEMA_MAPS:
            stack.extend((node.get(key) or {}).values() if isinstance(node.get(key), dict) else [])
    grammar = xgrammar.Grammar.from_json_schema(jsonlib.dumps(schema, ensure_ascii=False), strict_mode=True,
                                                any_whitespace=loose,
                                                max_whitespace_cnt=MAX_WHITESPACE if loose else None)
    bodies = [regex_to_json_ebnf(p) for p in patterns]

    def replace(tok: str, rest: list[str]) -> str | None:
        if tok == ebnf.XGRAMMAR_BOUNDED_STRING_CLASS:
            return ebnf.JSON_CHAR
        if tok == ebnf.XGRAMMAR_STRING_CLASS:  # an unbounded string's unescaped character
            return ebnf.UNESCAPED_CLASS
        if tok == "Regex" and len(rest) > 1 and rest[1].startswith(f'"{_PLACEHOLDER}'):
            return bodies[int(rest[1][len(_PLACEHOLDER) + 1:-1])]
        return None

    return xgrammar.Grammar.from_ebnf(ebnf.replace_terminals(str(grammar), replace))


def check_builds(kind: str, grammar_kind: str, text: str) -> None:
    """Build the grammar (tokenizer-independent, milliseconds): a regex or EBNF that does not parse, or a
    schema xgrammar cannot convert (an unresolvable ``$ref``), is the caller's error now, not a failed
    compile later; so is a grammar whose language is empty (it would "finish" with an empty output). The
    tokenizer-dependent compile runs in the engine, off its step loop."""
    try:
        grammar = build_grammar(grammar_kind, text)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError with the parser's message
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "]" in message and message.startswith("["):  # "[hh:mm:ss] /path/file.cc:123: what" -> what
            message = message.split(": ", 1)[-1]
        if message.startswith("structured_outputs."):
            raise ValueError(message) from None
        raise ValueError(f"structured_outputs.{kind}: {message}") from None
    if not ebnf.productive(str(grammar)):
        what = {"json": "the schema admits no value", "regex": "the regex matches no string"}
        raise ValueError(f"structured_outputs.{kind}: {what.get(kind, 'the grammar derives no string')} "
                         f"(its language is empty)")
