"""The ops interface: every computation of the model that has more than one implementation.

The engine picks one implementation once (``minfer.ops.select_ops``) and hands it to the model, whose
layers call these names and never ask which backend runs them.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, Callable

import torch
from torch import nn

from minfer.kernels.linear_attention.gated_delta_ref import (causal_conv1d_ref, gated_delta_rule_ref, gated_rms_norm_ref,
                                                          gdn_gates_ref)
from minfer.kernels.lora.lora_ops import add_lora
from minfer.kernels.moe.moe_ref import fused_moe_ref
from minfer.kernels.quant.fp8_ref import FP8_DTYPE, FP8_GROUP, FP8_MAX, FP8_MIN_SCALE, dequantize_fp8, group_amax
from minfer.ops.metadata import AttentionMetadata, Fp8Activation, MoeExperts, PagedKVCache, RopeInputs

# (input_ids [T], positions [T], metadata) -> final hidden states [T, hidden] (before the final norm)
ModelForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class Ops(ABC):
    """Named ops of one backend. ``name`` is 'torch' or 'triton'; ``cuda_graphs`` says whether a
    forward on these ops can be captured in a CUDA graph (no host-sized work, no host syncs)."""

    name: str
    cuda_graphs: bool

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension of ``x`` (2-D or 3-D). A float32 ``weight`` on a lower-precision
        ``x`` multiplies in float32 and rounds once (Gemma's ``1 + w`` norms); otherwise Llama's rounding."""

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``. ``residual`` may be updated in place: callers
        use only the returned one."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU on a fused ``[T, 2I]`` gate|up product → ``[T, I]``."""

    @abstractmethod
    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """GeGLU (tanh-approximated GELU, Gemma) on a fused ``[T, 2I]`` gate|up product → ``[T, I]``."""

    @abstractmethod
    def rope_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeInputs,
                      cache: PagedKVCache, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Per-head q/k norms (when ``rope`` has their weights), rotary, then k and v into the cache at
        ``slot_mapping`` (< 0 skips). q, k, v ``[T, H, D]`` may be views of the fused qkv output;
        returns q ready for attention (possibly ``q`` itself, rotated in place)."""

    @abstractmethod
    def rope_q(self, q: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        """``rope_store_kv`` for q alone: its per-head norm (when ``rope`` has ``q_norm_weight``) and rotary,
        nothing stored. A layer that attends over another layer's cache (Gemma 4's shared-KV layers) has no
        K/V of its own to write. Returns q ready for attention (possibly ``q`` itself, rotated in place)."""

    @abstractmethod
    def paged_attention(self, q: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
        """Attention of ``q`` ``[T, Hq, D]`` over the paged cache: the decodes' rows against their whole
        context, then each prompt chunk causally against its cached context and itself; within the layer's
        ``cache.window`` (sliding-window attention) when it has one, its scores capped by ``cache.softcap``
        when set, each head's ``cache.sinks`` logit in the softmax's denominator when it has them, through the
        block tables of its KV group (``cache.kv_group``)."""

    @abstractmethod
    def greedy_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits.argmax(-1)`` (first maximum) of ``[rows, vocab]`` logits, int64 ``[rows]``."""

    @abstractmethod
    def gumbel_argmax(self, logits: torch.Tensor, row_hash: torch.Tensor,
                      inv_temperature: torch.Tensor) -> torch.Tensor:
        """One draw per row from softmax(logits / T) as ``argmax(logits / T + g)``, Gumbel noise g from
        the rows' hashes (int64 ``[rows]``, values in [0, 2^32)); ``inv_temperature`` float32 ``[rows]``."""

    # ---- FP8 weights: the reference below rounds activations to e4m3 per token, or per token and 128-column
    # group for block weights (by a static per-tensor scale where the checkpoint has one), and multiplies
    # the dequantized operands in float32, as compressed-tensors' own forward does.
    def quantize_activation(self, x: torch.Tensor, input_scale: torch.Tensor | None, block: bool) -> Fp8Activation:
        """``x`` [T, K] → e4m3 codes and float32 scales. The codes are ``x / scale``, as compressed-tensors
        (HF's reference for its checkpoints) divides; the kernels multiply by ``1 / scale``
        (``kernels/quant/fp8_ref.py``), which may put a value one e4m3 step away."""
        xs = x.float()
        if input_scale is not None:
            scale = input_scale.float().expand(xs.shape[0]).contiguous()
            expanded = scale[:, None]
        elif block:
            scale = (group_amax(xs, FP8_GROUP) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
            expanded = scale.repeat_interleave(FP8_GROUP, dim=-1)[:, :xs.shape[1]]
        else:
            scale = (xs.abs().amax(-1) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
            expanded = scale[:, None]
        return Fp8Activation((xs / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale, x.dtype)

    def rms_norm_fp8(self, x: torch.Tensor, weight: torch.Tensor, eps: float, block: bool) -> Fp8Activation:
        """``rms_norm`` emitting the next FP8 layer's input (the Triton ops fuse the two)."""
        return self.quantize_activation(self.rms_norm(x, weight, eps), None, block)

    def add_rms_norm_fp8(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         block: bool) -> tuple[Fp8Activation, torch.Tensor]:
        """``add_rms_norm`` emitting the next FP8 layer's input, and the new residual."""
        normed, residual = self.add_rms_norm(x, residual, weight, eps)
        return self.quantize_activation(normed, None, block), residual

    @property
    def staging_tokens(self) -> int:
        """The most tokens whose pages a prompt step stages for 8-bit prefill (``TritonOps``; 0: none staged): the
        start-up memory profile stages as many (``kv_sizing.profile_step``)."""
        return 0

    def forcing_8bit_prefill(self, staged: bool) -> contextlib.AbstractContextManager:
        """Within it, 8-bit prefill is staged (``staged``, where staging is on) or converts codes in the kernel,
        whatever the step (``TritonOps``): the start-up warm-up compiles both kernels. Nothing here."""
        return contextlib.nullcontext()

    def silu_and_mul_fp8(self, x: torch.Tensor, block: bool) -> Fp8Activation:
        """``silu_and_mul`` emitting the down projection's FP8 input."""
        return self.quantize_activation(self.silu_and_mul(x), None, block)

    def fp8_linear(self, x: torch.Tensor | Fp8Activation, weight: torch.Tensor, weight_scale: torch.Tensor,
                   input_scale: torch.Tensor | None, bias: torch.Tensor | None, block: bool) -> torch.Tensor:
        """``x @ dequantize(weight)ᵀ (+ bias)`` for an e4m3 ``weight`` [N, K] with float32 scales per row
        ([N]) or per row and 128-column block ([N, ceil(K/128)]); ``x`` in the model dtype (quantized
        here) or already an ``Fp8Activation``."""
        a = x if isinstance(x, Fp8Activation) else self.quantize_activation(x, input_scale, block)
        xs = dequantize_fp8(a.q, a.scale)
        w = dequantize_fp8(weight, weight_scale)
        return torch.nn.functional.linear(xs, w, None if bias is None else bias.float()).to(a.dtype)

    def fused_moe(self, x: torch.Tensor, router_logits: torch.Tensor, experts: MoeExperts, top_k: int,
                  renormalize: bool, weights_dtype: torch.dtype | None = None,
                  topk_softmax: bool = False) -> torch.Tensor:
        """A sparse MoE block after its router: each token's top-k experts and the weighted sum of their MLPs
        (``experts``: SwiGLU or gpt-oss's clamped one, optional biases, weights in x's dtype or MXFP4).
        Routing: a float32 softmax over the experts, then the top k (renormalised to sum to one when
        ``renormalize``), or with ``topk_softmax`` (gpt-oss) the top k of the logits, then a softmax over
        those k. The weights are rounded to ``weights_dtype`` (default: the logits' dtype, as Qwen3-MoE and
        gpt-oss; Mixtral keeps float32). The reference is a loaded HF model's block op for op
        (``kernels/moe/moe_ref.py``; MXFP4 experts dequantized one at a time as they are used)."""
        return fused_moe_ref(x, router_logits, top_k=top_k, renormalize=renormalize, weights_dtype=weights_dtype,
                             topk_softmax=topk_softmax, **experts.as_kwargs())

    def model_forward(self, model: nn.Module) -> ModelForward:
        """The forward the runner runs steps through (and CUDA graphs capture): the model itself,
        unless these ops have a faster forward for some steps (the Triton ops' one-token forward)."""
        return model

    # ---- Linear attention (Qwen3.5's Gated DeltaNet): per-sequence state in slots of the engine's state cache. A
    # step's sequences are cut by query_start_loc [B + 1] (int32; decodes first, then prompt chunks); sequence b
    # reads and writes slot slots[b] ([B], distinct), starting from it when has_state[b] (bool [B]) and from zeros
    # otherwise, so a prompt chunked anywhere gives HF's numbers over the whole prompt (to float32 rounding).
    def causal_conv1d(self, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                      query_start_loc: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
        """Depthwise causal conv + SiLU of ``x`` [T, C] (the fused q|k|v channels) with ``weight`` [C, K], each
        sequence's window starting from its slot's ``conv_state`` [S, C, K - 1] (x's dtype: the last K - 1
        inputs, HF's state less the column its next conv never reads), which becomes the sequence's last K - 1
        inputs. Returns y [T, C] in x's dtype, rounded as HF's conv then SiLU
        (``kernels/linear_attention/gated_delta_ref.py``)."""
        return causal_conv1d_ref(x, weight, conv_state, query_start_loc, slots, has_state)

    def gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
                         slots: torch.Tensor, has_state: torch.Tensor, use_qk_l2norm: bool = True,
                         scale: float | None = None) -> torch.Tensor:
        """The gated delta rule: q, k [T, Hk, Dk] (L2-normalised here when ``use_qk_l2norm``, q then times
        ``scale``, default ``Dk ** -0.5``), v [T, Hv, Dv] (value head j reads key head ``j // (Hv / Hk)``); its
        gates from the layer's projections a, b [T, Hv] and its ``A_log``, ``dt_bias`` [Hv] as HF computes them
        (``g = -exp(A_log)·softplus(a + dt_bias)`` in float32, ``β = sigmoid(b)``: ``gdn_gates_ref``); ``state``
        [S, Hv, Dk, Dv] float32, each sequence's state after its last token written to its slot. q, k, v, a, b may
        be views of the conv's and the projection's outputs. Returns o [T, Hv, Dv] in q's dtype; HF's arithmetic
        in float32 (its recurrent step for one-token sequences, its chunked form for longer ones)."""
        g, beta = gdn_gates_ref(a, b, A_log, dt_bias)
        return gated_delta_rule_ref(q, k, v, g, beta, state, query_start_loc, slots, has_state, use_qk_l2norm, scale)

    def add_lora(self, out: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor, meta: Any,
                 shard_sizes: tuple[int, ...]) -> None:
        """``out[t] += x[t]·A[slot_t]ᵀ·B[slot_t]ᵀ`` shard by shard, in place, for the step's LoRA grouping ``meta``
        (``kernels/lora/lora_meta.LoraMeta``; slot -1: nothing added). Layouts: ``kernels/lora/lora_ops.add_lora``."""
        add_lora(out, x, a_stack, b_stack, meta, shard_sizes, use_triton=False)

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The Gated DeltaNet's output norm: each head of x [T, H, D] RMS-normalised, times ``weight`` [D], times
        ``silu(gate)`` (gate [T, H, D], a view of the z projection), HF's roundings (``gated_rms_norm_ref``)."""
        return gated_rms_norm_ref(x, gate, weight, eps)

