"""The torch ops: HF's rounding everywhere. The CPU path, and the reference of the Triton ops."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from minfer.kernels.quant.kv_quant import write_kv_rows
from minfer.ops.base import Ops
from minfer.ops.metadata import AttentionMetadata, PagedKVCache, RopeInputs
from minfer.ops.torch_attention import rotate_hf, torch_decode_attention, torch_prefill_attention
from minfer.ops.torch_sampling import gumbel_argmax


def rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama's RMSNorm: statistics in float32, the weight multiply in the model dtype; with a float32
    weight, HF Gemma's: the multiply in float32 (its ``1 + w``), one rounding at the end."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32:
        return (xf * weight).to(x.dtype)
    return weight * xf.to(x.dtype)


class TorchOps(Ops):
    name = "torch"
    cuda_graphs = False  # attention sizes its work from host integers (the context lengths)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_hf(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + residual  # in the model dtype, as HF adds
        return rms_norm_hf(x, weight, eps), x

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rope_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeInputs,
                      cache: PagedKVCache, slot_mapping: torch.Tensor) -> torch.Tensor:
        if rope.q_norm_weight is not None:
            q, k = rms_norm_hf(q, rope.q_norm_weight, rope.eps), rms_norm_hf(k, rope.k_norm_weight, rope.eps)
        q, k = rotate_hf(rope.positions, rope.cos_sin_cache, q, k)
        write_kv_rows(k, v, cache.k_cache, cache.v_cache, slot_mapping, cache.k_scale, cache.v_scale)
        return q

    def rope_q(self, q: torch.Tensor, rope: RopeInputs) -> torch.Tensor:
        if rope.q_norm_weight is not None:
            q = rms_norm_hf(q, rope.q_norm_weight, rope.eps)
        return rotate_hf(rope.positions, rope.cos_sin_cache, q, q[:, :0])[0]  # k: no heads

    def paged_attention(self, q: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
        kc, vc = cache.k_cache, cache.v_cache
        how = dict(k_scale=cache.k_scale, v_scale=cache.v_scale, window=cache.window, softcap=cache.softcap,
                   sinks=cache.sinks, block_tables=meta.block_tables[cache.kv_group])
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = torch_decode_attention(q[:nd], kc, vc, meta, scale, **how)
        if nd < q.shape[0]:
            out[nd:] = torch_prefill_attention(q, kc, vc, meta, scale, **how)
        return out

    def greedy_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(-1)

    def gumbel_argmax(self, logits: torch.Tensor, row_hash: torch.Tensor,
                      inv_temperature: torch.Tensor) -> torch.Tensor:
        return gumbel_argmax(logits, row_hash, inv_temperature)
