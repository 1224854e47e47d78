"""StructuredOutputsParams: the shape a request's output must take (vLLM's names), and its checks.

The engine forces the output through xgrammar (``minfer.engine.grammar``); this module decides whether a
request's constraint is acceptable, so a bad one is an error naming its field before it is queued, and
builds its xgrammar ``Grammar`` (``build_grammar``: the same one for that check and the engine's compile).
xgrammar compiles JSON Schema by itself but silently ignores keywords it does not implement
(``uniqueItems``, ``not``, ``if``/``then``/``else``, unknown ``format`` values, ...): an output that
"followed" such a schema could still fail to validate, so those are refused here, by an allow-list.
Its string rules are mended in the grammar text (``minfer.ebnf``): a JSON output must parse strictly.

Size first: ``StructuredOutputsLimits`` (engine knobs) bound the text, its nesting, ``$ref`` expansion,
enums and rules, checked by iterative code before ``jsonschema`` or xgrammar (both recursive: a deep
enough input kills xgrammar's process) sees the input. Construction checks the shape, and the rest at
once against the default limits when the constraint is within them (so a bad schema is an error where
it is written); the engine checks every request against its own limits (``Processor``), which also
covers a constraint past the defaults that a raised limit allows.
"""
from __future__ import annotations

import functools
import json as jsonlib
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import unquote

import minfer.ebnf as ebnf

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


@dataclass(frozen=True, slots=True)
class StructuredOutputsLimits:
    """Bounds on a constraint, each an engine knob ``structured_outputs_<name>`` (``--structured-outputs-...``).
    The defaults pass any realistic schema (OpenAI's own: 5,000 properties, 10 levels of nesting) and build
    and compile in well under a second each at the limit."""

    max_bytes: int = 1 << 20  # the schema, grammar, regex or choices as UTF-8 text
    max_depth: int = 64  # JSON containers of a schema, $refs followed; brackets of a grammar or regex
    max_nodes: int = 10_000  # JSON objects and arrays in a schema
    max_enum_entries: int = 10_000  # enum values + consts of a schema; choices
    max_rules: int = 1_000  # rules of an EBNF grammar
    max_regex_length: int = 10_000  # characters of a regex, a schema's pattern or patternProperties key

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"structured_outputs_{f.name} must be an integer >= 1, got {value!r}")


DEFAULT_LIMITS = StructuredOutputsLimits()


class LimitError(ValueError):
    """A constraint past one of the limits."""


def _limit(kind: str, what: str, value: int, name: str, limits: StructuredOutputsLimits) -> None:
    bound = getattr(limits, name)
    if value > bound:
        raise LimitError(f"structured_outputs.{kind}: {what} is {value}, over the limit of {bound} "
                         f"(--structured-outputs-{name.replace('_', '-')})")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON Schema, as a dict or its JSON text), ``regex`` (the whole output
    matches it), ``choice`` (the output is one of these strings), ``grammar`` (an EBNF grammar in
    xgrammar's syntax, ``root ::= ...``), ``json_object=True`` (any JSON object).

    JSON may carry whitespace between tokens (at most ``MAX_WHITESPACE`` characters in a row: models,
    weak ones especially, can otherwise emit whitespace until ``max_tokens``); ``disable_any_whitespace``
    (vLLM's name) allows no free whitespace: only xgrammar's fixed separators ``", "`` and ``": "``.

    ``key`` (kind, canonical text) identifies the compiled grammar: requests with equal keys share one.
    ``check(limits)`` is the engine's check (``Processor``)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False
    key: tuple[str, str] = field(default=("", ""), init=False, repr=False, compare=False)
    # the request field that set it (the server's; "" offline), named in the engine's refusal
    source: str = field(default="", init=False, repr=False, compare=False)

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
        try:
            check_limits(kind, *self.key, DEFAULT_LIMITS)
        except LimitError:
            return  # past the defaults: the engine checks it against its own limits (``check``)
        self.check(DEFAULT_LIMITS)

    @property
    def kind(self) -> str:
        """The field that was set: json, regex, choice, grammar or json_object."""
        return next(k for k in KINDS if (getattr(self, k) is not None if k != "json_object" else self.json_object))

    def check(self, limits: StructuredOutputsLimits = DEFAULT_LIMITS) -> None:
        """Whether minfer can enforce this constraint within ``limits``: ValueError naming the field if not
        (``_check``; cached)."""
        try:
            _check(self.kind, *self.key, limits)
        except RecursionError:  # belt and braces: the limits are there to keep recursion away
            raise ValueError(f"structured_outputs.{self.kind}: nested too deeply to check") from None


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
        except RecursionError:
            raise ValueError("structured_outputs.json: nested too deeply") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"structured_outputs.json must be a JSON Schema object, got {type(schema).__name__}")
    try:  # property order kept: it is the output's
        return jsonlib.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs.json: not valid JSON: {exc}") from None
    except RecursionError:
        raise ValueError("structured_outputs.json: nested too deeply") from None


@functools.lru_cache(maxsize=CHECK_CACHE_SIZE)
def _check(kind: str, grammar_kind: str, text: str, limits: StructuredOutputsLimits) -> None:
    """Whether the constraint ``(grammar_kind, text)`` (``StructuredOutputsParams.key``; ``kind``, the field
    that set it, names it in errors) is one minfer can enforce: within ``limits``, a schema must be valid JSON
    Schema whose every keyword xgrammar enforces, and the grammar must build with a non-empty language
    (``_check_builds``). Cached: agents resend the same schema every turn. A failure raises each time
    (``lru_cache`` keeps results only)."""
    check_limits(kind, grammar_kind, text, limits)
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


def check_limits(kind: str, grammar_kind: str, text: str, limits: StructuredOutputsLimits) -> None:
    """``LimitError`` for a constraint past ``limits``; ValueError for a ``$ref`` that is not local. Iterative,
    so that it is safe on any input."""
    _limit(kind, "the size in bytes", len(text.encode("utf-8")), "max_bytes", limits)
    if grammar_kind in ("json", "json_compact"):
        _check_schema_limits(jsonlib.loads(text), limits)
    elif grammar_kind == "regex":
        _limit(kind, "the regex's length", len(text), "max_regex_length", limits)
        _limit(kind, "the regex's nesting depth", _regex_depth(text), "max_depth", limits)
    elif grammar_kind == "grammar":
        if kind == "choice":
            _limit(kind, "the number of choices", text.count('" | "') + 1, "max_enum_entries", limits)
            return
        depth = rules = 0
        opened = 0
        for tok in ebnf.tokens(text):
            rules += tok == "::="
            opened += (tok in "([{") - (tok in ")]}") if len(tok) == 1 else 0
            depth = max(depth, opened)
        _limit(kind, "the number of rules", rules, "max_rules", limits)
        _limit(kind, "the nesting depth", depth, "max_depth", limits)


def _regex_depth(pattern: str) -> int:
    """The deepest nesting of groups in a regex (escapes and classes skipped)."""
    depth = opened = i = 0
    in_class = False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 1
        elif in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "]":  # a leading ']' is a member
                i += 1
        elif c in "()":
            opened += 1 if c == "(" else -1
            depth = max(depth, opened)
        i += 1
    return depth


def _check_schema_limits(schema: Any, limits: StructuredOutputsLimits) -> None:
    """One walk over the schema: containers, enum entries, pattern lengths and ``$ref``s; then the depth with
    ``$ref``s followed (``_expanded_depth``), which is what xgrammar's converter recurses through."""
    kind = "json"
    nodes = entries = 0
    refs_wanted: set[str] = set()
    stack: list[tuple[Any, int, bool]] = [(schema, 1, True)]  # (value, depth, whether it is a schema)
    while stack:
        value, depth, is_schema = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        nodes += 1
        _limit(kind, "the number of objects and arrays", nodes, "max_nodes", limits)
        _limit(kind, "the nesting depth", depth, "max_depth", limits)
        if isinstance(value, list):
            stack.extend((v, depth + 1, False) for v in value)
            continue
        if is_schema:
            ref = value.get("$ref")
            if isinstance(ref, str):
                if not (ref == "#" or ref.startswith("#/")):
                    raise ValueError(f"structured_outputs.json: the $ref {ref!r} is not supported: only local "
                                     f"references into the schema itself ('#' or '#/...'); nothing is fetched")
                refs_wanted.add(ref)
            enum = value.get("enum")
            entries += (len(enum) if isinstance(enum, list) else 0) + ("const" in value)
            _limit(kind, "the number of enum and const entries", entries, "max_enum_entries", limits)
            pattern = value.get("pattern")
            if isinstance(pattern, str):
                _limit(kind, "a pattern's length", len(pattern), "max_regex_length", limits)
        for key, sub in value.items():
            child_schema = is_schema and key in _SUB_SCHEMA
            if is_schema and key in _SUB_SCHEMA_LISTS and isinstance(sub, list):
                nodes += 1
                stack.extend((v, depth + 2, True) for v in sub)
                continue
            if is_schema and key in _SUB_SCHEMA_MAPS and isinstance(sub, dict):
                nodes += 1
                for name, v in sub.items():
                    if key == "patternProperties":
                        _limit(kind, "a patternProperties key's length", len(name), "max_regex_length", limits)
                    stack.append((v, depth + 2, True))
                continue
            stack.append((sub, depth + 1, child_schema))
    if refs_wanted:
        _limit(kind, "the nesting depth with $refs followed", _expanded_depth(schema, refs_wanted),
               "max_depth", limits)


def _resolve(schema: Any, ref: str) -> Any:
    """The value a local ``$ref`` points at (a JSON pointer in a URI fragment), or None."""
    node = schema
    for part in ref[2:].split("/") if ref != "#" else []:
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _expanded_depth(schema: Any, wanted: set[str]) -> int:
    """A bound on the nesting of the schema with every ``$ref`` replaced by its target, each target expanded
    once along a path (a recursive schema closes on a rule name): over the graph whose nodes are the root and
    the targets and whose edges are the references and the targets inside targets (each weighted by how deep
    below its source it stands), the longest path, a cycle counted as the sum of its members' heights."""
    targets = {ref: _resolve(schema, ref) for ref in wanted}
    nodes = {id(schema)} | {id(t) for t in targets.values() if isinstance(t, (dict, list))}
    edges: dict[int, list[tuple[int, int]]] = {n: [] for n in nodes}
    preorder: list[tuple[int, int]] = []  # (id, depth): a container's descendants follow it, deeper
    stack: list[tuple[Any, int, tuple[int, int]]] = [(schema, 1, (id(schema), 1))]
    while stack:
        value, depth, outer = stack.pop()
        if id(value) in nodes and id(value) != outer[0]:
            edges[outer[0]].append((depth - outer[1], id(value)))
            outer = (id(value), depth)
        preorder.append((id(value), depth))
        if isinstance(value, dict):
            target = targets.get(value.get("$ref")) if isinstance(value.get("$ref"), str) else None
            if isinstance(target, (dict, list)):
                edges[outer[0]].append((depth - outer[1] + 1, id(target)))  # a $ref is a level of recursion
        for v in value.values() if isinstance(value, dict) else value:
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1, outer))
    height: dict[int, int] = {}
    for i, (key, depth) in enumerate(preorder):
        if key in nodes:
            j, deepest = i + 1, depth
            while j < len(preorder) and preorder[j][1] > depth:
                deepest = max(deepest, preorder[j][1])
                j += 1
            height[key] = deepest - depth + 1
    return _longest_path(list(nodes), edges, height, id(schema))


def _longest_path(nodes: list[int], edges: dict[int, list[tuple[int, int]]], height: dict[int, int],
                  root: int) -> int:
    """Tarjan's strongly connected components, iteratively; components come out successors first, so each
    component's value is its members' heights (summed when it is a cycle) plus its best exit."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    scc_stack: list[int] = []
    value: dict[int, int] = {}  # member -> the component's bound
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                scc_stack.append(v)
                on_stack.add(v)
            succ = edges.get(v, [])
            if i < len(succ):
                work.append((v, i + 1))
                w = succ[i][1]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            for _, w in succ:
                if w in on_stack:
                    low[v] = min(low[v], low[w])
            if low[v] == index[v]:
                members = []
                while True:
                    w = scc_stack.pop()
                    on_stack.discard(w)
                    members.append(w)
                    if w == v:
                        break
                inside = set(members)
                exits = [below + value[w] for m in members for below, w in edges.get(m, []) if w not in inside]
                cyclic = len(members) > 1 or any(w == v for _, w in edges.get(v, []))
                own = sum(height[m] for m in members) if cyclic else height[v]
                bound = max([own] + [own + e for e in exits] if cyclic else [own] + exits)
                for m in members:
                    value[m] = bound
    return value[root]


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
    ``ebnf.regex_to_json_ebnf``'s rule. The patterns reach xgrammar as placeholders, found again in its
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
        for key in _SUB_SCHEMA:
            stack.append(node.get(key))
        for key in _SUB_SCHEMA_LISTS:
            stack.extend(node.get(key) or [] if isinstance(node.get(key), list) else [])
        for key in _SUB_SCHEMA_MAPS:
            stack.extend((node.get(key) or {}).values() if isinstance(node.get(key), dict) else [])
    grammar = xgrammar.Grammar.from_json_schema(jsonlib.dumps(schema, ensure_ascii=False), strict_mode=True,
                                                any_whitespace=loose,
                                                max_whitespace_cnt=MAX_WHITESPACE if loose else None)
    bodies = [ebnf.regex_to_json_ebnf(p) for p in patterns]

    def replace(tok: str, rest: list[str]) -> str | None:
        if tok == ebnf.XGRAMMAR_BOUNDED_STRING_CLASS:
            return ebnf.JSON_CHAR
        if tok == ebnf.XGRAMMAR_STRING_CLASS:  # an unbounded string's unescaped character
            return ebnf.UNESCAPED_CLASS
        if tok == "Regex" and len(rest) > 1 and rest[1].startswith(f'"{_PLACEHOLDER}'):
            return bodies[int(rest[1][len(_PLACEHOLDER) + 1:-1])]
        return None

    return xgrammar.Grammar.from_ebnf(ebnf.replace_terminals(str(grammar), replace))


def _check_builds(kind: str, grammar_kind: str, text: str) -> None:
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
