"""Qwen3.5-MoE (text): Qwen3.5's layers (``qwen3_5.py``: Gated DeltaNet and gated full attention, 3:1) with a sparse
MoE block in every layer's place of the MLP.

The block, as HF transformers computes it (``Qwen3_5MoeSparseMoeBlock``):

- **Routed experts**: a softmax over the router's logits in float32, the top k, always renormalised to sum to 1, the
  weights rounded to the model dtype (``SparseMoeBlock`` with ``norm_topk_prob`` on).
- **A shared expert** beside them: a SwiGLU MLP of ``shared_expert_intermediate_size`` (``GatedMLP``; the config's
  ``intermediate_size`` here) for every token, scaled by ``sigmoid(shared_expert_gate(x))``, a ``[1, H]`` linear,
  and added to the routed sum.

The checkpoint stores the experts one tensor per expert and matrix (``experts.N.gate_proj``: what transformers'
``save_pretrained`` writes) or stacked (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj``
``[E, H, I]``: the released files); both load into the fused op's stacks.

Under tensor parallelism the shared expert splits like an MLP (gate/up by rows, down by columns) and its gate is
whole on every rank: its down projection does not reduce, so the routed and shared partial sums go through one
all-reduce together.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minfer.config import ModelConfig
from minfer.distributed import SINGLE, TensorParallel
from minfer.model.layers.mlp import GatedMLP
from minfer.model.layers.moe import SparseMoeBlock
from minfer.model.models.qwen3_5 import Qwen3_5ForCausalLM
from minfer.model.quantization.base import QuantConfig
from minfer.ops import Ops


class SharedExpertMoeBlock(SparseMoeBlock):
    """Routed experts plus a gated shared expert, summed before the one all-reduce."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops: Ops, tp: TensorParallel,
                 quant: QuantConfig | None, prefix: str) -> None:
        super().__init__(cfg, dtype, ops, tp, quant)  # top-k weights rounded to the model dtype, as HF's router
        self.shared_expert = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, ops, tp, quant,
                                      f"{prefix}.shared_expert")
        self.shared_expert.down_proj.tp = SINGLE  # its partial sum joins the routed one's all-reduce
        self.shared_expert_gate = nn.Module()  # [1, H], whole on every rank
        self.shared_expert_gate.weight = nn.Parameter(torch.empty(1, cfg.hidden_size, dtype=dtype),
                                                      requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.routed(x, F.linear(x, self.gate.weight))
        shared = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)
        return self.tp.all_reduce(routed + shared)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    expert_matrices = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    stacked_experts = {"gate_up_proj": ("gate", "up"), "down_proj": ("down",)}

    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Qwen3.5's config, with the shared expert's width as ``intermediate_size`` and every layer sparse."""
        shared = int(hf.get("shared_expert_intermediate_size") or hf["intermediate_size"])
        cfg = super().read_config({**hf, "intermediate_size": shared})
        return dataclasses.replace(
            cfg, num_experts=int(hf["num_experts"]), num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
            moe_intermediate_size=int(hf["moe_intermediate_size"]), norm_topk_prob=True,
            moe_layers=tuple(range(cfg.num_hidden_layers)))

    def make_mlp(self, cfg: ModelConfig, index: int, dtype: torch.dtype, ops: Ops, tp: TensorParallel,
                 quant: QuantConfig | None) -> nn.Module:
        return SharedExpertMoeBlock(cfg, dtype, ops, tp, quant, f"layers.{index}.mlp")

    @classmethod
    def _mlp_shapes(cls, config: ModelConfig, layer: int, prefix: str) -> dict[str, tuple[int, ...]]:
        """The router and per-expert tensors (what ``save_pretrained`` writes), the shared expert and its gate."""
        h, s = config.hidden_size, config.intermediate_size
        p = prefix + "mlp.shared_expert"
        return super()._mlp_shapes(config, layer, prefix) | {
            p + ".gate_proj.weight": (s, h), p + ".up_proj.weight": (s, h), p + ".down_proj.weight": (h, s),
            p + "_gate.weight": (1, h)}
