"""gpt-oss (20b, 120b): Llama's decoder with learned attention sinks and a biased MoE of clamped-SwiGLU experts.

What differs from Llama, each as HF transformers computes it (``modeling_gpt_oss.py``):

- **Attention** has biases on q, k, v *and* o, a learned sink logit per head in the softmax's denominator
  (``Attention(sinks=...)``), and alternates windowed (128) and full layers (``layer_types``; HF's default:
  even layers windowed), which the hybrid KV cache serves with a group of its own.
- **Rotary** is YaRN (factor 32 over a 4k original context, ``truncate: false``).
- **Norms** keep float32 weights and round once after the product (HF's ``_keep_in_fp32_modules``): the
  ops read a float32 norm weight that way.
- **MoE** in every layer: a router with a bias, top-k over its logits *then* a softmax over those k; experts
  with biases whose SwiGLU clamps the gate above and the up projection on both sides at ``swiglu_limit``,
  gates with ``sigmoid(alpha * gate)`` and multiplies by ``up + 1``. The checkpoint stacks each layer's
  experts in one tensor with gate and up *interleaved* (column 2j gate j, 2j + 1 up j); they load into the
  fused op's layout (gate rows, then up rows).
- **MXFP4**: released checkpoints store the experts as e2m1 codes and e8m0 scales (``quantization/mxfp4.py``),
  which stay packed in memory; the MoE op expands them as it multiplies.

Under tensor parallelism heads (and their sinks) and each expert's intermediate features split across the
ranks; the down projection's bias is rank 0's alone, so the all-reduce adds it once. MXFP4 experts split at
32-column scale blocks: each rank's share of the intermediate size must be a multiple of 32.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minfer.config import ModelConfig
from minfer.distributed import TensorParallel
from minfer.model.models.llama import DecoderLayer, LlamaAttention, LlamaForCausalLM
from minfer.model.quantization.base import QuantConfig
from minfer.model.quantization.mxfp4 import BLOCK, CODES_PER_BYTE
from minfer.ops import MoeExperts, Ops

SLIDING, FULL = "sliding_attention", "full_attention"
# HF's default rope when a config names none (GptOssConfig)
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}


class GptOssAttention(LlamaAttention):
    """Llama's attention with an o_proj bias and a sink per head."""

    o_bias = True
    sinks = True


class GptOssDecoderLayer(DecoderLayer):
    attention = GptOssAttention
    float32_norms = True


class GptOssExperts(nn.Module):
    """A layer's experts stacked as the fused MoE op reads them: ``w_gate_up`` [E, 2I, H] (gate rows, then up
    rows) and ``w_down`` [E, H, I], in the model dtype or, packed (MXFP4), uint8 codes [E, 2I, H / 2] and
    [E, H, I / 2] with e8m0 scales [E, 2I, H / 32] and [E, H, I / 32]; biases [E, 2I] and [E, H]. ``I`` is this
    rank's share of the intermediate features."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, tp: TensorParallel, packed: bool) -> None:
        super().__init__()
        e, h = cfg.num_experts, cfg.hidden_size
        self.start, self.inter = tp.split(cfg.moe_intermediate_size)
        self.packed, self.rank = packed, tp.rank
        i = self.inter
        if packed and (h % BLOCK or i % BLOCK or self.start % BLOCK):
            raise ValueError(f"MXFP4 experts split at {BLOCK}-column scale blocks: hidden_size {h} and each rank's "
                             f"share of intermediate_size ({cfg.moe_intermediate_size} / tensor_parallel_size "
                             f"{tp.size} = {i}) must be multiples of {BLOCK}")

        def param(*shape: int, kind: torch.dtype = dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=kind), requires_grad=False)

        if packed:
            self.w_gate_up = param(e, 2 * i, h // CODES_PER_BYTE, kind=torch.uint8)
            self.w_down = param(e, h, i // CODES_PER_BYTE, kind=torch.uint8)
            self.scale_gate_up = param(e, 2 * i, h // BLOCK, kind=torch.uint8)
            self.scale_down = param(e, h, i // BLOCK, kind=torch.uint8)
        else:
            self.w_gate_up, self.w_down = param(e, 2 * i, h), param(e, h, i)
        self.bias_gate_up, self.bias_down = param(e, 2 * i), param(e, h)

    def load_shard(self, name: str, source: Any, shard: Any) -> str:
        """One of the checkpoint's stacked tensors (``gate_up_proj``, ``down_proj``, their ``_bias``, or their
        ``_blocks`` / ``_scales``): this rank's rows or columns, gate/up de-interleaved. Returns the parameter."""
        i, start = self.inter, self.start
        pair = slice(2 * start, 2 * (start + i))  # this rank's interleaved gate/up columns (or rows)
        if name == "gate_up_proj":  # [E, H, 2I], transposed
            return self._set("w_gate_up", _deinterleave(source[:, :, pair], dim=2).transpose(1, 2))
        if name == "gate_up_proj_bias":  # [E, 2I]
            return self._set("bias_gate_up", _deinterleave(source[:, pair], dim=1))
        if name == "down_proj":  # [E, I, H], transposed
            return self._set("w_down", source[:, start:start + i].transpose(1, 2))
        if name == "down_proj_bias":  # [E, H]: rank 0's; the others add zeros to the all-reduce
            bias = source[:]
            return self._set("bias_down", bias if self.rank == 0 else torch.zeros_like(bias))
        if name in ("gate_up_proj_blocks", "gate_up_proj_scales"):  # [E, 2I, H/32, 16] / [E, 2I, H/32]
            rows = _deinterleave(source[:, pair], dim=1)
            return self._set("w_gate_up" if name.endswith("blocks") else "scale_gate_up", rows)
        if name in ("down_proj_blocks", "down_proj_scales"):  # [E, H, I/32, 16] / [E, H, I/32]
            cols = source[:, :, start // BLOCK:(start + i) // BLOCK]
            return self._set("w_down" if name.endswith("blocks") else "scale_down", cols)
        raise ValueError(f"unexpected tensor {name!r} for gpt-oss experts "
                         f"({'MXFP4' if self.packed else 'float'} checkpoint expected)")

    def _set(self, attr: str, tensor: torch.Tensor) -> str:
        target = getattr(self, attr)
        if attr.startswith("w_") and self.packed:
            tensor = tensor.reshape(*tensor.shape[:2], -1)  # [..., K/32, 16] codes -> [..., K/2]
        if tuple(tensor.shape) != tuple(target.shape) or (tensor.dtype == torch.uint8) != (target.dtype == torch.uint8):
            raise ValueError(f"checkpoint tensor {tuple(tensor.shape)} {tensor.dtype} does not fit {attr} "
                             f"{tuple(target.shape)} {target.dtype} (an MXFP4 tensor in a float checkpoint, or the "
                             f"reverse?)")
        target.data.copy_(tensor)
        return attr

    def stacked(self, limit: float, alpha: float) -> MoeExperts:
        """What the fused MoE op multiplies: the parameters themselves, not copies."""
        return MoeExperts(self.w_gate_up, self.w_down, self.bias_gate_up, self.bias_down,
                          self.scale_gate_up if self.packed else None, self.scale_down if self.packed else None,
                          swiglu_limit=limit, swiglu_alpha=alpha)


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Gate/up interleaved along ``dim`` (2j gate, 2j + 1 up) -> all gates, then all ups."""
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


class GptOssMoe(nn.Module):
    """The router (weight and bias, whole on every rank) and the experts; one all-reduce after the op."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, ops: Ops, tp: TensorParallel,
                 quant: QuantConfig | None) -> None:
        super().__init__()
        method = quant.expert_method() if quant is not None else None
        if method is not None and not method.keeps_format:
            raise ValueError(f"gpt-oss experts in {quant.name} are not supported; minfer loads them in bf16 or "
                             f"MXFP4 (the released format)")
        self.ops, self.tp = ops, tp
        self.top_k = cfg.num_experts_per_tok
        self.limit, self.alpha = cfg.extra["swiglu_limit"], cfg.extra["swiglu_alpha"]
        self.router = nn.Module()
        self.router.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size, dtype=dtype),
                                          requires_grad=False)
        self.router.bias = nn.Parameter(torch.empty(cfg.num_experts, dtype=dtype), requires_grad=False)
        self.experts = GptOssExperts(cfg, dtype, tp, packed=method is not None)
        self.moe_experts = self.experts.stacked(self.limit, self.alpha)  # the parameters load in place

    def routed(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """The chosen experts' weighted sum before the all-reduce (``SparseMoeBlock.routed``'s contract)."""
        return self.ops.fused_moe(x, router_logits, self.moe_experts, self.top_k, False, topk_softmax=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.routed(x, F.linear(x, self.router.weight, self.router.bias)))


class GptOssForCausalLM(LlamaForCausalLM):
    decoder_layer = GptOssDecoderLayer
    fused_one_token = "llama"  # Llama's layer: biases and sinks live in the projections and the attention op

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """The sinks live on the attention op's module (``self_attn.attn``), beside the cache they attend over."""
        return name.replace(".self_attn.sinks", ".self_attn.attn.sinks")

    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        n = int(hf["num_hidden_layers"])
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"gpt-oss: hidden_act {hf['hidden_act']!r} is not supported (the clamped SwiGLU is)")
        if not (hf.get("rope_parameters") or hf.get("rope_scaling")):
            hf = {**hf, "rope_scaling": DEFAULT_ROPE, "rope_theta": hf.get("rope_theta", 150000.0)}
        types = tuple(hf.get("layer_types") or (SLIDING if (i + 1) % 2 else FULL for i in range(n)))
        experts = int(hf.get("num_local_experts", hf.get("num_experts", 0)))
        return ModelConfig.from_hf(
            hf, attention_bias=True, layer_types=types, sliding_window=int(hf.get("sliding_window") or 128),
            num_experts=experts, num_experts_per_tok=int(hf.get("num_experts_per_tok", hf.get("experts_per_token", 4))),
            moe_intermediate_size=int(hf["intermediate_size"]), norm_topk_prob=False, moe_layers=tuple(range(n)),
            extra=dict(swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
                       swiglu_alpha=float(hf.get("swiglu_alpha", 1.702))))

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Llama's tensors (q/k/v biases included) with o_proj's bias and the sinks; the MoE block as the released
        checkpoints store it (MXFP4 codes and scales when the config says so, else bf16 stacks)."""
        h, heads = config.hidden_size, config.num_attention_heads
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in super().checkpoint_shapes(config).items():
            shapes[name] = shape
            if name.endswith("self_attn.o_proj.weight"):
                attn = name.removesuffix("o_proj.weight")
                shapes |= {attn + "o_proj.bias": (h,), attn + "sinks": (heads,)}
        return shapes

    @classmethod
    def _mlp_shapes(cls, config: ModelConfig, layer: int, prefix: str) -> dict[str, tuple[int, ...]]:
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        p = prefix + "mlp."
        shapes = {p + "router.weight": (e, h), p + "router.bias": (e,)}
        if (config.quantization_config or {}).get("quant_method") == "mxfp4":
            shapes |= {p + "experts.gate_up_proj_blocks": (e, 2 * i, h // BLOCK, BLOCK // CODES_PER_BYTE),
                       p + "experts.gate_up_proj_scales": (e, 2 * i, h // BLOCK),
                       p + "experts.down_proj_blocks": (e, h, i // BLOCK, BLOCK // CODES_PER_BYTE),
                       p + "experts.down_proj_scales": (e, h, i // BLOCK)}
        else:
            shapes |= {p + "experts.gate_up_proj": (e, h, 2 * i), p + "experts.down_proj": (e, i, h)}
        return shapes | {p + "experts.gate_up_proj_bias": (e, 2 * i), p + "experts.down_proj_bias": (e, h)}

    def make_mlp(self, cfg: ModelConfig, index: int, dtype: torch.dtype, ops: Ops, tp: TensorParallel,
                 quant: QuantConfig | None) -> nn.Module:
        return GptOssMoe(cfg, dtype, ops, tp, quant)

