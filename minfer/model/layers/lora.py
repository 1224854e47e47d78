"""LoRA on a model's fused projections: after a layer's base product each token's adapter adds x·Aᵀ·Bᵀ (its scale
folded into B), for every adapter of the step in one shrink and one expand (``kernels/lora``).

``attach_lora`` wraps q/k/v, o, gate/up and down of every layer of a Llama-layout decoder with the slot stacks of
``minfer.lora.LoRASlots``; which slot each token reads is the step's ``LoRAState.meta``, which the engine sets
before each forward (``engine/lora_manager.py``; a CUDA graph reads static copies of it). The wrapped layers take
their inputs in the model dtype, since the adapters read them too (a weight format's fused input quantization is
off). The Llama layout's fused one-token forward (``ops/one_token.py``), which multiplies the weights itself, adds
the adapters in its matrix-vector kernels (``kernels/gemm/gemv_lora.py``); other layouts' is off.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from minfer.lora.slots import LoRAStack
from minfer.ops import Ops


@dataclass(slots=True)
class LoRAState:
    """What every LoRA projection of a model reads: the step's token-to-slot grouping (``kernels/lora``'s
    ``LoraMeta``; None: no token of the step has an adapter, and nothing is added) and the ops that add them."""

    ops: Ops
    meta: Any = None


@dataclass(slots=True)
class LoRAProjection:
    """One fused projection's adapter slots (``FusedLinear.lora``)."""

    stack: LoRAStack
    state: LoRAState

    def add(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """Add each token's adapter product to the base output ``out`` in place (before a row-parallel layer's
        sum over ranks, which is linear, so each rank's share adds up to the whole product)."""
        meta = self.state.meta
        if meta is not None:
            s = self.stack
            self.state.ops.add_lora(out, x, s.a_stack, s.b_stack, meta, s.shard_sizes)


FUSED_PROJECTIONS = (("qkv", "self_attn", "qkv_proj"), ("o", "self_attn", "o_proj"),
                     ("gate_up", "mlp", "gate_up_proj"), ("down", "mlp", "down_proj"))


def attach_lora(model: nn.Module, stacks: dict[tuple[int, str], LoRAStack], state: LoRAState) -> None:
    """Wrap ``model``'s projections that ``stacks`` has slots for (a MoE layer's experts have none)."""
    from minfer.model.models.llama import DecoderLayer

    for index, layer in enumerate(model.layers):
        if not isinstance(layer, DecoderLayer):
            raise ValueError(f"enable_lora: {type(model).__name__}'s decoder layers are not Llama's; LoRA serves "
                             "Llama-layout models (Llama, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Phi-3, gpt-oss)")
        for fused, block, name in FUSED_PROJECTIONS:
            module: Any = getattr(getattr(layer, block), name, None)
            stack = stacks.get((index, fused))
            if module is not None and stack is not None:
                module.lora = LoRAProjection(stack, state)
        layer.attn_in = layer.mlp_in = None  # the norms emit the model dtype, which the adapters read
    if model.fused_one_token != "llama":  # only the Llama layout's one-token forward adds the adapters
        model.fused_one_token = None
