"""A step's outputs as a replica sends them: plain tuples rather than pickled dataclasses.

Under the server a replica sends every step's delta for every running request, so the pickling runs once per token
on the replica's engine thread and the unpickling on the API process's receiver thread, each under its process's
GIL. ``pickle`` stores a dataclass instance as its class and its state, rebuilt field by field; the same fields as
tuples of plain values pickle several times faster and load faster even with the objects rebuilt here
(benchmarks/RESULTS.md, "continued without a device"). Only plain ``RequestOutput`` and ``CompletionOutput`` take
this form; any subclass (a pooling output and its vector) goes as itself.
"""
from __future__ import annotations

import dataclasses
from operator import attrgetter
from typing import Any

from minfer.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _getter(cls: type) -> attrgetter:
    return attrgetter(*(f.name for f in dataclasses.fields(cls)))


_REQUEST, _COMPLETION, _METRICS = _getter(RequestOutput), _getter(CompletionOutput), _getter(RequestMetrics)
_OUTPUTS = [f.name for f in dataclasses.fields(RequestOutput)].index("outputs")
_METRICS_AT = [f.name for f in dataclasses.fields(RequestOutput)].index("metrics")


def encode_outputs(outputs: list[RequestOutput]) -> list[Any]:
    """``outputs`` as tuples of their fields in declaration order (a subclass's instance as itself)."""
    rows: list[Any] = []
    for out in outputs:
        if type(out) is not RequestOutput or any(type(c) is not CompletionOutput for c in out.outputs):
            rows.append(out)
            continue
        row = list(_REQUEST(out))
        row[_OUTPUTS] = [_COMPLETION(c) for c in out.outputs]
        row[_METRICS_AT] = _METRICS(out.metrics)
        rows.append(tuple(row))
    return rows


def decode_outputs(rows: list[Any]) -> list[RequestOutput]:
    """The outputs ``encode_outputs`` gave ``rows`` for."""
    outputs: list[RequestOutput] = []
    for row in rows:
        if not isinstance(row, tuple):
            outputs.append(row)
            continue
        fields = list(row)
        fields[_OUTPUTS] = [CompletionOutput(*c) for c in fields[_OUTPUTS]]
        fields[_METRICS_AT] = RequestMetrics(*fields[_METRICS_AT])
        outputs.append(RequestOutput(*fields))
    return outputs
