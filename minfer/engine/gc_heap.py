"""Leaving the objects alive when an engine loop starts out of Python's cyclic garbage collector while it runs.

By the time an engine runs, the process holds hundreds of thousands of long-lived objects (the model's modules and
parameters, the tokenizer, torch's and transformers' module state, a server's routes). The collector's oldest
generation walks all of them, and a full collection comes whenever enough new objects have survived: every few
seconds under a server's load, holding the GIL for as long as the walk takes (a tenth of a second and more, while
the engine thread launches no step: ``dev/server_overhead.py``, benchmarks/RESULTS.md). ``gc.freeze`` moves every
object alive now to a permanent generation that collections skip (vLLM freezes its engine process's start-up heap
the same way), so they walk only what the run itself allocated. A frozen object that becomes cyclic garbage is not
freed while frozen, so the freeze lasts only as long as the loop: ``gc.unfreeze`` at its end hands everything back
to the collector (and ends any freeze another loop in the process began, which costs only that loop its shorter
pauses).
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def heap_frozen() -> Iterator[None]:
    """Run the block with the objects alive at its start frozen out of the cyclic collector (module docstring)."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
