"""The mixture-of-experts block's torch reference, torch only: the torch ops run it as the MoE op
(``minfer/ops/base.py``) without loading Triton, and ``moe.py``'s fused kernels are held to it.

Two routers (Qwen3-MoE / Mixtral's softmax-then-top-k, gpt-oss's top-k-then-softmax) and two kinds of experts
(plain SwiGLU; gpt-oss's biased, clamped SwiGLU), the weights in the activations' dtype or MXFP4
(``kernels/quant/mxfp4_ref.py``), dequantized expert by expert as they are used.
"""
from __future__ import annotations

import torch

from ..quant.mxfp4_ref import dequantize_mxfp4


def moe_route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                  weights_dtype: torch.dtype | None = None,
                  topk_softmax: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k], expert ids [T, top_k] int64), largest first, as HF's routers compute them.

    Qwen3-MoE / Mixtral: float32 softmax over the experts, ``torch.topk``, in-place renormalisation when
    ``renormalize``, the cast to ``weights_dtype`` (default ``router_logits.dtype``: Qwen3-MoE's cast; Mixtral's
    router has none, i.e. float32). gpt-oss (``topk_softmax``): ``torch.topk`` of the logits, then a softmax over
    those k in ``weights_dtype`` (default the logits' dtype: HF's ``softmax(..., dtype=router_top_value.dtype)``,
    computed in float32 and rounded once); ``renormalize`` changes nothing there (the k weights already sum to
    one)."""
    if topk_softmax:
        values, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.nn.functional.softmax(values, dim=-1, dtype=weights_dtype or values.dtype), ids
    probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype or router_logits.dtype), ids


def swiglu_ref(gate_up: torch.Tensor, limit: float = 0.0, alpha: float = 1.0) -> torch.Tensor:
    """``[R, 2I]`` gate|up -> ``[R, I]`` with HF's ops in the tensor's dtype: ``silu(gate) * up``, or with a
    ``limit`` gpt-oss's ``_apply_gate``: gate clamped above at the limit, up on both sides, then
    ``(up + 1) * (gate * sigmoid(gate * alpha))``, each op rounded."""
    gate, up = gate_up.chunk(2, dim=-1)
    if not limit:
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def moe_experts_ref(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor, *, bias_gate_up: torch.Tensor | None = None,
                    bias_down: torch.Tensor | None = None, scale_gate_up: torch.Tensor | None = None,
                    scale_down: torch.Tensor | None = None, swiglu_limit: float = 0.0,
                    swiglu_alpha: float = 1.0) -> torch.Tensor:
    """The experts as a loaded HF model runs them (``grouped_mm_experts_forward``, transformers' default
    ``experts_implementation``): each (token, slot) row through its expert's MLP in x's dtype (the product, then
    the bias added in place: ``out.add_(bias)``, the gate (:func:`swiglu_ref`), the down product, its bias),
    times its weight (in the promoted dtype: float32 for Mixtral's float32 weights), then
    ``view(T, top_k, H).sum(1)`` (float32 accumulation in slot order), rounded once to x's dtype. The eager loop
    of the experts' classes (what a block built on its own runs) instead rounds each weighted row to x's dtype and
    ``index_add_``-s them in expert order: in float32 the two differ only in the order of each k-term sum.

    MXFP4 weights (``scale_*`` given: ``w_*`` are packed codes) are dequantized to x's dtype one expert at a
    time, as HF dequantizes the checkpoint to the model dtype at load."""
    t, top_k = ids.shape
    flat_ids, flat_w = ids.reshape(-1), weights.reshape(-1)
    rows = torch.empty(t * top_k, x.shape[1], dtype=torch.promote_types(x.dtype, weights.dtype), device=x.device)
    for expert in torch.unique(flat_ids).tolist():
        r = torch.nonzero(flat_ids == expert).squeeze(1)
        w_gu, w_d = w_gate_up[expert], w_down[expert]
        if scale_gate_up is not None:
            w_gu = dequantize_mxfp4(w_gu, scale_gate_up[expert], x.dtype)
            w_d = dequantize_mxfp4(w_d, scale_down[expert], x.dtype)
        gate_up = torch.nn.functional.linear(x[r // top_k], w_gu)
        if bias_gate_up is not None:
            gate_up.add_(bias_gate_up[expert])
        y = torch.nn.functional.linear(swiglu_ref(gate_up, swiglu_limit, swiglu_alpha), w_d)
        if bias_down is not None:
            y.add_(bias_down[expert])
        rows[r] = y * flat_w[r, None]
    return rows.view(t, top_k, -1).sum(dim=1).to(x.dtype)


def fused_moe_ref(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  top_k: int, renormalize: bool, *, weights_dtype: torch.dtype | None = None,
                  topk_softmax: bool = False, bias_gate_up: torch.Tensor | None = None,
                  bias_down: torch.Tensor | None = None, scale_gate_up: torch.Tensor | None = None,
                  scale_down: torch.Tensor | None = None, swiglu_limit: float = 0.0,
                  swiglu_alpha: float = 1.0) -> torch.Tensor:
    """Torch reference of :func:`fused_moe`: HF's router (:func:`moe_route_ref`) and experts
    (:func:`moe_experts_ref`), op for op, so it is a loaded HF model's MoE block to the rounding (float32 and
    bfloat16 alike). It loops over the chosen experts on the host: the CPU path, not for CUDA graphs."""
    weights, ids = moe_route_ref(router_logits, top_k, renormalize, weights_dtype, topk_softmax)
    return moe_experts_ref(x, weights, ids, w_gate_up, w_down, bias_gate_up=bias_gate_up, bias_down=bias_down,
                           scale_gate_up=scale_gate_up, scale_down=scale_down, swiglu_limit=swiglu_limit,
                           swiglu_alpha=swiglu_alpha)
