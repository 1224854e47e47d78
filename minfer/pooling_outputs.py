"""What an embedding request returns: the engine's ``PoolingRequestOutput`` and ``LLM.embed``'s
``EmbeddingRequestOutput`` (vLLM's shape: ``.outputs.embedding``, a list of floats)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minfer.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass(slots=True)
class PoolingRequestOutput(RequestOutput):
    """A pooling request's one, final output from ``LLMEngine.step``: ``data`` is the pooled vector (a float32
    CPU tensor). It is a ``RequestOutput`` with one empty completion (finish reason 'stop', no tokens), so that
    what carries and counts the engine's outputs (the server's streams, its metrics) takes it as it is; vLLM's
    engine-level class holds the vector in ``outputs.data`` instead."""

    data: Any = None

    @classmethod
    def make(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int], data: Any,
             metrics: RequestMetrics) -> "PoolingRequestOutput":
        done = CompletionOutput(0, "", [], None, None, "stop")
        return cls(request_id, prompt, prompt_token_ids, [done], True, metrics, None, data)


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's ``EmbeddingRequestOutput``)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(output.request_id, EmbeddingOutput(output.data.tolist()), output.prompt_token_ids,
                   output.finished)
