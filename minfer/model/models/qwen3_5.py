"""Qwen3.5 (text): three Gated DeltaNet linear-attention layers to one gated full-attention layer.

What differs from Qwen3, each as HF transformers computes it (``modeling_qwen3_5.py``):

- **Layers** by ``layer_types``: ``linear_attention`` (``layers/gated_deltanet.py``: a recurrent state per
  sequence in the engine's state cache, no KV cache) and ``full_attention`` (HF's default: every fourth).
- **Full attention** has an output gate: ``q_proj`` yields, per head, the query and a gate of the same size,
  and the attention output is multiplied by ``sigmoid(gate)`` before ``o_proj``. Its q/k norms and every other
  norm scale by ``1 + w`` in float32 (Gemma's kind: ``RMSNorm(offset=True)``).
- **Partial rotary**: only the first ``partial_rotary_factor`` (1/4) of each head's dimensions rotate, paired
  within that slice. Text positions make the multimodal rope (mrope) a plain one. The rotary table is that
  slice's (``[max_position, rotary_dim]``), and the ops that store the cache rotate only as many dims as the
  table holds; the q/k norms run in the same op (one launch on the Triton ops).
- The multi-token-prediction head (``mtp.*``) and a vision tower's tensors are never read.

The engine sees the difference through two lists: ``attention_layers`` (the full layers: the paged KV cache)
and ``state_layers`` (the linear layers: one state slot per running sequence). Such a model's recurrent state
cannot be recovered for a prefix from its blocks, so the engine turns prefix caching off for it and computes
each of a request's ``n`` samples from its own prompt (``engine/state_cache.py``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minfer.config import ModelConfig
from minfer.distributed import SINGLE, TensorParallel
from minfer.model.layers.attention import Attention
from minfer.model.layers.embedding import VocabParallelEmbedding
from minfer.model.layers.gated_deltanet import GatedDeltaNet
from minfer.model.layers.linear import FusedLinear
from minfer.model.layers.mlp import GatedMLP
from minfer.model.layers.norm import RMSNorm
from minfer.model.layers.rotary import RotaryEmbedding
from minfer.model.models.llama import LlamaForCausalLM
from minfer.model.quantization.base import UNQUANTIZED, QuantConfig
from minfer.ops import AttentionMetadata, Ops, RopeInputs

LINEAR, FULL = "linear_attention", "full_attention"


class GatedAttention(nn.Module):
    """Full attention with Qwen3.5's output gate, (1 + w) q/k norms and partial rotary."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, ops: Ops,
                 tp: TensorParallel = SINGLE, quant: QuantConfig | None = None, prefix: str = "self_attn") -> None:
        super().__init__()
        self.head_dim = d = cfg.head_dim
        q_head, self.num_heads = tp.split(cfg.num_attention_heads)
        kv_head, self.num_kv_heads = tp.kv_heads(cfg.num_key_value_heads)
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        qkv = quant.linear_method([f"{prefix}.{p}_proj" for p in "qkv"]) if quant else UNQUANTIZED
        o = quant.linear_method([f"{prefix}.o_proj"]) if quant else UNQUANTIZED
        self.qkv_proj = FusedLinear(cfg.hidden_size, [2 * self.q_size, self.kv_size, self.kv_size], cfg.attention_bias,
                                    dtype, rows_from=[2 * q_head * d, kv_head * d, kv_head * d], method=qkv, ops=ops)
        self.o_proj = FusedLinear(self.q_size, [cfg.hidden_size], False, dtype, cols_from=q_head * d, tp=tp,
                                  method=o, ops=ops)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, ops, offset=True)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, ops, offset=True)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, ops)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        t = qkv.shape[0]
        o = self.attention(qkv, positions, meta).view(t, self.num_heads, self.head_dim)
        return self.o_proj((o * torch.sigmoid(self.gate(qkv))).reshape(t, self.q_size))

    def gate(self, qkv: torch.Tensor) -> torch.Tensor:
        """The output gate, a ``[T, H, D]`` view of the fused qkv output: per head, q_proj yields its query, then
        its gate."""
        t, d = qkv.shape[0], self.head_dim
        return qkv[:, :2 * self.q_size].view(t, self.num_heads, 2 * d)[..., d:]

    def attention(self, qkv: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Everything between the qkv projection and the output gate: q/k norms, partial rotary, KV store (one
        op), attention -> ``[T, q_size]`` (the batch-1 forward, ``ops/one_token.py``, gates it in o_proj's
        prologue). q is a strided view of the fused output (each head's query beside its gate)."""
        t, d = qkv.shape[0], self.head_dim
        qg, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = qg.view(t, self.num_heads, 2 * d)[..., :d]
        rope = RopeInputs(positions, self.rotary.cos_sin_cache, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        o = self.attn(q, k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d), rope, meta)
        return o.reshape(t, self.q_size)


class Qwen3_5DecoderLayer(nn.Module):
    """(1 + w) pre-norms around a token mixer (Gated DeltaNet or gated attention) and the MLP."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, ops: Ops, mlp: nn.Module,
                 tp: TensorParallel, quant: QuantConfig | None, index: int) -> None:
        super().__init__()
        self.linear = cfg.layer_types[index] == LINEAR
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops, offset=True)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, dtype, ops, tp, quant, f"layers.{index}.linear_attn")
        else:
            self.self_attn = GatedAttention(cfg, rotary, dtype, ops, tp, quant, f"layers.{index}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops, offset=True)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.linear_attn(x, meta) if self.linear else self.self_attn(x, positions, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    fused_one_token = "qwen3_5"  # the batch-1 fused forward's layout for the hybrid layers (ops/one_token.py)
    packed_modules = {**LlamaForCausalLM.packed_modules,
                      "in_proj_z": ("in_proj_zba", 0), "in_proj_b": ("in_proj_zba", 1), "in_proj_a": ("in_proj_zba", 2),
                      "out_proj": ("out_proj", 0)}

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """The multi-token-prediction head and a vision tower are not served."""
        return None if name.startswith(("mtp.", "model.visual.")) else name

    @classmethod
    def stacked_modules(cls, config: ModelConfig) -> dict[str, tuple[str, list[int]]]:
        """The checkpoint's ``in_proj_qkv`` stacks the linear layers' q, k and v channels."""
        x = config.extra
        qk = x["linear_num_key_heads"] * x["linear_key_head_dim"]
        return {"in_proj_qkv": ("in_proj_qkv", [qk, qk, x["linear_num_value_heads"] * x["linear_value_head_dim"]])}

    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        n = int(hf["num_hidden_layers"])
        interval = int(hf.get("full_attention_interval", 4))
        types = tuple(hf.get("layer_types") or (LINEAR if (i + 1) % interval else FULL for i in range(n)))
        rope = dict(hf.get("rope_parameters") or {})
        partial = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)))
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"Qwen3.5: rope_type {rope['rope_type']!r} is not supported (default only)")
        plain = {**hf, "rope_parameters": {"rope_type": "default", "rope_theta": rope.get("rope_theta",
                                                                                         hf.get("rope_theta", 1e7))}}
        keys = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "linear_conv_kernel_dim")
        return ModelConfig.from_hf(plain, attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True,
                                   layer_types=types,
                                   extra={k: int(hf[k]) for k in keys} | {"partial_rotary_factor": partial})

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_position: int, ops: Ops,
                 tp: TensorParallel = SINGLE, quant: QuantConfig | None = None) -> None:
        nn.Module.__init__(self)  # (Llama's constructor builds Llama's layers)
        self.config, self.quant = cfg, quant
        rotary_dim = int(cfg.head_dim * cfg.extra["partial_rotary_factor"])
        rotary = RotaryEmbedding(rotary_dim, max_position, cfg.rope_theta, None)  # the rotated slice's table
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(cfg, rotary, dtype, ops, self.make_mlp(cfg, i, dtype, ops, tp, quant), tp, quant, i)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops, offset=True)
        self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings
                        else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp))
        self.stack_checkpoint_rows()

    def make_mlp(self, cfg: ModelConfig, index: int, dtype: torch.dtype, ops: Ops, tp: TensorParallel,
                 quant: QuantConfig | None) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, ops, tp, quant, f"layers.{index}.mlp")

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers if not layer.linear]

    def state_layers(self) -> list[GatedDeltaNet]:
        """The layers whose memory is a per-sequence state (the engine's state cache)."""
        return [layer.linear_attn for layer in self.layers if layer.linear]

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        h, d, x = config.hidden_size, config.head_dim, config.extra
        q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
        qk = x["linear_num_key_heads"] * x["linear_key_head_dim"]
        vd = x["linear_num_value_heads"] * x["linear_value_head_dim"]
        hv = x["linear_num_value_heads"]
        shapes = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (config.vocab_size, h)
        for n, kind in enumerate(config.layer_types):
            p = f"model.layers.{n}."
            if kind == LINEAR:
                a = p + "linear_attn."
                shapes |= {a + "in_proj_qkv.weight": (2 * qk + vd, h), a + "in_proj_z.weight": (vd, h),
                           a + "in_proj_b.weight": (hv, h), a + "in_proj_a.weight": (hv, h),
                           a + "conv1d.weight": (2 * qk + vd, 1, x["linear_conv_kernel_dim"]),
                           a + "dt_bias": (hv,), a + "A_log": (hv,), a + "norm.weight": (x["linear_value_head_dim"],),
                           a + "out_proj.weight": (h, vd)}
            else:
                a = p + "self_attn."
                shapes |= {a + "q_proj.weight": (2 * q, h), a + "k_proj.weight": (kv, h), a + "v_proj.weight": (kv, h),
                           a + "o_proj.weight": (h, q), a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)}
            shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
            shapes |= cls._mlp_shapes(config, n, p)
        return shapes
