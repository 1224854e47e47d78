"""The forward of a one-token step on the Triton kernels, built from the model from outside.

At batch 1 every projection is a weight stream (``minfer/kernels/gemm/gemv.py``) and each small kernel
between two projections costs about what a matrix-vector product does. So here each layer's two
RMSNorms (with their residual adds) run in the prologue of the matrix-vector kernel after them
(qkv, gate_up) and SwiGLU in the down projection's: three launches fewer per layer. The decoder
itself keeps one plain forward: this module reads its layers' weights from outside (as gpt-fast's
``tp.py`` swaps modules), and calls the layer's own attention (q/k norms, rotary, KV store, paged
attention on the same ops) between the projections. The LM head stays with the model
(``compute_logits``).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from minfer.kernels.gemm.gemv import gemv, gemv_gelu_tanh_mul, gemv_rms_norm, gemv_silu_mul
from minfer.kernels.gemm.gemv_epilogue import RopeStore
from minfer.kernels.gemm.gemv_gated import gemv_gated_rms_norm, gemv_sigmoid_gate
from minfer.kernels.gemm.gemv_lora import GemvLora
from minfer.ops.metadata import AttentionMetadata


# Rotary and the KV store in the qkv launch (gemv_epilogue.py) for the Llama layout: one launch less per layer
# (batch 1 on llama-3.2-1b +2.7%, benchmarks/RESULTS.md). MINFER_FUSED_ROPE_STORE=0 turns it off;
# benchmarks/gpu_perf_round.sh PARTS=onetoken measures both.
FUSED_ROPE_STORE = os.environ.get("MINFER_FUSED_ROPE_STORE", "1") == "1"


class OneTokenForward:
    """``model.forward`` for a step of exactly one token, as fused matrix-vector launches.

    ``model`` is a Llama-family decoder (``minfer.model.models.llama.LlamaForCausalLM``): ``embed``,
    and ``layers`` of ``input_layernorm``, ``self_attn`` (``qkv_proj``, ``attention``, ``o_proj``),
    ``post_attention_layernorm`` and ``mlp`` (``gate_up_proj``, ``down_proj``).
    """

    def __init__(self, model: nn.Module) -> None:
        self.embed = model.embed
        self.layers = [(layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp, layer)
                       for layer in model.layers]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        residual = None
        for ln, attn, ln2, mlp, layer in self.layers:
            lora = _lora(attn.qkv_proj)
            rope = _rope_store(attn, positions, meta) if FUSED_ROPE_STORE and lora is None else None
            qkv, residual = gemv_rms_norm(x, residual, ln.weight, ln.eps, attn.qkv_proj.weight, attn.qkv_proj.bias,
                                          weight_scale=_scale(attn.qkv_proj), lora=lora, rope_store=rope)
            if layer.capture is not None:  # the stream entering the layer, for an EAGLE-3 head (models/llama.py)
                layer.capture[:1].copy_(residual)
            if rope is None:
                o = attn.attention(qkv, positions, meta)
            else:  # q rotated and K/V stored by the qkv launch
                o = attn.attn.attend(qkv[:, :attn.q_size].view(1, attn.num_heads, attn.head_dim), meta)
            x = gemv(o.reshape(1, attn.q_size).contiguous(), attn.o_proj.weight, attn.o_proj.bias,
                     weight_scale=_scale(attn.o_proj), lora=_lora(attn.o_proj))
            x = attn.o_proj.reduce(x)  # the sum over tensor-parallel ranks (identity on one GPU)
            x, residual = _mlp(ln2, mlp, x, residual)
        return x + residual  # the final norm runs in compute_logits, as in the model's forward


def _rope_store(attn: nn.Module, positions: torch.Tensor, meta: AttentionMetadata) -> RopeStore | None:
    """The qkv launch's rotary and cache-store epilogue for a Llama attention (``gemv_epilogue.py``), or None where
    the separate kernel stays: q/k norms (a norm needs the whole head), a partial rotary, an 8-bit cache."""
    cache, table = attn.attn, attn.rotary.cos_sin_cache
    if attn.q_norm is not None or cache.k_scale is not None or table.shape[-1] != attn.head_dim:
        return None
    return RopeStore(positions, table, cache.k_cache, cache.v_cache, meta.slot_mapping[cache.kv_group],
                     attn.num_heads, attn.num_kv_heads, attn.head_dim)


def _mlp(ln: nn.Module, mlp: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The post-attention norm (with the residual add) in gate_up's prologue and SwiGLU in down's, or a sparse MoE
    block's (:func:`_moe`). Returns (output, new residual)."""
    if hasattr(mlp, "routed"):
        return _moe(ln, mlp, x, residual)
    gate_up, residual = gemv_rms_norm(x, residual, ln.weight, ln.eps, mlp.gate_up_proj.weight,
                                      weight_scale=_scale(mlp.gate_up_proj), lora=_lora(mlp.gate_up_proj))
    down = gemv_silu_mul(gate_up, mlp.down_proj.weight, weight_scale=_scale(mlp.down_proj), lora=_lora(mlp.down_proj))
    return mlp.down_proj.reduce(down), residual


def _moe(ln: nn.Module, moe: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse MoE block (``model/layers/moe.py``, gpt-oss's, Qwen3.5-MoE's with a shared expert) at one token:
    the post-attention norm (with the residual add) in the router's launch, which also keeps the normed row for
    the experts (``normed_out``), then the block's two expert kernels (``moe_decode.py``). The plain forward's norm
    launch and cuBLAS router GEMM become one matrix-vector launch under PDL. A shared expert's SwiGLU MLP and its
    ``[1, H]`` gate run as matrix-vector launches over the same normed row, combined as the block combines them
    (``SharedExpertMoeBlock.forward``: the sigmoid rounded, then the product, then the sum)."""
    router = moe.router
    normed = torch.empty_like(x)
    logits, residual = gemv_rms_norm(x, residual, ln.weight, ln.eps, router.weight, router.bias, normed_out=normed)
    y = moe.routed(normed, logits)
    shared = getattr(moe, "shared_expert", None)
    if shared is not None:
        gate_up = gemv(normed, shared.gate_up_proj.weight, weight_scale=_scale(shared.gate_up_proj),
                       lora=_lora(shared.gate_up_proj))
        out = gemv_silu_mul(gate_up, shared.down_proj.weight, weight_scale=_scale(shared.down_proj),
                            lora=_lora(shared.down_proj))
        y = y + torch.sigmoid(gemv(normed, moe.shared_expert_gate.weight)) * out
    return moe.tp.all_reduce(y), residual


def _scale(linear: nn.Module) -> torch.Tensor | None:
    """An FP8 layer's weight scales (the matrix-vector kernels dequantize its e4m3 weights in registers;
    activations stay in the model dtype at one token)."""
    return getattr(linear, "weight_scale", None)  # only a quantized method keeps one


def _lora(linear: nn.Module) -> GemvLora | None:
    """A projection's LoRA slots for the step's token (``model/layers/lora.py``: the step's grouping, or a graph's
    static one), None when the engine serves no adapters or no token of the step has one. Under tensor parallelism a
    row-parallel layer's partial product takes its rank's partial shrink times the whole B, which the sum over
    ranks adds up (``gemv_lora.py``)."""
    lora = getattr(linear, "lora", None)
    if lora is None or lora.state.meta is None:
        return None
    stack = lora.stack
    return GemvLora(lora.state.meta.token_slots, stack.a_stack, stack.b_stack, stack.shard_sizes)


class GemmaOneTokenForward:
    """``OneTokenForward`` for Gemma's sandwich layer (``minfer.model.models.gemma``): the input norm (with the
    residual add) in qkv's prologue, the pre-feedforward norm (with the add) in gate_up's, GeGLU in down's; the
    two norms on a projection's output (post-attention, post-feedforward) stay kernels of their own, since a
    row's norm needs the whole row. Gemma's ``1 + w`` norm weights are float32, which the prologue rounds as
    the norm kernel does. Seven launches a layer besides attention's two, where the plain forward takes nine."""

    def __init__(self, model: nn.Module) -> None:
        self.embed = model.embed
        self.layers = [(layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm,
                        layer.pre_feedforward_layernorm, layer.mlp, layer.post_feedforward_layernorm)
                       for layer in model.layers]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        residual = None
        for ln, attn, post_attn, pre_ff, mlp, post_ff in self.layers:
            qkv, residual = gemv_rms_norm(x, residual, ln.weight, ln.eps, attn.qkv_proj.weight, attn.qkv_proj.bias,
                                          weight_scale=_scale(attn.qkv_proj))
            x = gemv(attn.attention(qkv, positions, meta).contiguous(), attn.o_proj.weight, attn.o_proj.bias,
                     weight_scale=_scale(attn.o_proj))
            x = post_attn(attn.o_proj.reduce(x))
            gate_up, residual = gemv_rms_norm(x, residual, pre_ff.weight, pre_ff.eps, mlp.gate_up_proj.weight,
                                              weight_scale=_scale(mlp.gate_up_proj))
            x = post_ff(mlp.down_proj.reduce(gemv_gelu_tanh_mul(gate_up, mlp.down_proj.weight,
                                                                 weight_scale=_scale(mlp.down_proj))))
        return x + residual  # the final norm runs in compute_logits, as in the model's forward


class Qwen3_5OneTokenForward:
    """``OneTokenForward`` for Qwen3.5's hybrid decoder (``minfer.model.models.qwen3_5``; its MoE sibling too). A
    Gated DeltaNet layer: the input norm in the prologues of both input projections (qkv, then z|b|a from the
    residual the first wrote: the same normed row), the layer's conv and delta rule, its per-head gated norm in
    out_proj's prologue. A gated-attention layer: the input norm in qkv's prologue, the layer's attention, the
    sigmoid output gate in o_proj's prologue. Then the MLP as Llama's. The (1 + w) norm weights are float32, which
    the prologue rounds as HF's Qwen3.5 norm. Seven launches a linear layer, where the model's own forward takes
    eleven; five an attention layer besides attention's own, where it takes ten."""

    def __init__(self, model: nn.Module) -> None:
        self.embed = model.embed
        self.layers = [(layer.linear, layer.input_layernorm, layer.linear_attn if layer.linear else layer.self_attn,
                        layer.post_attention_layernorm, layer.mlp) for layer in model.layers]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        residual = None
        for linear, ln, mixer, ln2, mlp in self.layers:
            first = mixer.in_proj_qkv if linear else mixer.qkv_proj
            qkv, residual = gemv_rms_norm(x, residual, ln.weight, ln.eps, first.weight, first.bias,
                                          weight_scale=_scale(first))
            if linear:
                zba, _ = gemv_rms_norm(residual, None, ln.weight, ln.eps, mixer.in_proj_zba.weight,
                                       weight_scale=_scale(mixer.in_proj_zba))
                o = mixer.delta_rule(qkv, zba, meta)
                x = gemv_gated_rms_norm(o.view(1, -1), mixer.z(zba), mixer.norm.weight, mixer.eps,
                                        mixer.out_proj.weight, weight_scale=_scale(mixer.out_proj))
                x = mixer.out_proj.reduce(x)
            else:
                o = mixer.attention(qkv, positions, meta)
                x = mixer.o_proj.reduce(gemv_sigmoid_gate(o, mixer.gate(qkv), mixer.o_proj.weight, mixer.o_proj.bias,
                                                          weight_scale=_scale(mixer.o_proj)))
            x, residual = _mlp(ln2, mlp, x, residual)
        return x + residual  # the final norm runs in compute_logits, as in the model's forward


# a model's ``fused_one_token`` -> forward
LAYOUTS = {"llama": OneTokenForward, "gemma": GemmaOneTokenForward, "qwen3_5": Qwen3_5OneTokenForward}


class OneTokenFusedForward:
    """The step forward on the Triton ops: the one place that decides the fused path, by the step's
    token count alone (a lone decode, a one-token prompt chunk: the batch-1 decode graph included)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.one_token = LAYOUTS[model.fused_one_token](model)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if input_ids.shape[0] == 1:
            return self.one_token(input_ids, positions, meta)
        return self.model(input_ids, positions, meta)
