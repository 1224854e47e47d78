"""minfer: a compact, fast LLM inference engine for Llama-family models (PyTorch + Triton).

``LLM`` is imported on first use: it pulls in torch and the engine, and ``minfer --help`` (which
imports this package) should not wait for them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from minfer.outputs import CompletionOutput, RequestOutput
from minfer.sampling_params import SamplingParams
from minfer.structured_outputs import StructuredOutputsParams
from minfer.version import __version__  # noqa: F401 - minfer.__version__

if TYPE_CHECKING:
    from minfer.llm import LLM
    from minfer.lora.request import LoRARequest

__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from minfer.llm import LLM

        return LLM
    if name == "LoRARequest":  # its package loads torch
        from minfer.lora.request import LoRARequest

        return LoRARequest
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
