"""Which checkpoint tensors a model load reads: the loader's tensor source wrapped so every read is recorded."""
from __future__ import annotations

from typing import Any

import pytest

from minfer.model import loader


class _Recorded:
    """A safetensors slice that records its tensor's name when any part of it is read."""

    def __init__(self, name: str, source: Any, read: list[str]) -> None:
        self.name, self.source, self.read = name, source, read

    def __getitem__(self, index: Any) -> Any:
        self.read.append(self.name)
        return self.source[index]

    def get_shape(self) -> Any:
        return self.source.get_shape()


def record_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """From now on (in this test), the names of the tensors the loader reads, appended as they are read."""
    real, read = loader._checkpoint_tensors, []
    monkeypatch.setattr(loader, "_checkpoint_tensors",
                        lambda folder: ((n, _Recorded(n, s, read), w) for n, s, w in real(folder)))
    return read
