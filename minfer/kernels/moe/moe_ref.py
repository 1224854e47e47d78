"""The mixture-of-experts block's torch reference, torch only: the torch ops run it as the MoE op
(``minfer/ops/base.py``) without loading Triton, and ``moe.py``'s fused kernels are held to it."""
from __future__ import annotations

import torch


def moe_route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                  weights_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k], expert ids [T, top_k] int64) as HF's Qwen3-MoE / Mixtral routers compute them:
    float32 softmax, ``torch.topk`` (largest first), in-place renormalisation, the cast to ``weights_dtype``
    (default ``router_logits.dtype``: Qwen3-MoE's cast; Mixtral's router has none, i.e. float32)."""
    probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype or router_logits.dtype), ids


def moe_experts_ref(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor) -> torch.Tensor:
    """The experts as a loaded HF model runs them (``grouped_mm_experts_forward``, transformers' default
    ``experts_implementation``): each (token, slot) row through its expert's SwiGLU MLP in x's dtype, times its
    weight (in the promoted dtype: float32 for Mixtral's float32 weights), then ``view(T, top_k, H).sum(1)``
    (float32 accumulation in slot order), rounded once to x's dtype. The eager loop of the experts' classes
    (what a block built on its own runs) instead rounds each weighted row to x's dtype and ``index_add_``-s
    them in expert order: in float32 the two differ only in the order of each k-term sum."""
    t, top_k = ids.shape
    flat_ids, flat_w = ids.reshape(-1), weights.reshape(-1)
    rows = torch.empty(t * top_k, x.shape[1], dtype=torch.promote_types(x.dtype, weights.dtype), device=x.device)
    for expert in torch.unique(flat_ids).tolist():
        r = torch.nonzero(flat_ids == expert).squeeze(1)
        gate, up = torch.nn.functional.linear(x[r // top_k], w_gate_up[expert]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w_down[expert])
        rows[r] = y * flat_w[r, None]
    return rows.view(t, top_k, -1).sum(dim=1).to(x.dtype)


def fused_moe_ref(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  top_k: int, renormalize: bool, *, weights_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Torch reference of :func:`fused_moe`: HF's router (:func:`moe_route_ref`) and experts
    (:func:`moe_experts_ref`), op for op, so it is a loaded HF model's MoE block to the rounding (float32 and
    bfloat16 alike). It loops over the chosen experts on the host: the CPU path, not for CUDA graphs."""
    weights, ids = moe_route_ref(router_logits, top_k, renormalize, weights_dtype)
    return moe_experts_ref(x, weights, ids, w_gate_up, w_down)
