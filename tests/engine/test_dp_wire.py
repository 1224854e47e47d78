"""A replica's step outputs as tuples (``minfer/engine/dp/wire.py``): every field survives the trip through pickle,
and what is not a plain ``RequestOutput`` (a pooling output with its vector) goes as itself."""
from __future__ import annotations

import pickle

import torch

from minfer.engine.dp.wire import decode_outputs, encode_outputs
from minfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minfer.pooling_outputs import PoolingRequestOutput


def test_outputs_round_trip_through_the_wire_form() -> None:
    full = RequestOutput(
        "a", "prompt text", [5, 6, 7],
        [CompletionOutput(0, "xy", [1, 2], -1.5, [{1: -0.5, 9: -2.0}, {2: -1.0}], "stop", "</s>", 4, "thinking"),
         CompletionOutput(1, "", [], None, None)],
        True, RequestMetrics(1.0, 2.0, 3.0, 4.0), [None, {6: -0.25}, {7: -3.0}])
    delta = RequestOutput("b", None, [], [CompletionOutput(0, "z", [3], None, None, token_offset=12)], False,
                          RequestMetrics(5.0))
    pooled = PoolingRequestOutput("c", None, [1], [CompletionOutput(0, "", [], None, None, "stop")], True,
                                  data=torch.arange(4.0))
    rows = pickle.loads(pickle.dumps(encode_outputs([full, delta, pooled])))
    assert isinstance(rows[0], tuple) and isinstance(rows[1], tuple) and rows[2] is not pooled
    got = decode_outputs(rows)
    assert got[0] == full and got[1] == delta
    assert type(got[2]) is PoolingRequestOutput and got[2].request_id == "c" and torch.equal(got[2].data, pooled.data)
