"""xgrammar's EBNF as text: what structured outputs read in and write into a grammar.

xgrammar prints a ``Grammar`` as EBNF that ``Grammar.from_ebnf`` reads back unchanged, so a grammar can be
checked and mended between the two:

- ``productive``: whether a rule derives at least one string (a least fixpoint over the rules; an empty
  character class derives nothing), so a grammar or regex whose language is empty is refused instead of
  "finishing" with an empty output.
- ``replace_terminals``: swaps a character class or a macro for an expression, outside string literals.
  xgrammar 0.2.9 writes length-bounded JSON strings with the class ``[^"\\\\\\r\\n]``, which admits raw
  control characters and no escapes; ``JSON_CHAR`` is one character of a JSON string as RFC 8259 has it.
- ``tokens``: the grammar text's tokens, which the size checks (``minfer.structured_limits``) count.

Character sets are sorted lists of inclusive ``(lo, hi)`` code-point ranges, with their set operations
here; ``minfer.ebnf_regex`` builds on them to write a JSON Schema ``pattern`` as EBNF.
"""
from __future__ import annotations

import functools
import re
from typing import Callable, Iterator

MAX_CODE_POINT = 0x10FFFF
Ranges = list[tuple[int, int]]

_HEX4_NOT_SURROGATE = '([0-9a-cA-CefEF] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2})'
# One character of a JSON string: unescaped (U+0020.. except '"' and '\'), or one escape; a \\u escape of a
# surrogate is left out so that every match is exactly one code point (maxLength counts code points).
# Surrogates are left out of the unescaped class: xgrammar matches their 3-byte (invalid UTF-8) spelling, which
# decodes to three U+FFFD.
UNESCAPED_CLASS = '[^\\0-\\x1f\\"\\\\\\ud800-\\udfff]'
JSON_CHAR = '(' + UNESCAPED_CLASS + ' | "\\\\" ([\\"\\\\/bfnrt] | "u" ' + _HEX4_NOT_SURROGATE + '))'
XGRAMMAR_BOUNDED_STRING_CLASS = '[^\\"\\\\\\r\\n]'  # as xgrammar 0.2.9 prints them
XGRAMMAR_STRING_CLASS = '[^\\0-\\x1f\\"\\\\\\r\\n]'

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|::=|[A-Za-z_][A-Za-z0-9_]*|-?\d+|\s+|.', re.S)
_SIMPLE_ESCAPES = {"0": 0, "a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, "e": 27}


def tokens(text: str) -> Iterator[str]:
    """The printed grammar's tokens, whitespace included (so that joining them gives the text back)."""
    return (m.group(0) for m in _TOKEN.finditer(text))


def replace_terminals(text: str, replace: Callable[[str, list[str]], str | None]) -> str:
    """The grammar text with each class token, or each ``Name(...)`` macro call, that ``replace(token, rest)``
    maps to a string swapped for it (``rest``: the tokens after a macro's name, up to its closing parenthesis)."""
    toks = list(tokens(text))
    out: list[str] = []
    i = 0
    while i < len(toks):
        tok = toks[i]
        if tok[0] == "[":
            new = replace(tok, [])
            out.append(tok if new is None else new)
        elif tok[0].isalpha() and i + 1 < len(toks) and toks[i + 1] == "(":
            depth, j = 0, i + 1
            while j < len(toks):
                depth += (toks[j] == "(") - (toks[j] == ")")
                if depth == 0:
                    break
                j += 1
            new = replace(tok, toks[i + 1:j + 1])
            if new is not None:
                out.append(new)
                i = j + 1
                continue
            out.append(tok)
        else:
            out.append(tok)
        i += 1
    return "".join(out)


def unescape(body: str) -> list[int]:
    """The code points of a string literal's or class's inside, as xgrammar prints escapes."""
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(ord(c))
            i += 1
            continue
        e = body[i + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(e)
        if width:
            out.append(int(body[i + 2:i + 2 + width], 16))
            i += 2 + width
        else:
            out.append(_SIMPLE_ESCAPES.get(e, ord(e)))
            i += 2
    return out


def class_ranges(cls: str) -> Ranges:
    """The code points a printed class ``[...]`` or ``[^...]`` admits (surrogates, which UTF-8 cannot
    spell, left out)."""
    negated = cls.startswith("[^")
    points = unescape(cls[2 if negated else 1:-1])
    ranges: Ranges = []
    i = 0
    while i < len(points):
        if i + 2 < len(points) and points[i + 1] == ord("-"):
            ranges.append((points[i], points[i + 2]))
            i += 3
        else:
            ranges.append((points[i], points[i]))
            i += 1
    ranges = normalize(ranges)
    return subtract(complement(ranges) if negated else ranges, [(0xD800, 0xDFFF)])


def normalize(ranges: Ranges) -> Ranges:
    out: Ranges = []
    for lo, hi in sorted(r for r in ranges if r[0] <= r[1]):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def complement(ranges: Ranges) -> Ranges:
    out, start = [], 0
    for lo, hi in normalize(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return out


def subtract(a: Ranges, b: Ranges) -> Ranges:
    return intersect(a, complement(b))


def intersect(a: Ranges, b: Ranges) -> Ranges:
    out, i, j = [], 0, 0
    a, b = normalize(a), normalize(b)
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


# ---- emptiness -----------------------------------------------------------------------------------------

class _Reader:
    """Recursive descent over one rule's tokens into a node: ('lit',) ('cls', nonempty) ('ref', name)
    ('alt', [nodes]) ('seq', [nodes]) ('rep', min, node)."""

    def __init__(self, toks: list[str], regex_productive: Callable[[str], bool]) -> None:
        self.toks = [t for t in toks if not t.isspace()]
        self.i = 0
        self.regex_productive = regex_productive

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def expr(self) -> tuple:
        alts = [self.seq()]
        while self.peek() == "|":
            self.i += 1
            alts.append(self.seq())
        return ("alt", alts)

    def seq(self) -> tuple:
        items = []
        while self.peek() not in (None, "|", ")", ","):
            item = self.item()
            if item is not None:
                items.append(item)
        return ("seq", items)

    def item(self) -> tuple | None:
        tok = self.toks[self.i]
        self.i += 1
        if tok == "(" and self.peek() == "=":  # a lookahead: it constrains what follows, not what is derived
            self.i += 1
            self.expr()
            self.i += 1
            return None
        if tok == "(":
            node = self.expr()
            self.i += 1
        elif tok[0] == '"':
            node = ("lit",)
        elif tok[0] == "[":
            node = ("cls", _nonempty(tok))
        elif tok[0].isalpha() and self.peek() == "(":  # a macro: Regex("..."), TagDispatch(...), ...
            start, depth = self.i, 0
            while True:
                t = self.toks[self.i]
                depth += (t == "(") - (t == ")")
                self.i += 1
                if depth == 0:
                    break
            args = self.toks[start:self.i]
            node = ("cls", self.regex_productive("".join(chr(c) for c in unescape(args[1][1:-1])))) \
                if tok == "Regex" and len(args) > 1 and args[1][0] == '"' else ("lit",)
        elif tok[0].isalpha():
            node = ("ref", tok)
        else:
            raise ValueError(f"unexpected {tok!r} in the grammar")
        while self.peek() in ("*", "+", "?", "{"):
            op = self.toks[self.i]
            self.i += 1
            if op == "{":
                low = int(self.toks[self.i])
                while self.toks[self.i] != "}":
                    self.i += 1
                self.i += 1
            else:
                low = 1 if op == "+" else 0
            node = ("rep", low, node)
        return node


@functools.lru_cache(maxsize=1024)
def _nonempty(cls: str) -> bool:
    return bool(class_ranges(cls))


def rules(text: str) -> dict[str, list[str]]:
    """Rule name -> the tokens of its body, from a printed grammar."""
    toks = list(tokens(text))
    starts = [i for i in range(len(toks) - 2) if toks[i + 2 if toks[i + 1].isspace() else i + 1] == "::="
              and toks[i][0].isalpha() and (i == 0 or "\n" in toks[i - 1])]
    out = {}
    for k, i in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else len(toks)
        body = toks[i + 1:end]
        out[toks[i]] = body[body.index("::=") + 1:]
    return out


def productive(text: str, root: str = "root") -> bool:
    """Whether rule ``root`` of the printed grammar derives any string: the least fixpoint of "a rule is
    productive when one of its alternatives is a sequence of productive items" (a literal is, a class is
    when non-empty, a repetition is when it may repeat zero times or its item is). Each rule is evaluated
    again only when a rule it names has become productive."""
    trees = {name: _Reader(body, regex_productive).expr() for name, body in rules(text).items()}
    users: dict[str, set[str]] = {}
    for name, tree in trees.items():
        stack = [tree]
        while stack:
            node = stack.pop()
            if node[0] == "ref":
                users.setdefault(node[1], set()).add(name)
            elif node[0] in ("alt", "seq"):
                stack.extend(node[1])
            elif node[0] == "rep":
                stack.append(node[2])
    done: set[str] = set()
    pending = set(trees)
    while pending:  # in rounds, so that a rule naming many others is evaluated once a round, not once each
        found = {name for name in pending if _derives(trees[name], done)}
        done |= found
        pending = {user for name in found for user in users.get(name, ()) if user not in done}
    return root in done


def _derives(tree: tuple, done: set[str]) -> bool:
    kind = tree[0]
    if kind == "lit":
        return True
    if kind == "cls":
        return tree[1]
    if kind == "ref":
        return tree[1] in done
    if kind == "rep":
        return tree[1] == 0 or _derives(tree[2], done)
    if kind == "seq":
        return all(_derives(t, done) for t in tree[1])
    return any(_derives(t, done) for t in tree[1])


def regex_productive(pattern: str) -> bool:
    """Whether an xgrammar regex matches any string (through xgrammar's own reading of it)."""
    import xgrammar

    return productive(str(xgrammar.Grammar.from_regex(pattern)))
