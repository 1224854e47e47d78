"""A request's output constraint (``response_format``, vLLM's ``structured_outputs`` or ``guided_*``, or the
schema a tool choice compiles to) as the engine's ``StructuredOutputsParams``.

Constructing it checks the constraint (a valid schema of supported keywords, a regex or grammar that
parses), which builds the grammar once (milliseconds; more for a large schema): callers run it on the
tokenizer pool. Its errors name ``structured_outputs.<kind>``; they are rewritten to name the field the
client actually sent (``response_format.json_schema.schema``, ``guided_regex``, ``tools``, ...).
"""
from __future__ import annotations

import re
from typing import Any

from minfer.sampling_params import StructuredOutputsParams
from minfer.server.errors import APIError
from minfer.server.request_fields import SamplingFields

_ENGINE_MESSAGE = re.compile(r"^structured_outputs(\.[a-z_]+)?:? ?(.*)$", re.S)


def request_constraint(req: SamplingFields) -> tuple[dict[str, Any], str] | None:
    """The ``StructuredOutputsParams`` arguments of the request's one constraint, and the field that set
    them (None without one; the protocol has refused two)."""
    rf, so = req.response_format, req.structured_outputs
    if rf is not None and rf.type == "json_object":
        return {"json_object": True}, "response_format"
    if rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        return {"json": rf.json_schema.schema_}, "response_format.json_schema.schema"
    if so is not None:
        kw = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
              "json_object": bool(so.json_object), "disable_any_whitespace": so.disable_any_whitespace}
        return kw, "structured_outputs"
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            return {kind: value}, name
    return None


def build(kwargs: dict[str, Any], field: str) -> StructuredOutputsParams:
    """``StructuredOutputsParams(**kwargs)``; its refusal is a 400 naming ``field``."""
    try:
        params = StructuredOutputsParams(**kwargs)
    except ValueError as exc:
        raise constraint_error(exc, field) from exc
    params.source = field + ("." + params.kind if field == "structured_outputs" else "")
    return params


def constraint_error(exc: ValueError, field: str) -> APIError:
    """The engine's ``structured_outputs.<kind>: why`` as a 400 on ``field``. On the ``structured_outputs``
    extra itself the kind stays in the parameter (``structured_outputs.regex``)."""
    match = _ENGINE_MESSAGE.match(str(exc))
    if match is None:
        return APIError(400, f"{field}: {exc}", field)
    kind, why = match.group(1) or "", match.group(2)
    if field == "structured_outputs":
        return APIError(400, str(exc), field + kind)
    return APIError(400, f"{field}: {why}", field)
