"""Which FP8 weight format a model's linear layers use, read once from its config.

Two layouts reach the layers (``FusedLinear`` holds them; ``Ops.fp8_linear`` multiplies):
- **channel**: e4m3 weights ``[N, K]`` with one float32 dequantization scale per output row
  (``w ≈ q * scale[n]``); activations quantized per token on the fly, or with the checkpoint's static
  per-tensor ``input_scale``. A per-tensor weight scale is this layout with the scale repeated: that
  is how q, k and v (each with its own scale) fuse into one matrix.
- **block**: e4m3 weights with a scale per 128×128 block, stored expanded to one row of
  ``ceil(K/128)`` scales per output row (``[N, ceil(K/128)]``), so shards fuse and split by rows like
  the weights; activations quantized per token per 128-column group.

Sources: ``quantization="fp8"`` on a bf16/fp16/fp32 checkpoint (channel, quantized while loading);
``quant_method: compressed-tensors`` with ``format: float-quantized`` (channel or tensor weight
scales, dynamic per-token or static per-tensor activations, or its 128×128 block strategy); and
``quant_method: fp8`` (block with ``weight_block_size: [128, 128]``, as the official Qwen3 and
DeepSeek FP8 checkpoints; per-tensor without). Anything else fails at load, naming what is supported.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from minfer.config import ModelConfig

BLOCK = 128  # the block format's block edge (rows and columns) and activation group size
SUPPORTED = ("quantization='fp8' (online, per channel)", "compressed-tensors float-quantized FP8 (per tensor, "
             "per channel or 128x128 blocks; dynamic per-token or static per-tensor activations)",
             "fp8 with weight_block_size [128, 128] (Qwen3-FP8 / DeepSeek style) or per-tensor")


@dataclass(frozen=True, slots=True)
class Fp8Format:
    block: bool  # 128x128 block scales (else one scale per output row)
    online: bool = False  # float weights in the checkpoint: quantize them while loading
    static_input_scale: bool = False  # activations use the checkpoint's per-tensor input_scale
    scale_name: str = "weight_scale"  # the checkpoint's scale tensors' name ('weight_scale_inv' for fp8 blocks)
    ignore: tuple[str, ...] = field(default=())  # HF module names / 're:' patterns left in the model dtype

    @property
    def name(self) -> str:
        return "fp8_e4m3 " + ("128x128 blocks" if self.block else "per channel") + (" (online)" if self.online else "")

    def quantizes(self, hf_module_names: list[str]) -> bool:
        """Whether a fused layer made of these checkpoint modules is FP8 (all of them or none must be)."""
        ignored = [self._ignored(n) for n in hf_module_names]
        if any(ignored) and not all(ignored):
            raise ValueError(f"quantization_config ignores some of {hf_module_names} but not all; minfer fuses "
                             f"them into one matrix, which must be quantized as a whole")
        return not ignored[0]

    def _ignored(self, name: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], name) or re.fullmatch(pattern[3:], "model." + name):
                    return True
            elif pattern in (name, "model." + name) or name.endswith("." + pattern):
                return True
        return False


def resolve_quantization(config: ModelConfig, requested: str | None) -> Fp8Format | None:
    """The FP8 format of this model's linear layers, or None for plain float weights."""
    qc = config.quantization_config
    if qc is None:
        return Fp8Format(block=False, online=True) if requested == "fp8" else None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":
        return _fp8(qc)
    raise ValueError(f"unsupported quantization method {method!r} in config.json's quantization_config; minfer "
                     f"loads: {'; '.join(SUPPORTED)}")


def _fp8(qc: dict[str, Any]) -> Fp8Format:
    ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    block = qc.get("weight_block_size")
    if block is not None:
        if list(block) != [BLOCK, BLOCK]:
            raise ValueError(f"fp8 weight_block_size {block} is not supported (only [128, 128])")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("fp8 block checkpoints with static activation scales are not supported")
        return Fp8Format(block=True, scale_name="weight_scale_inv", ignore=ignore)
    static = qc.get("activation_scheme", "dynamic") == "static"
    return Fp8Format(block=False, static_input_scale=static, ignore=ignore)


def _compressed_tensors(qc: dict[str, Any]) -> Fp8Format:
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    schemes = {_scheme_key(g, fmt) for g in groups}
    if len(schemes) > 1:
        raise ValueError(f"compressed-tensors checkpoints with different schemes per layer group are not supported "
                         f"({len(schemes)} schemes)")
    block, static = schemes.pop()
    return Fp8Format(block=block, static_input_scale=static, ignore=tuple(qc.get("ignore") or ()))


def _scheme_key(group: dict[str, Any], default_format: str | None) -> tuple[bool, bool]:
    fmt = group.get("format") or default_format
    w, a = group.get("weights") or {}, group.get("input_activations")
    if fmt != "float-quantized" or w.get("type") != "float" or w.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors format {fmt!r} with {w.get('num_bits')}-bit {w.get('type')} weights is "
                         f"not supported; minfer loads: {'; '.join(SUPPORTED)}")
    strategy = w.get("strategy")
    if strategy == "block":
        if list(w.get("block_structure") or []) != [BLOCK, BLOCK]:
            raise ValueError(f"compressed-tensors block_structure {w.get('block_structure')} is not supported "
                             f"(only [128, 128])")
        if a is not None and not a.get("dynamic", False):
            raise ValueError("compressed-tensors block FP8 with static activation scales is not supported")
        return True, False
    if strategy not in ("channel", "tensor"):
        raise ValueError(f"compressed-tensors FP8 weight strategy {strategy!r} is not supported "
                         f"(tensor, channel or block)")
    if a is None or a.get("dynamic", False):  # weight-only, or dynamic: quantized per token here
        return False, False
    if a.get("strategy") != "tensor" or a.get("type") != "float" or a.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors static activations with strategy {a.get('strategy')!r} are not "
                         f"supported (only per-tensor FP8)")
    return False, True


E4M3_MAX = 448.0


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online quantization: e4m3 rows and their float32 dequantization scales (max |w| of the row → 448)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale

