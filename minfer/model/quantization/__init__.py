"""Weight formats as methods (``base.py``): which ``QuantConfig`` a checkpoint's ``quantization_config``
(or the engine's ``quantization`` argument) selects.

A new format is a module here with a config parser and its methods, and one line in each table below.
"""
from __future__ import annotations

from typing import Any, Callable

from minfer.model.quantization import compressed_tensors, fp8, mxfp4
from minfer.model.quantization.base import QuantConfig

# config.json's quantization_config.quant_method -> its parser
CHECKPOINT_FORMATS: dict[str, Callable[[dict[str, Any]], QuantConfig]] = {
    "compressed-tensors": compressed_tensors.from_config,
    "fp8": fp8.from_fp8_config,
    "mxfp4": mxfp4.from_config,
}
# the engine's quantization= on a float checkpoint -> its config (config.QUANTIZATION_METHODS lists the names)
ONLINE_FORMATS: dict[str, Callable[[str], QuantConfig]] = {
    "fp8": fp8.online,
}
SUPPORTED = ("quantization='fp8' (online, per channel)", compressed_tensors.SUPPORTED,
             "fp8 with weight_block_size [128, 128] (Qwen3-FP8 / DeepSeek style) or per-tensor",
             "mxfp4 (gpt-oss: MoE experts)")


def resolve_quantization(quantization_config: dict[str, Any] | None, requested: str | None) -> QuantConfig | None:
    """The format of a model's weights: the checkpoint's own, else the engine's request, else None (float)."""
    if quantization_config is None:
        return ONLINE_FORMATS[requested](requested) if requested is not None else None
    method = quantization_config.get("quant_method")
    parse = CHECKPOINT_FORMATS.get(method)
    if parse is None:
        raise ValueError(f"unsupported quantization method {method!r} in config.json's quantization_config; "
                         f"minfer loads: {'; '.join(SUPPORTED)}")
    return parse(quantization_config)
