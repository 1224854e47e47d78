"""compressed-tensors checkpoints (``quant_method: compressed-tensors``): the float-quantized FP8 schemes.

Weights per tensor, per channel or per 128×128 block; activations dynamic per token (or per group, for
blocks), static per tensor, or none (weight-only, quantized per token here). Every config group must use
the same scheme: minfer fuses q/k/v and gate/up, which must share one.
"""
from __future__ import annotations

from typing import Any

from minfer.model.quantization.fp8 import BLOCK, Fp8Config

SUPPORTED = ("compressed-tensors float-quantized FP8 (per tensor, per channel or 128x128 blocks; dynamic per-token "
             "or static per-tensor activations)")


def from_config(qc: dict[str, Any]) -> Fp8Config:
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    schemes = {_scheme_key(g, fmt) for g in groups}
    if len(schemes) > 1:
        raise ValueError(f"compressed-tensors checkpoints with different schemes per layer group are not supported "
                         f"({len(schemes)} schemes)")
    block, static = schemes.pop()
    return Fp8Config(block=block, static_input_scale=static, ignore=tuple(qc.get("ignore") or ()))


def _scheme_key(group: dict[str, Any], default_format: str | None) -> tuple[bool, bool]:
    """(block scales, static input scale) of one config group."""
    fmt = group.get("format") or default_format
    w, a = group.get("weights") or {}, group.get("input_activations")
    if fmt != "float-quantized" or w.get("type") != "float" or w.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors format {fmt!r} with {w.get('num_bits')}-bit {w.get('type')} weights is "
                         f"not supported; minfer loads: {SUPPORTED}")
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
