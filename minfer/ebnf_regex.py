"""JSON Schema ``pattern``s as xgrammar EBNF: the text of a JSON string whose decoded value matches the regex.

A ``pattern`` is a Python ``re`` regex (the dialect ``jsonschema`` validates with); ``regex_to_json_ebnf``
rewrites ``re``'s own parse of it into EBNF over the JSON string's text, so characters JSON must escape
come out escaped. xgrammar's own ``Regex(..., json_string=true)`` writes a quote, a backslash or a
control character of the pattern raw, and reads ``\\W``/``\\S``/``.`` otherwise than ``re``:
``minfer.structured_grammar`` puts this module's rule in its place. Character sets are ``minfer.ebnf``'s
code-point ranges.
"""
from __future__ import annotations

import functools
import re

from minfer.ebnf import MAX_CODE_POINT, Ranges, complement, intersect, normalize, subtract

_UNSAFE = [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]  # what a JSON string must escape
_SHORT = {0x22: '\\"', 0x5C: "\\\\", 8: "\\b", 12: "\\f", 10: "\\n", 13: "\\r", 9: "\\t"}
_ASCII = [(0, 0x7F)]
_DIGIT = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]


@functools.lru_cache(maxsize=1)
def _unicode_space() -> Ranges:
    """Python's ``\\s`` on str patterns (``str.isspace``; every such character is below U+3001)."""
    return normalize([(c, c) for c in range(0x3001) if chr(c).isspace()])


def _category(name: str, ascii_only: bool) -> tuple[Ranges, Ranges]:
    """(a subset, a superset) of what ``re``'s category matches: exact where cheap (ASCII mode, spaces),
    else the ASCII part below and everything non-ASCII added above."""
    space = [(9, 13), (0x20, 0x20)] if ascii_only else _unicode_space()
    base = {"DIGIT": _DIGIT, "WORD": _WORD, "SPACE": space}[name.split("_")[-1]]
    exact = ascii_only or name.endswith("SPACE")
    lo, hi = base, base if exact else normalize(base + [(0x80, MAX_CODE_POINT)])
    return (complement(hi), complement(lo)) if name.startswith("NOT_") else (lo, hi)


def _json_text(points: Ranges) -> str:
    """EBNF for the JSON string text of one character of ``points``: unescaped where JSON allows, else its
    one escape."""
    points = subtract(points, [(0xD800, 0xDFFF)])
    parts = []
    safe = subtract(points, _UNSAFE)
    if safe:
        parts.append("[" + "".join(_class_char(lo) if lo == hi else f"{_class_char(lo)}-{_class_char(hi)}"
                                   for lo, hi in safe) + "]")
    for lo, hi in intersect(points, _UNSAFE):
        for c in range(lo, hi + 1):
            parts.append(_literal(_SHORT.get(c, f"\\u{c:04x}")))
    return "(" + " | ".join(parts) + ")" if parts else "[^\\0-\\U0010ffff]"


def _class_char(c: int) -> str:
    return f"\\U{c:08x}"


def _literal(s: str) -> str:
    return '"' + "".join(f"\\U{ord(c):08x}" for c in s) + '"'


def regex_to_json_ebnf(pattern: str) -> str:
    """An EBNF expression for the JSON text (without its quotes) of strings that ``re.fullmatch(pattern)``
    (so also ``re.search``, which JSON Schema's ``pattern`` means) accepts. Categories are read as ``re``
    reads them, or as a subset (``\\w`` is ASCII letters, digits and '_'). ValueError for what has no
    grammar: look-arounds, backreferences, word boundaries, possessive repeats, an anchor that is not at
    the start or the end."""
    import re._constants as C
    import re._parser as P

    try:
        tree = P.parse(pattern)
    except re.error as exc:
        raise ValueError(f"the pattern {pattern!r} is not a valid regular expression: {exc}") from None
    flags = tree.state.flags

    def charset(items: list, fl: int) -> Ranges:
        lo_union: Ranges = []
        hi_union: Ranges = []
        negate = False
        for op, av in items:
            if op is C.NEGATE:
                negate = True
            elif op is C.LITERAL:
                lo_union.append((av, av))
                hi_union.append((av, av))
            elif op is C.RANGE:
                lo_union.append(av)
                hi_union.append(av)
            elif op is C.CATEGORY:
                lo, hi = _category(str(av).replace("CATEGORY_", ""), bool(fl & re.ASCII))
                lo_union += lo
                hi_union += hi
            else:
                raise ValueError(f"the pattern {pattern!r}: {op} in a class is not supported")
        return complement(normalize(hi_union)) if negate else normalize(lo_union)

    def seq(sub: list, fl: int, at_start: bool, at_end: bool) -> str:
        parts = []
        for k, (op, av) in enumerate(sub):
            start = at_start and all(o is C.AT for o, _ in sub[:k])
            end = at_end and all(o is C.AT for o, _ in sub[k + 1:])
            if op is C.AT:
                if av in (C.AT_BEGINNING, C.AT_BEGINNING_STRING) and start:
                    continue
                if av in (C.AT_END, C.AT_END_STRING) and end:
                    continue
                raise ValueError(f"the pattern {pattern!r}: an anchor or word boundary is supported only "
                                 f"at its start (^) or end ($)")
            parts.append(item(op, av, fl, start, end))
        return " ".join(parts) if parts else '""'

    def item(op: object, av: object, fl: int, start: bool, end: bool) -> str:
        if op is C.LITERAL:
            return _json_text([(av, av)])
        if op is C.NOT_LITERAL:
            return _json_text(complement([(av, av)]))
        if op is C.ANY:
            return _json_text(complement([]) if fl & re.DOTALL else complement([(10, 10)]))
        if op is C.IN:
            return _json_text(charset(av, fl))
        if op is C.BRANCH:
            return "(" + " | ".join(seq(list(b), fl, start, end) for b in av[1]) + ")"
        if op is C.SUBPATTERN:
            _, add, drop, sub = av
            return "(" + seq(list(sub), (fl | add) & ~drop, start, end) + ")"
        if op in (C.MAX_REPEAT, C.MIN_REPEAT):
            low, high, sub = av
            inner = "(" + seq(list(sub), fl, False, False) + ")"
            return f"{inner}{{{low}, {-1 if high is C.MAXREPEAT else high}}}"
        raise ValueError(f"the pattern {pattern!r}: {str(op).lower()} is not supported by the grammar engine")

    return "(" + seq(list(tree), flags, True, True) + ")"
