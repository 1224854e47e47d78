"""Mixtral: Llama's attention, and a sparse MoE block (``layers/moe.py``) in every layer, stored under
``block_sparse_moe`` with experts' matrices ``w1`` (gate), ``w3`` (up) and ``w2`` (down)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minfer.config import ModelConfig
from minfer.distributed import TensorParallel
from minfer.model.layers.moe import SparseMoeBlock
from minfer.model.models.llama import LlamaForCausalLM
from minfer.model.quantization.base import QuantConfig
from minfer.ops import Ops


class MixtralForCausalLM(LlamaForCausalLM):
    moe_block = "block_sparse_moe"
    expert_matrices = {"w1": "gate", "w3": "up", "w2": "down"}

    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        return ModelConfig.from_hf(
            hf, attention_bias=bool(hf.get("attention_bias", False)),
            num_experts=int(hf.get("num_local_experts", 8)), num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
            moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=True,
            moe_layers=tuple(range(int(hf["num_hidden_layers"]))))

    def make_mlp(self, cfg: ModelConfig, index: int, dtype: torch.dtype, ops: Ops, tp: TensorParallel,
                 quant: QuantConfig | None) -> nn.Module:
        return SparseMoeBlock(cfg, dtype, ops, tp, quant, router_weights_dtype=torch.float32)  # as HF's router
