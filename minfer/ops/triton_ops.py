"""The Triton ops: the engine's kernels (``minfer/kernels``) behind the ops names.

Imported only when the Triton ops are chosen (``select_ops``), so the torch path never loads Triton.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
from torch import nn

from minfer.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from minfer.kernels.attention.decode_attention import paged_decode_attention
from minfer.kernels.attention.decode_attention_sm90 import paged_decode_attention_sm90
from minfer.kernels.attention.gluon_sm90 import sm90_available
from minfer.kernels.attention.kv_stage import StagePlan, plan_stage, staged_prefill_attention
from minfer.kernels.attention.prefill_attention import paged_prefill_attention
from minfer.kernels.attention.prefill_attention_sm90 import paged_prefill_attention_sm90
from minfer.kernels.gemm.fp8_gemm import fp8_gemm_block, fp8_gemm_channel
from minfer.kernels.gemm.splitk_gemm import fp8_gemm_splitk
from minfer.kernels.linear_attention.causal_conv import causal_conv1d
from minfer.kernels.linear_attention.gated_delta import gated_delta_rule
from minfer.kernels.linear_attention.gated_norm import gated_rms_norm
from minfer.kernels.lora.lora_ops import add_lora
from minfer.kernels.moe.moe import fused_moe
from minfer.kernels.moe.moe_args import use_moe_decode
from minfer.kernels.moe.moe_decode import fused_moe_decode
from minfer.kernels.quant.fp8_quant import add_rms_norm_fp8, quantize_fp8, rms_norm_fp8, silu_and_mul_fp8
from minfer.kernels.quant.fp8_ref import FP8_GROUP
from minfer.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from minfer.kernels.rope_store import rope_q, rope_store_kv
from minfer.kernels.sampling import greedy_argmax, gumbel_argmax
from minfer.ops.base import ModelForward, Ops
from minfer.ops.metadata import AttentionMetadata, Fp8Activation, MoeExperts, PagedKVCache, RopeInputs
from minfer.ops.one_token import OneTokenFusedForward


# Channel FP8 products of decode-sized batches (up to FP8_SPLITK_MAX_ROWS rows) take the split-K Triton GEMM
# (``fp8_gemm_splitk``: every SM streams a share of the weight where cuBLAS's tiles leave SMs idle; llama-3.1-8b at
# 16 rows, a layer's four products 1.18x faster on an H100); MINFER_FP8_SPLITK=0 keeps cuBLAS. From about 96 rows
# cuBLAS is as fast or faster (benchmarks/RESULTS.md), so larger products stay on it.
FP8_SPLITK = os.environ.get("MINFER_FP8_SPLITK", "1") == "1"
FP8_SPLITK_MAX_ROWS = 64
# Prompt chunks over an 8-bit cache on Hopper: the pages they see dequantized once into a 16-bit scratch cache for
# the 16-bit kernel (``kv_stage.py``), rather than converted inside its compute-bound loop;
# MINFER_STAGE_8BIT_PREFILL=0 keeps the converting kernel.
STAGE_8BIT_PREFILL = os.environ.get("MINFER_STAGE_8BIT_PREFILL", "1") == "1"
# A step is staged only where the converting kernel would convert each staged key this many times or more (one
# conversion per 128-row query block that sees it; ``kv_stage.conversions``): on an H100 at llama-3.1-8b's heads,
# staging costs 3.2 ns a key (8k keys in 26 us) and converting ~1.0 ns a key and query block (263 us more than
# the 16-bit kernel over 8k causal rows' 266k key-block pairs). Speculative verification and short chunks convert.
STAGE_MIN_REUSE = 3.0


class TritonOps(Ops):
    name = "triton"
    cuda_graphs = True

    def __init__(self, device: torch.device, block_size: int, head_dim: int, stage_tokens: int = 0) -> None:
        """``stage_tokens``: a step stages at most that many tokens' pages (and one page a chunk for their partial
        pages), else its 8-bit prefill converts in the kernel; 0: as many as the step's query tokens. The target's
        runner passes the larger of its token budget and max_model_len, so that the rest of a long prompt, chunk
        after chunk, stages its whole context; its start-up memory profile stages as many."""
        # Attention: the warp-specialized TMA/wgmma kernels on Hopper, the Triton kernels elsewhere.
        hopper = sm90_available(device, head_dim, block_size)
        self.prefill_attention = paged_prefill_attention_sm90 if hopper else paged_prefill_attention
        self.decode_attention = paged_decode_attention_sm90 if hopper else paged_decode_attention
        self.stage_8bit = hopper and STAGE_8BIT_PREFILL
        self.stage_tokens = stage_tokens
        self.stage_min_reuse = STAGE_MIN_REUSE

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x if x.dim() == 3 else x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm(x, residual, weight, eps), residual  # residual updated in place

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(x)

    def rope_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeInputs,
                      cache: PagedKVCache, slot_mapping: torch.Tensor) -> torch.Tensor:
        rope_store_kv(q, k, v, rope.positions, rope.cos_sin_cache, cache.k_cache, cache.v_cache, slot_mapping,
                      k_scale=cache.k_scale, v_scale=cache.v_scale, q_norm_weight=rope.q_norm_weight,
                      k_norm_weight=rope.k_norm_weight, eps=rope.eps)
        return q  # rotated in place

    def rope_q(self, q: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        rope_q(q, rope.positions, rope.cos_sin_cache, q_norm_weight=rope.q_norm_weight, eps=rope.eps)
        return q  # rotated in place

    def paged_attention(self, q: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
        kc, vc, g = cache.k_cache, cache.v_cache, cache.kv_group
        how = dict(k_scale=cache.k_scale, v_scale=cache.v_scale, window=cache.window, softcap=cache.softcap,
                   sinks=cache.sinks)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            self.decode_attention(q[:nd], kc, vc, meta.block_tables[g][:nd], meta.context_lens[:nd], scale,
                                  out=out[:nd], **how)
        if nd < q.shape[0]:
            qp = q[nd:]
            if qp.stride(1) != qp.shape[2]:  # heads apart (Qwen3.5's q beside its gate): the Hopper kernel's TMA
                qp = qp.contiguous()         # reads whole rows of heads
            args = (qp, kc, vc, meta.prefill_block_tables[g], meta.prefill_query_start_loc,
                    meta.prefill_context_lens, meta.max_prefill_query_len, scale)
            plan = self._stage_plan(meta, g, cache.window) if cache.k_scale is not None and self.stage_8bit else None
            if plan is not None:
                staged_prefill_attention(self.prefill_attention, *args, out=out[nd:], plan=plan, **how)
            else:
                self.prefill_attention(*args, out=out[nd:], **how)
        return out

    @property
    def staging_tokens(self) -> int:
        return self.stage_tokens if self.stage_8bit else 0

    @contextlib.contextmanager
    def forcing_8bit_prefill(self, staged: bool) -> Iterator[None]:
        saved = self.stage_8bit, self.stage_min_reuse
        self.stage_8bit, self.stage_min_reuse = saved[0] and staged, 0.0
        try:
            yield
        finally:
            self.stage_8bit, self.stage_min_reuse = saved

    def _stage_plan(self, meta: AttentionMetadata, group: int, window: int) -> StagePlan | None:
        """The step's staging plan for a KV group's table and window, made once a step (None: too many pages,
        too little reuse, or no host lengths to plan from)."""
        key = (group, window)
        if key not in meta._stage_plans:
            nd, page = meta.num_decodes, meta.block_size
            ctx, q_lens = meta.context_lens_host[nd:], meta.query_lens_host[nd:]
            table = meta.prefill_block_tables[group]
            budget = self.stage_tokens or sum(meta.query_lens_host)
            meta._stage_plans[key] = plan_stage(ctx, q_lens, page, table.shape[1], window, table.device,
                                                max_pages=-(-budget // page) + len(ctx),
                                                min_reuse=self.stage_min_reuse) if ctx else None
        return meta._stage_plans[key]

    def greedy_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return greedy_argmax(logits)

    def gumbel_argmax(self, logits: torch.Tensor, row_hash: torch.Tensor,
                      inv_temperature: torch.Tensor) -> torch.Tensor:
        return gumbel_argmax(logits.contiguous(), row_hash, inv_temperature)

    # ---- FP8: the norms and SwiGLU emit e4m3 for the next layer themselves (an extra quantization launch
    # per product is as long as the product at small M); the products run on FP8 tensor cores:
    # cuBLASLt's row-wise scaled GEMM for per-channel scales, the Triton block-scaled GEMM for blocks.
    def quantize_activation(self, x: torch.Tensor, input_scale: torch.Tensor | None, block: bool) -> Fp8Activation:
        if input_scale is not None:  # static per-tensor scale: no reduction to fuse
            return super().quantize_activation(x, input_scale, block)
        return Fp8Activation(*quantize_fp8(x, FP8_GROUP if block else None), x.dtype)

    def rms_norm_fp8(self, x: torch.Tensor, weight: torch.Tensor, eps: float, block: bool) -> Fp8Activation:
        return Fp8Activation(*rms_norm_fp8(x, weight, eps, FP8_GROUP if block else None), x.dtype)

    def add_rms_norm_fp8(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         block: bool) -> tuple[Fp8Activation, torch.Tensor]:
        q, scale, residual = add_rms_norm_fp8(x, residual, weight, eps, FP8_GROUP if block else None)
        return Fp8Activation(q, scale, x.dtype), residual

    def silu_and_mul_fp8(self, x: torch.Tensor, block: bool) -> Fp8Activation:
        return Fp8Activation(*silu_and_mul_fp8(x, FP8_GROUP if block else None), x.dtype)

    def fp8_linear(self, x: torch.Tensor | Fp8Activation, weight: torch.Tensor, weight_scale: torch.Tensor,
                   input_scale: torch.Tensor | None, bias: torch.Tensor | None, block: bool) -> torch.Tensor:
        a = x if isinstance(x, Fp8Activation) else self.quantize_activation(x, input_scale, block)
        if block:
            gemm = fp8_gemm_block
        elif FP8_SPLITK and a.q.shape[0] <= FP8_SPLITK_MAX_ROWS:
            gemm = fp8_gemm_splitk
        else:
            gemm = fp8_gemm_channel
        return gemm(a.q, a.scale, weight, weight_scale, bias, out_dtype=a.dtype)

    def fused_moe(self, x: torch.Tensor, router_logits: torch.Tensor, experts: MoeExperts, top_k: int,
                  renormalize: bool, weights_dtype: torch.dtype | None = None,
                  topk_softmax: bool = False) -> torch.Tensor:
        """Decode steps (``moe_args.use_moe_decode``: up to 8 tokens of MXFP4 experts, one of float ones): two
        matrix-vector kernels, each program routing its own token and streaming its expert's rows; more tokens:
        routing, tokens grouped by expert on the device, and two grouped GEMMs. Either way the gate runs in the
        first kernel's epilogue, the routing weights in the second's, only the experts some token chose are read,
        and MXFP4 codes are expanded in registers, never to a dequantized copy."""
        moe = fused_moe_decode if use_moe_decode(x.shape[0], experts.scale_gate_up is not None) else fused_moe
        return moe(x, router_logits, top_k=top_k, renormalize=renormalize, weights_dtype=weights_dtype,
                   topk_softmax=topk_softmax, **experts.as_kwargs())

    def model_forward(self, model: nn.Module) -> ModelForward:
        """One-token steps take the fused matrix-vector forward (``one_token.py``), the others the model; a
        family of another layer layout than those it knows (``fused_one_token = None``) runs its own forward."""
        return OneTokenFusedForward(model) if getattr(model, "fused_one_token", None) else model

    def add_lora(self, out: torch.Tensor, x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor, meta: Any,
                 shard_sizes: tuple[int, ...]) -> None:
        """The shrink and expand kernels (a program per block of one adapter's tokens; CUDA-graph capturable)."""
        add_lora(out, x, a_stack, b_stack, meta, shard_sizes, use_triton=True)

    def causal_conv1d(self, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                      query_start_loc: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> torch.Tensor:
        """One launch for decodes and chunks alike (a program per sequence and channel tile, its slot's buffer
        read and rewritten in place); no host sync."""
        return causal_conv1d(x, weight, conv_state, query_start_loc, slots, has_state)

    def gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
                         slots: torch.Tensor, has_state: torch.Tensor, use_qk_l2norm: bool = True,
                         scale: float | None = None) -> torch.Tensor:
        """Decodes alone (T == B, from the shapes): the fused recurrent kernel, CUDA-graph capturable; a step with
        prompt chunks: the chunked pair (every 64-token block's UT solve in parallel, then a scan per sequence).
        Both gate a and b in registers where they read them."""
        return gated_delta_rule(q, k, v, a, b, state, query_start_loc, slots, has_state, use_qk_l2norm, scale,
                                A_log=A_log, dt_bias=dt_bias)

    def gated_rms_norm(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """One launch, a program per token (at one token the fused forward folds it into out_proj instead)."""
        return gated_rms_norm(x, gate, weight, eps)
