"""The sparse MoE block (Qwen3-MoE, Mixtral): a router, then each token's top-k experts' SwiGLU MLPs,
summed with the router's weights.

The experts' weights are stacked as the fused kernel reads them: ``w_gate_up`` ``[E, 2I, H]`` (each
expert's gate rows, then its up rows) and ``w_down`` ``[E, H, I]``; the checkpoint's per-expert
tensors load straight into their slices, file by file (the family maps its checkpoint names to
'gate', 'up' and 'down'). A checkpoint that stacks every expert in one tensor (the family's ``stacked_experts``:
Qwen3.5-MoE's ``experts.gate_up_proj`` ``[E, 2I, H]``, gate rows then up rows, and ``experts.down_proj``
``[E, H, I]``) loads expert by expert from it the same way: gate is the first ``I`` rows of its stack, up the last.

Under tensor parallelism every expert's intermediate features are split across the ranks (gate/up by rows,
down by columns, one all-reduce after the block), so every rank holds a slice of every expert and the routing
is the same on all of them: the router is small and replicated. (Expert parallelism, whole experts per rank,
would trade that all-reduce for two all-to-alls and load imbalance; not built.)

Experts stored in a checkpoint format load through its ``ExpertMethod`` into the model dtype, one expert
matrix at a time: the fused MoE kernels multiply in the model dtype.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minfer.config import ModelConfig
from minfer.distributed import SINGLE, TensorParallel
from minfer.model.quantization.base import QuantConfig
from minfer.ops import MoeExperts, Ops


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops: Ops, tp: TensorParallel = SINGLE,
                 quant: QuantConfig | None = None, router_weights_dtype: torch.dtype | None = None) -> None:
        """``router_weights_dtype``: the top-k weights' dtype (None: the model dtype)."""
        super().__init__()
        self.method = quant.expert_method() if quant is not None else None
        self.ops, self.tp = ops, tp
        self.num_experts, self.top_k, self.renormalize = cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.weights_dtype = router_weights_dtype
        self.start, self.inter = tp.split(cfg.moe_intermediate_size)
        self.full_inter = cfg.moe_intermediate_size
        e, h, i = cfg.num_experts, cfg.hidden_size, self.inter
        self.gate = nn.Module()  # the router: [E, H], whole on every rank
        self.gate.weight = nn.Parameter(torch.empty(e, h, dtype=dtype), requires_grad=False)
        self.gate.bias = None
        self.w_gate_up = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)
        self.moe_experts = MoeExperts(self.w_gate_up, self.w_down)  # the parameters themselves, loaded in place

    def checkpoint_keys(self) -> list[tuple[str, int]]:
        """(matrix, expert) for every expert matrix the checkpoint must supply (and its format's tensors)."""
        extra = self.method.checkpoint_tensors() if self.method is not None else []
        names = [m + suffix for suffix in ["", *(f".{t}" for t in extra)] for m in ("gate", "up", "down")]
        return [(m, e) for m in names for e in range(self.num_experts)]

    def load_shard(self, name: str, source: Any, expert: int) -> str | None:
        """Expert ``expert``'s ``name`` matrix ('gate', 'up' or 'down', or 'gate.weight_scale' ... for a
        checkpoint format's tensors): this rank's slice of it. ``source`` is that matrix, or a stack of every
        expert's (3-D)."""
        matrix, _, part = name.partition(".")
        shape = tuple(source.get_shape() if hasattr(source, "get_shape") else source.shape)
        if len(shape) == 3:
            if self.method is not None or part:
                raise ValueError("experts stacked in one tensor load in the model dtype only (no checkpoint format)")
            return self._copy(matrix, expert, source, 0 if matrix != "up" else shape[1] - self.full_inter)
        if self.method is None:
            return self._copy(matrix, expert, source)
        whole = self.method.load((matrix, expert), part or "weight", source)
        if whole is not None:
            self._copy(matrix, expert, whole)
        if not part:
            return matrix
        return f"{matrix}.weight_scale" if part.startswith("weight_scale") else None  # '_inv' names alike

    def _copy(self, matrix: str, expert: int, source: Any, stacked_row: int | None = None) -> str:
        """``stacked_row``: None when ``source`` is one expert's matrix; for a stack of every expert's, the row
        where the matrix starts in it."""
        at = () if stacked_row is None else (expert,)  # a stack is indexed by the expert first
        first = self.start + (stacked_row or 0)
        if matrix == "down":
            cols = slice(self.start, self.start + self.inter)
            tensor, target = source[(*at, slice(None), cols)], self.w_down.data[expert]
        else:
            tensor = source[(*at, slice(first, first + self.inter))]
            target = self.w_gate_up.data[expert].narrow(0, 0 if matrix == "gate" else self.inter, self.inter)
        if tensor.shape != target.shape:
            raise ValueError(f"checkpoint tensor shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
        target.copy_(tensor)
        return matrix

    @property
    def router(self) -> nn.Module:
        """The router (``gate``, HF's name) as the one-token forward reads it: ``weight`` and ``bias`` (None)."""
        return self.gate

    def routed(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """The chosen experts' weighted sum for ``x`` (the normed input) and its router logits, before the
        all-reduce: the one-token forward computes the logits in the norm's launch and calls this."""
        return self.ops.fused_moe(x, router_logits, self.moe_experts, self.top_k, self.renormalize,
                                  self.weights_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.routed(x, F.linear(x, self.gate.weight)))
