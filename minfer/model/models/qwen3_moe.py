"""Qwen3-MoE: Qwen3's attention, and a sparse MoE block (``layers/moe.py``) in place of the MLP in the
layers the config makes sparse (every ``decoder_sparse_step``-th, except ``mlp_only_layers``)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minfer.config import ModelConfig
from minfer.distributed import TensorParallel
from minfer.model.layers.moe import SparseMoeBlock
from minfer.model.models.llama import Qwen3ForCausalLM
from minfer.model.quantization.base import QuantConfig
from minfer.ops import Ops


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    expert_matrices = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        layers = int(hf["num_hidden_layers"])
        experts = int(hf.get("num_experts", hf.get("num_local_experts", 0)))  # transformers 5 writes the latter
        step = int(hf.get("decoder_sparse_step", 1))
        dense = set(hf.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
        return ModelConfig.from_hf(
            hf, attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True, num_experts=experts,
            num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
            moe_intermediate_size=int(hf.get("moe_intermediate_size", 768)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)), moe_layers=sparse)

    def make_mlp(self, cfg: ModelConfig, index: int, dtype: torch.dtype, ops: Ops, tp: TensorParallel,
                 quant: QuantConfig | None) -> nn.Module:
        if index not in cfg.moe_layers:
            return super().make_mlp(cfg, index, dtype, ops, tp, quant)
        return SparseMoeBlock(cfg, dtype, ops, tp, quant)  # top-k weights rounded to the model dtype, as HF
