"""minfer: a compact, fast LLM inference engine for Llama-family models (PyTorch + Triton).

``LLM`` and vLLM's engine classes (``LLMEngine``, ``AsyncLLMEngine``, ``EngineArgs``) are imported on first use:
the engines pull in torch, and ``minfer --help`` (which imports this package) should not wait for them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minfer.beam_search import BeamSearchParams
from minfer.outputs import CompletionOutput, RequestOutput
from minfer.pooling_outputs import EmbeddingOutput, EmbeddingRequestOutput, PoolingRequestOutput
from minfer.pooling_params import PoolingParams
from minfer.sampling_params import SamplingParams
from minfer.structured_outputs import StructuredOutputsParams
from minfer.version import __version__  # noqa: F401 - minfer.__version__

if TYPE_CHECKING:
    from minfer.engine.async_engine import AsyncLLMEngine
    from minfer.engine.llm_engine import LLMEngine
    from minfer.engine_args import AsyncEngineArgs, EngineArgs
    from minfer.llm import LLM
    from minfer.lora.request import LoRARequest

__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "BeamSearchParams", "PoolingParams", "EmbeddingOutput", "EmbeddingRequestOutput", "PoolingRequestOutput"]
__all__ += ["EngineArgs", "AsyncEngineArgs", "LLMEngine", "AsyncLLMEngine"]  # vLLM's engine classes


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from minfer.llm import LLM

        return LLM
    if name == "LoRARequest":  # its package loads torch
        from minfer.lora.request import LoRARequest

        return LoRARequest
    if name in ("EngineArgs", "AsyncEngineArgs"):
        from minfer.engine_args import AsyncEngineArgs, EngineArgs

        return EngineArgs if name == "EngineArgs" else AsyncEngineArgs
    if name == "LLMEngine":
        from minfer.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncLLMEngine":
        from minfer.engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
