"""The sparse MoE block of Qwen3-MoE and Mixtral: a router, then each token's top-k experts' SwiGLU MLPs,
summed with the router's weights.

The experts' weights are stacked as the fused kernel reads them: ``w_gate_up`` ``[E, 2I, H]`` (each
expert's gate rows, then its up rows) and ``w_down`` ``[E, H, I]``; the checkpoint's per-expert
tensors load straight into their slices, file by file. Under tensor parallelism every expert's
intermediate features are split across the ranks (gate/up by rows, down by columns, one all-reduce
after the block), so every rank holds a slice of every expert and the routing is the same on all of
them: the router is small and replicated. (Expert parallelism, whole experts per rank, would trade
that all-reduce for two all-to-alls and load imbalance; not built.)

An FP8 checkpoint's experts (block or channel/tensor scales) are dequantized to the model dtype as they
load, one expert matrix at a time: the fused MoE kernels multiply in the model dtype (its attention
layers stay FP8). ``quantization="fp8"`` (online) leaves the experts in the model dtype.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minfer.config import ModelConfig
from minfer.distributed import SINGLE, TensorParallel
from minfer.model.quant import BLOCK, Fp8Format
from minfer.ops import Ops

# checkpoint names of an expert's three matrices (Qwen3-MoE's, then Mixtral's) -> ours
EXPERT_MATRICES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops: Ops, tp: TensorParallel = SINGLE,
                 quant: Fp8Format | None = None) -> None:
        super().__init__()
        self.quant = quant if quant is not None and not quant.online else None  # the checkpoint's experts are FP8
        self._fp8: dict[tuple[str, int], dict[str, torch.Tensor]] = {}  # an expert's codes or scales, until both came
        self.ops, self.tp = ops, tp
        self.num_experts, self.top_k, self.renormalize = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        # Mixtral's router keeps the top-k weights in float32, Qwen3-MoE's rounds them to the model dtype
        self.weights_dtype = torch.float32 if cfg.architecture == "MixtralForCausalLM" else None
        self.start, self.inter = tp.split(cfg.moe_intermediate_size)
        e, h, i = cfg.num_experts, cfg.hidden_size, self.inter
        self.gate = nn.Module()  # the router: [E, H], whole on every rank
        self.gate.weight = nn.Parameter(torch.empty(e, h, dtype=dtype), requires_grad=False)
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)

    def checkpoint_keys(self) -> list[tuple[str, int]]:
        """(matrix, expert) for every expert matrix the checkpoint must supply (and its scales when FP8)."""
        names = ("gate", "up", "down") + (("gate.weight_scale", "up.weight_scale", "down.weight_scale")
                                          if self.quant is not None else ())
        return [(m, e) for m in names for e in range(self.num_experts)]

    def load_shard(self, name: str, source: Any, expert: int) -> str | None:
        """Expert ``expert``'s ``name`` matrix ('gate', 'up' or 'down'; with '.weight_scale' /
        '.weight_scale_inv' its FP8 scales): this rank's slice of it."""
        matrix, _, attr = name.partition(".")
        if self.quant is None:
            return self._copy(matrix, expert, source)
        if attr == "input_scale":  # experts multiply in the model dtype: no activation scale
            return None
        part = "scale" if attr.startswith("weight_scale") else "codes"
        pending = self._fp8.setdefault((matrix, expert), {})
        pending[part] = source[:]
        if len(pending) == 2:
            del self._fp8[(matrix, expert)]
            self._copy(matrix, expert, _dequantize(pending["codes"], pending["scale"].float(), self.quant.block))
        return matrix if part == "codes" else f"{matrix}.weight_scale"

    def _copy(self, matrix: str, expert: int, source: Any) -> str:
        cols = slice(self.start, self.start + self.inter)
        if matrix == "down":
            tensor, target = source[:, cols], self.w_down.data[expert]
        else:
            tensor = source[cols]
            target = self.w_gate_up.data[expert].narrow(0, 0 if matrix == "gate" else self.inter, self.inter)
        if tensor.shape != target.shape:
            raise ValueError(f"checkpoint tensor shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
        target.copy_(tensor)
        return matrix

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(x, self.gate.weight)
        y = self.ops.fused_moe(x, router_logits, self.w_gate_up, self.w_down, self.top_k, self.renormalize,
                               self.weights_dtype)
        return self.tp.all_reduce(y)


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, block: bool) -> torch.Tensor:
    """A whole expert matrix from its e4m3 codes: scales per 128x128 block, per row ([n, 1]) or per tensor."""
    w = codes.float()
    if block:
        n, k = w.shape
        return w * scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    return w * (scale.reshape(-1, 1) if scale.numel() > 1 else scale.reshape(1, 1))
