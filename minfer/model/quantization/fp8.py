"""FP8 (e4m3) weights: the config, the linear method, the activation format and the experts' loading.

Two layouts reach the layers:
- **channel**: e4m3 weights ``[N, K]`` with one float32 dequantization scale per output row
  (``w ≈ q * scale[n]``); activations quantized per token on the fly, or with the checkpoint's static
  per-tensor ``input_scale``. A per-tensor weight scale is this layout with the scale repeated: that
  is how q, k and v (each with its own scale) fuse into one matrix.
- **block**: e4m3 weights with a scale per 128×128 block, stored expanded to one row of
  ``ceil(K/128)`` scales per output row (``[N, ceil(K/128)]``), so shards fuse and split by rows like
  the weights; activations quantized per token per 128-column group.

Sources: ``quantization="fp8"`` on a float checkpoint (channel, quantized while loading: ``online``), and
``quant_method: fp8`` (block with ``weight_block_size: [128, 128]``, as the official Qwen3 and DeepSeek
FP8 checkpoints; per tensor without); compressed-tensors' float-quantized schemes come here through
``compressed_tensors.py``. ``Ops.fp8_linear`` multiplies, and the norms and SwiGLU before an FP8 layer
emit its e4m3 input from their own kernels (``Fp8Activations``).

A MoE block's FP8 experts are dequantized to the model dtype as they load, one expert matrix at a time
(``Fp8Experts``): the fused MoE kernels multiply in the model dtype. Online FP8 leaves experts in float.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from minfer.model.quantization.base import (UNQUANTIZED, Activation, ActivationQuant, ExpertMethod, LinearMethod,
                                            QuantConfig)
from minfer.ops import Ops

BLOCK = 128  # the block format's block edge (rows and columns) and activation group size
E4M3_MAX = 448.0


@dataclass(frozen=True, slots=True)
class Fp8Config(QuantConfig):
    block: bool  # 128x128 block scales (else one scale per output row)
    online: bool = False  # float weights in the checkpoint: quantize them while loading
    static_input_scale: bool = False  # activations use the checkpoint's per-tensor input_scale
    ignore: tuple[str, ...] = field(default=())  # HF module names / 're:' patterns left in the model dtype

    @property
    def name(self) -> str:  # type: ignore[override]
        return "fp8_e4m3 " + ("128x128 blocks" if self.block else "per channel") + (" (online)" if self.online else "")

    def linear_method(self, checkpoint_modules: list[str]) -> LinearMethod:
        ignored = [self._ignored(n) for n in checkpoint_modules]
        if any(ignored) and not all(ignored):
            raise ValueError(f"quantization_config ignores some of {checkpoint_modules} but not all; minfer fuses "
                             f"them into one matrix, which must be quantized as a whole")
        return UNQUANTIZED if ignored[0] else Fp8Linear(self)

    def expert_method(self) -> ExpertMethod | None:
        return None if self.online else Fp8Experts(self.block)

    def _ignored(self, name: str) -> bool:
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], name) or re.fullmatch(pattern[3:], "model." + name):
                    return True
            elif pattern in (name, "model." + name) or name.endswith("." + pattern):
                return True
        return False


def online(requested: str) -> Fp8Config:
    """``quantization="fp8"`` on a float checkpoint."""
    return Fp8Config(block=False, online=True)


def from_fp8_config(qc: dict[str, Any]) -> Fp8Config:
    """config.json's ``quantization_config`` with ``quant_method: fp8``."""
    ignore = tuple(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ())
    block = qc.get("weight_block_size")
    if block is not None:
        if list(block) != [BLOCK, BLOCK]:
            raise ValueError(f"fp8 weight_block_size {block} is not supported (only [128, 128])")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("fp8 block checkpoints with static activation scales are not supported")
        return Fp8Config(block=True, ignore=ignore)
    static = qc.get("activation_scheme", "dynamic") == "static"
    return Fp8Config(block=False, static_input_scale=static, ignore=ignore)


class Fp8Activations(ActivationQuant):
    """e4m3 codes with float32 scales per token (or per token and 128-column group), emitted by the
    producer's fused kernel."""

    def __init__(self, block: bool) -> None:
        self.block = block

    def rms_norm(self, ops: Ops, x: torch.Tensor, weight: torch.Tensor, eps: float) -> Activation:
        return ops.rms_norm_fp8(x, weight, eps, self.block)

    def add_rms_norm(self, ops: Ops, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[Activation, torch.Tensor]:
        return ops.add_rms_norm_fp8(x, residual, weight, eps, self.block)

    def silu_and_mul(self, ops: Ops, x: torch.Tensor) -> Activation:
        return ops.silu_and_mul_fp8(x, self.block)


class Fp8Linear(LinearMethod):
    """e4m3 weights with float32 ``weight_scale`` (per row, or per row and 128-column block) and, for a
    static scheme, the checkpoint's ``input_scale``."""

    def __init__(self, config: Fp8Config) -> None:
        self.config = config
        # a static input scale is applied in the product; otherwise the layer before emits e4m3
        self.input_quant = None if config.static_input_scale else Fp8Activations(config.block)

    def create_weights(self, layer: nn.Module, rows: int, in_features: int, dtype: torch.dtype) -> None:
        cfg = self.config
        if cfg.block and (layer.cols_from or 0) % BLOCK:
            raise ValueError(f"block FP8 needs each tensor-parallel rank's share of the input features ({in_features}) "
                             f"to start on a {BLOCK}-column block: use a smaller tensor_parallel_size")
        layer.weight = nn.Parameter(torch.empty(rows, in_features, dtype=torch.float8_e4m3fn), requires_grad=False)
        scale_shape = (rows, -(-in_features // BLOCK)) if cfg.block else (rows,)
        layer.weight_scale = nn.Parameter(torch.ones(scale_shape, dtype=torch.float32), requires_grad=False)
        layer.input_scale = nn.Parameter(torch.zeros(1), requires_grad=False) if cfg.static_input_scale else None

    def checkpoint_tensors(self) -> list[str]:
        if self.config.online:
            return []
        return ["weight_scale"] + (["input_scale"] if self.config.static_input_scale else [])

    def convert_weight(self, layer: nn.Module, tensor: torch.Tensor, row_start: int) -> torch.Tensor:
        if not self.config.online:
            return tensor
        codes, scale = quantize_rows(tensor)
        layer.weight_scale.data.narrow(0, row_start, len(scale)).copy_(scale)
        return codes

    def load_tensor(self, layer: nn.Module, name: str, source: Any, shard: int) -> str | None:
        """A scale of a pre-quantized checkpoint: per tensor, per row ([n] or [n, 1]) or per 128x128 block,
        into this rank's rows (block scales repeated down the rows of their block)."""
        if name == "weight_zero_point":  # symmetric FP8 stores none, or zeros
            return None
        tensor = source[:].float()
        if name == "input_scale":  # q, k and v share their input: the largest scale covers all three
            scale = layer.input_scale.data
            scale.copy_(torch.maximum(scale, tensor.reshape(-1)[:1].to(scale.device)))
            return name
        if name not in ("weight_scale", "weight_scale_inv"):
            raise ValueError(f"unexpected quantization tensor {name!r}")
        start, size, first = sum(layer.shard_sizes[:shard]), layer.shard_sizes[shard], layer.rows_from[shard]
        target = layer.weight_scale.data.narrow(0, start, size)
        rows = torch.arange(first, first + size)
        if self.config.block:
            col_block = (layer.cols_from or 0) // BLOCK
            target.copy_(tensor[rows // BLOCK][:, col_block:col_block + target.shape[1]])
        elif tensor.numel() == 1:  # per tensor
            target.fill_(float(tensor.reshape(-1)[0]))
        else:
            target.copy_(tensor.reshape(-1)[rows])
        return "weight_scale"

    def apply(self, layer: nn.Module, x: Activation, bias: torch.Tensor | None) -> torch.Tensor:
        return layer.ops.fp8_linear(x, layer.weight, layer.weight_scale, layer.input_scale, bias, self.config.block)


class Fp8Experts(ExpertMethod):
    """An expert matrix's e4m3 codes and scales, kept until both have come, then dequantized."""

    def __init__(self, block: bool) -> None:
        self.block = block
        self._pending: dict[tuple[str, int], dict[str, torch.Tensor]] = {}

    def checkpoint_tensors(self) -> list[str]:
        return ["weight_scale"]

    def load(self, key: tuple[str, int], part: str, source: Any) -> torch.Tensor | None:
        if part == "input_scale":  # experts multiply in the model dtype: no activation scale
            return None
        pending = self._pending.setdefault(key, {})
        pending["scale" if part.startswith("weight_scale") else "codes"] = source[:]
        if len(pending) < 2:
            return None
        del self._pending[key]
        return dequantize(pending["codes"], pending["scale"].float(), self.block)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online quantization: e4m3 rows and their float32 dequantization scales (max |w| of the row → 448)."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / E4M3_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, block: bool) -> torch.Tensor:
    """A whole matrix from its e4m3 codes: scales per 128x128 block, per row ([n, 1]) or per tensor."""
    w = codes.float()
    if block:
        n, k = w.shape
        return w * scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    return w * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(1, 1))
