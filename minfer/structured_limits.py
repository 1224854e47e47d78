"""How large a structured-outputs constraint may be: ``StructuredOutputsLimits`` and the checks against it.

The limits (engine knobs, ``structured_outputs_max_*``) bound a constraint's text, its nesting, ``$ref``
expansion, enum entries, rules and regex lengths. ``check_limits`` measures them with iterative code,
before ``jsonschema`` or xgrammar (both recursive: a deep enough input kills xgrammar's process) sees the
input, and it refuses a ``$ref`` that is not local (nothing is fetched).
"""
from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import unquote

import minfer.ebnf as ebnf
from minfer.structured_grammar import SUB_SCHEMA, SUB_SCHEMA_LISTS, SUB_SCHEMA_MAPS


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
            child_schema = is_schema and key in SUB_SCHEMA
            if is_schema and key in SUB_SCHEMA_LISTS and isinstance(sub, list):
                nodes += 1
                stack.extend((v, depth + 2, True) for v in sub)
                continue
            if is_schema and key in SUB_SCHEMA_MAPS and isinstance(sub, dict):
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
