"""A corpus of JSON schemas for the structured-outputs tests, generated: every string-producing path of the
grammar (length-bounded strings, patterns, formats, enums and consts with control characters, property
names, pattern properties) alone and inside objects, arrays, ``$ref``s and ``additionalProperties``."""
from __future__ import annotations

from typing import Any

BOUNDS = [(None, 1), (None, 4), (None, 12), (1, None), (3, 8), (0, 0), (2, 2), (5, 40)]
PATTERNS = ["^[a-z]{1,6}$", "^a.b$", '^[ -~]{1,5}$', "^\\S+$", "^[^x]{2,4}$", "^\\w\\W\\w$", '^a"b$',
            "^(?:\\\\|/)+$", "^\\d{2}-\\d{2}$", "^[\\x00-\\x1f]{1,3}$", "^.{0,6}$", "^\\s?\\D+$", "x"]
FORMATS = ["date", "time", "date-time", "email", "uuid", "hostname", "uri", "ipv6", "duration"]
ENUMS = [["a\u0001b", "tab\there", "new\nline"], ['quote"d', "back\\slash", "\u001f"], ["é", "日本", "\u007f"]]


def _string(low: int | None, high: int | None) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"}
    if low is not None:
        s["minLength"] = low
    if high is not None:
        s["maxLength"] = high
    return s


def leaves() -> list[dict[str, Any]]:
    """Schemas of one string each."""
    out = [_string(lo, hi) for lo, hi in BOUNDS]
    out += [{"type": "string", "pattern": p} for p in PATTERNS]
    out += [{"type": "string", "format": f} for f in FORMATS]
    out += [{"enum": e} for e in ENUMS] + [{"const": "c\u0000t\"\\"}, {"const": "\r\n"}]
    return out


def corpus() -> list[dict[str, Any]]:
    """Over a hundred schemas, each a JSON object at its root."""
    out: list[dict[str, Any]] = []
    for i, leaf in enumerate(leaves()):
        out.append({"type": "object", "properties": {"v": leaf}, "required": ["v"], "additionalProperties": False})
        out.append({"type": "array", "items": leaf, "minItems": 1, "maxItems": 3})
        if i % 2 == 0:
            out.append({"$defs": {"Leaf": leaf}, "type": "object",
                        "properties": {"a": {"$ref": "#/$defs/Leaf"}, "b": {"type": "array", "items": {"$ref": "#/$defs/Leaf"}}},
                        "required": ["a", "b"], "additionalProperties": False})
        else:
            out.append({"type": "object", "additionalProperties": leaf, "maxProperties": 2})
    for lo, hi in BOUNDS:
        out.append({"type": "object", "propertyNames": _string(lo or 1, hi or 6),
                    "additionalProperties": {"type": "integer"}, "maxProperties": 2})
    for p in PATTERNS[:8]:
        out.append({"type": "object", "patternProperties": {p: {"type": "boolean"}}, "maxProperties": 2})
    out.append({"type": "object", "properties": {
        "name": _string(1, 10), "tags": {"type": "array", "items": _string(None, 3), "maxItems": 3},
        "kind": {"enum": ENUMS[0]}, "when": {"type": "string", "format": "date"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}\\d$"}, "extra": {"anyOf": [_string(2, 4), {"type": "null"}]}},
        "required": ["name", "tags", "kind", "code"], "additionalProperties": False})
    return out
