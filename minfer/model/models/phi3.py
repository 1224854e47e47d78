"""Phi-3 and Phi-4 (``Phi3ForCausalLM``): Llama's decoder, with fused matrices in the checkpoint and longrope.

What differs from Llama, as HF transformers computes it (``modeling_phi3.py``):

- **Fused checkpoint matrices.** A layer stores q/k/v as one ``qkv_proj`` ([q heads | kv heads | kv heads]
  rows) and gate/up as one ``gate_up_proj`` ([gate | up]). They load into minfer's own fused layers shard
  by shard (``stacked_modules``): each tensor-parallel rank reads its q heads, its KV heads and its slice of
  the intermediate features from the one checkpoint tensor, never the whole of it. A quantized checkpoint's
  scales (per tensor, per row or per block of rows of the fused tensor) are read at the same checkpoint
  rows, and its format is asked about layers by the checkpoint's names (``qkv_proj``, ``gate_up_proj``).
- **longrope** (Phi-3 mini/medium 128k, Phi-3.5-mini): per-frequency short and long factors and an
  attention factor on cos/sin (``layers/rotary.py``). HF picks the factor set at each forward by the
  sequence's length; here one table serves the engine, long when ``max_model_len`` exceeds
  ``original_max_position_embeddings`` (``rotary.long_rope`` says what is HF-exact).
- **Sliding window** (2047 in Phi-3-mini-4k) on every layer, as Mistral's.
- Not supported: ``partial_rotary_factor`` below 1 (Phi-4-mini rotates 3/4 of each head, pairing dimension
  d with d + 3D/8; the rotary ops pair d with d + D/2 over the whole head).
"""
from __future__ import annotations

from typing import Any

import torch

from minfer.config import ModelConfig
from minfer.distributed import SINGLE, TensorParallel
from minfer.model.models.llama import LlamaForCausalLM
from minfer.model.quantization.base import ExpertMethod, LinearMethod, QuantConfig
from minfer.ops import Ops

# Phi3Config's defaults, for the keys a config.json may leave out (where they differ from ModelConfig.from_hf's)
PHI3_DEFAULTS: dict[str, Any] = dict(
    vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
    rms_norm_eps=1e-5, max_position_embeddings=4096, original_max_position_embeddings=4096,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000, hidden_act="silu",
)
# a matrix minfer fuses -> the checkpoint tensor that stacks it, in stacking order (q, k, v; gate, up)
STACKED_IN = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
              "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
LEGACY_ROPE_TYPES = ("su", "yarn")  # early Phi-3 configs' names of longrope (HF's Phi3Config renames them)


class StackedNames(QuantConfig):
    """A checkpoint's weight format asked with the checkpoint's module names: a layer names the matrices it
    fuses (``q_proj``...), and a format that ignores modules by name must see the tensor the checkpoint
    stores (``qkv_proj``)."""

    def __init__(self, inner: QuantConfig) -> None:
        self.inner = inner
        self.name = inner.name

    def linear_method(self, checkpoint_modules: list[str]) -> LinearMethod:
        renamed = []
        for module in checkpoint_modules:
            prefix, _, last = module.rpartition(".")
            renamed.append(f"{prefix}.{STACKED_IN[last]}" if last in STACKED_IN else module)
        return self.inner.linear_method(list(dict.fromkeys(renamed)))

    def expert_method(self) -> ExpertMethod | None:
        return self.inner.expert_method()

    def __getattr__(self, name: str) -> Any:  # the rest of the format's settings, as they are
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama's layers; the checkpoint's fused tensors split at load, longrope in the rotary table."""

    @classmethod
    def stacked_modules(cls, config: ModelConfig) -> dict[str, tuple[str, list[int]]]:
        q = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        inter = config.intermediate_size
        return {"qkv_proj": ("qkv_proj", [q, kv, kv]), "gate_up_proj": ("gate_up_proj", [inter, inter])}

    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """HF's Phi3Config defaults under the file's keys, its legacy rope names read as longrope; a partial
        rotary factor is refused (see the module's docstring)."""
        hf = {**PHI3_DEFAULTS, **hf}
        for key in ("rope_scaling", "rope_parameters"):
            rope = hf.get(key)
            if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in LEGACY_ROPE_TYPES:
                hf[key] = {**rope, "rope_type": "longrope"}
        partial = hf.get("partial_rotary_factor") or (hf.get("rope_parameters") or {}).get("partial_rotary_factor")
        if partial is not None and float(partial) != 1.0:
            raise ValueError(f"partial_rotary_factor {partial} is not supported (Phi-4-mini): minfer's rotary ops "
                             f"rotate whole heads, pairing dimension d with d + head_dim/2")
        if hf["hidden_act"] != "silu":
            raise ValueError(f"Phi-3 hidden_act {hf['hidden_act']!r} is not supported (only silu)")
        return ModelConfig.from_hf(hf)

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Llama's tensors with q/k/v and gate/up stacked, as a Phi-3 checkpoint names and shapes them."""
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in super().checkpoint_shapes(config).items():
            module, attr = name.rsplit(".", 1)
            prefix, _, last = module.rpartition(".")
            if last not in STACKED_IN:
                shapes[name] = shape
                continue
            stacked = f"{prefix}.{STACKED_IN[last]}.{attr}"
            rows = shapes[stacked][0] if stacked in shapes else 0
            shapes[stacked] = (rows + shape[0], *shape[1:])
        return shapes

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_position: int, ops: Ops,
                 tp: TensorParallel = SINGLE, quant: QuantConfig | None = None) -> None:
        super().__init__(cfg, dtype, max_position, ops, tp, StackedNames(quant) if quant is not None else None)
