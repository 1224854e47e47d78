"""minfer: a compact, fast LLM inference engine for Llama-family models (PyTorch + Triton)."""
from minfer.llm import LLM
from minfer.outputs import CompletionOutput, RequestOutput
from minfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
