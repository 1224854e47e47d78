"""The Triton ops: the engine's kernels (``minfer/kernels``) behind the ops names.

Imported only when the Triton ops are chosen (``select_ops``), so the torch path never loads Triton.
"""
from __future__ import annotations

import torch
from torch import nn

from minfer.kernels.activation import silu_and_mul
from minfer.kernels.decode_attention import paged_decode_attention
from minfer.kernels.fp8_gemm import fp8_gemm_block, fp8_gemm_channel
from minfer.kernels.fp8_quant import quantize_fp8
from minfer.kernels.prefill_attention import paged_prefill_attention
from minfer.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from minfer.kernels.rope_store import rope_store_kv
from minfer.kernels.sampling import greedy_argmax, gumbel_argmax
from minfer.ops.base import ModelForward, Ops
from minfer.ops.metadata import AttentionMetadata, PagedKVCache, RopeInputs
from minfer.ops.one_token import OneTokenFusedForward


class TritonOps(Ops):
    name = "triton"
    cuda_graphs = True

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x if x.dim() == 3 else x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_add_rms_norm(x, residual, weight, eps), residual  # residual updated in place

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def rope_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeInputs,
                      cache: PagedKVCache, slot_mapping: torch.Tensor) -> torch.Tensor:
        rope_store_kv(q, k, v, rope.positions, rope.cos_sin_cache, cache.k_cache, cache.v_cache, slot_mapping,
                      k_scale=cache.k_scale, v_scale=cache.v_scale, q_norm_weight=rope.q_norm_weight,
                      k_norm_weight=rope.k_norm_weight, eps=rope.eps)
        return q  # rotated in place

    def paged_attention(self, q: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
        kc, vc, scales = cache.k_cache, cache.v_cache, dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            paged_decode_attention(q[:nd], kc, vc, meta.block_tables[:nd], meta.context_lens[:nd], scale,
                                   out=out[:nd], **scales)
        if nd < q.shape[0]:
            paged_prefill_attention(q[nd:], kc, vc, meta.prefill_block_tables, meta.prefill_query_start_loc,
                                    meta.prefill_context_lens, meta.max_prefill_query_len, scale, out=out[nd:],
                                    **scales)
        return out

    def greedy_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return greedy_argmax(logits)

    def gumbel_argmax(self, logits: torch.Tensor, row_hash: torch.Tensor,
                      inv_temperature: torch.Tensor) -> torch.Tensor:
        return gumbel_argmax(logits.contiguous(), row_hash, inv_temperature)

    def fp8_linear(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   input_scale: torch.Tensor | None, bias: torch.Tensor | None, block: bool) -> torch.Tensor:
        """Activations quantized per token (per 128-column group for blocks; by the static scale where the
        checkpoint has one), then the product on FP8 tensor cores: cuBLASLt's row-wise scaled GEMM for the
        channel format, the Triton block-scaled GEMM for blocks. On the CPU (the interpreter), the reference."""
        if x.device.type != "cuda":
            return super().fp8_linear(x, weight, weight_scale, input_scale, bias, block)
        x2 = x.reshape(-1, x.shape[-1])
        if block:
            xq, xs = quantize_fp8(x2, 128)
            y = fp8_gemm_block(xq, xs, weight, weight_scale, bias, out_dtype=x.dtype)
        else:
            if input_scale is None:
                xq, xs = quantize_fp8(x2)
            else:
                xq = (x2.float() / input_scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
                xs = input_scale.expand(x2.shape[0]).contiguous()
            y = fp8_gemm_channel(xq, xs, weight, weight_scale, bias, out_dtype=x.dtype)
        return y.view(*x.shape[:-1], weight.shape[0])

    def model_forward(self, model: nn.Module) -> ModelForward:
        """One-token steps take the fused matrix-vector forward (``one_token.py``), the others the model."""
        return OneTokenFusedForward(model)
