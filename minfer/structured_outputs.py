"""StructuredOutputsParams: the shape a request's output must take (vLLM's names), and its checks.

The engine forces the output through xgrammar (``minfer.engine.grammar``); this module decides whether a
request's constraint is acceptable, so a bad one is an error naming its field before it is queued. The
check (``_check``, cached by the constraint's key) runs, in order: the size limits
(``minfer.structured_limits``), JSON Schema validity (the ``jsonschema`` library), the allow-list of
keywords xgrammar enforces, and building the grammar with a non-empty language
(``minfer.structured_grammar``: ``build_grammar`` is also what the engine compiles).

Construction checks the shape, and the rest at once against the default limits when the constraint is
within them (so a bad schema is an error where it is written); the engine checks every request against
its own limits (``Processor``), which also covers a constraint past the defaults that a raised limit allows.
"""
from __future__ import annotations

import functools
import json as jsonlib
from dataclasses import dataclass, field

from minfer.structured_grammar import check_builds, check_keywords
from minfer.structured_limits import DEFAULT_LIMITS, LimitError, StructuredOutputsLimits, check_limits

KINDS = ("json", "regex", "choice", "grammar", "json_object")
CHECK_CACHE_SIZE = 256  # constraints whose check passed, kept so that a resent one skips it


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON Schema, as a dict or its JSON text), ``regex`` (the whole output
    matches it), ``choice`` (the output is one of these strings), ``grammar`` (an EBNF grammar in
    xgrammar's syntax, ``root ::= ...``), ``json_object=True`` (any JSON object).

    JSON may carry whitespace between tokens (at most ``structured_grammar.MAX_WHITESPACE`` characters in a
    row: models, weak ones especially, can otherwise emit whitespace until ``max_tokens``);
    ``disable_any_whitespace`` (vLLM's name) allows no free whitespace: only xgrammar's fixed separators
    ``", "`` and ``": "``.

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
    (``check_builds``). Cached: agents resend the same schema every turn. A failure raises each time
    (``lru_cache`` keeps results only)."""
    check_limits(kind, grammar_kind, text, limits)
    if grammar_kind in ("json", "json_compact"):
        schema = jsonlib.loads(text)
        _check_meta_schema(schema)
        if isinstance(schema, dict):
            check_keywords(schema, "#")
    check_builds(kind, grammar_kind, text)


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
