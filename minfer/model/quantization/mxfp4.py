"""MXFP4 checkpoints (gpt-oss): MoE expert matrices in the OCP microscaling format, everything else in bf16.

A matrix ``[N, K]`` is stored as ``*_blocks`` (uint8 ``[N, K / 32, 16]``: two e2m1 codes a byte, the low nibble
the even column) and ``*_scales`` (uint8 ``[N, K / 32]``: an e8m0 exponent, 2^(s - 127), per 32 columns). The
experts stay in that format in memory (a quarter of bf16's bytes, which is what a decode step reads), and
the fused MoE op expands them in registers (``ops.fused_moe`` with ``MoeExperts`` scales); the torch path
dequantizes them (``kernels/quant/mxfp4_ref.py``).

``quantization_config.modules_to_not_convert`` names the modules left in bf16 (globs such as
``model.layers.*.self_attn``). Released checkpoints quantize the experts only; a linear layer the config
would quantize has no MXFP4 method here, and is refused naming it.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any

from minfer.model.quantization.base import UNQUANTIZED, ExpertMethod, LinearMethod, QuantConfig

BLOCK = 32  # columns per e8m0 scale
CODES_PER_BYTE = 2


@dataclass(frozen=True, slots=True)
class Mxfp4Config(QuantConfig):
    not_converted: tuple[str, ...] = field(default=())
    random_weights = True  # random bytes are valid codes and scales (random_weights.stored_dtype)

    @property
    def name(self) -> str:  # type: ignore[override]
        return "mxfp4 experts"

    def linear_method(self, checkpoint_modules: list[str]) -> LinearMethod:
        for module in checkpoint_modules:
            if not self._not_converted(module):
                raise ValueError(f"quantization_config (mxfp4) quantizes {module!r}, a linear layer; minfer loads "
                                 f"MXFP4 MoE experts only (list it in modules_to_not_convert if it is stored in bf16)")
        return UNQUANTIZED

    def expert_method(self) -> ExpertMethod:
        return MXFP4_EXPERTS

    def _not_converted(self, module: str) -> bool:
        full = "model." + module
        return any(fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*")
                   for pattern in self.not_converted for name in (module, full))


class Mxfp4Experts(ExpertMethod):
    """Stacked expert matrices kept as the checkpoint stores them (``keeps_format``): the family's experts
    module allocates uint8 codes and scales and copies the checkpoint's rows into them unchanged."""

    keeps_format = True
    bytes_per_weight = 1 / CODES_PER_BYTE + 1 / BLOCK  # half a byte, and a 32nd of a scale byte

    def checkpoint_tensors(self) -> list[str]:
        return ["blocks", "scales"]

    def load(self, key: tuple[str, int], part: str, source: Any) -> None:
        raise ValueError("MXFP4 experts are read from the stacked *_blocks / *_scales tensors (gpt-oss's layout); "
                         "a checkpoint with one tensor per expert matrix is not supported in mxfp4")


MXFP4_EXPERTS = Mxfp4Experts()


def from_config(qc: dict[str, Any]) -> Mxfp4Config:
    """config.json's ``quantization_config`` with ``quant_method: mxfp4``."""
    return Mxfp4Config(not_converted=tuple(qc.get("modules_to_not_convert") or ()))
