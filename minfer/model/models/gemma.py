"""Gemma 2 and Gemma 3 (text): Llama's projections with Gemma's own arithmetic around them.

What differs from Llama, each as HF transformers computes it (``modeling_gemma2.py``, ``modeling_gemma3.py``):

- **Norms** scale by ``1 + w`` in float32 and round once (``RMSNorm(offset=True)``), and each layer is a
  sandwich: a norm before *and after* attention and the MLP (input / post_attention / pre_feedforward /
  post_feedforward), the residual added after the post-norm.
- **Embeddings** are multiplied by ``sqrt(hidden)`` *rounded to the model dtype* (HF casts the normalizer:
  sqrt(3840) = 61.97 becomes 62.0 in bfloat16).
- **Attention** scales scores by ``query_pre_attn_scalar ** -0.5`` (not head_dim's), may soft-cap them
  (Gemma 2: ``attn_logit_softcapping``), and alternates sliding-window and global layers (``layer_types``; HF's
  default patterns when a config has none: every other layer global in Gemma 2, every sixth in Gemma 3).
- **Logits** may be soft-capped (Gemma 2: ``final_logit_softcapping``), in the model dtype as HF does. The cap
  is monotonic, so greedy tokens alone would not see it: logprobs do.
- **Gemma 3** adds per-head q/k norms (Gemma's ``1 + w`` kind) before rotary, and two rotary tables: the local
  base (``rope_local_base_freq``, 10 000) for sliding layers, the global base (1e6, linear scaling x8 on 4B+)
  for global ones. transformers 5 writes both in one ``rope_parameters`` dict keyed by layer type.
- The MLP is GeGLU (``gelu_pytorch_tanh``), and the LM head is the embedding (tied).

Hooks a subclass (Gemma 4) can override: ``hf_defaults`` (HF's config defaults for keys a config may omit),
``default_layer_types``, ``split_rope`` (the global rope for ``ModelConfig.from_hf``, the local one apart),
``family_extra``, ``layer_rope`` (a layer's rotary base and scaling), ``make_layer`` / ``make_mlp``, ``embed``
and ``softcap_logits``; ``GemmaDecoderLayer.make_attention``; ``GemmaAttention`` takes its scale, window and
soft-cap from the config.
"""
from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from minfer.config import ModelConfig
from minfer.distributed import SINGLE, TensorParallel
from minfer.model.layers.attention import Attention
from minfer.model.layers.embedding import VocabParallelEmbedding
from minfer.model.layers.mlp import GatedMLP
from minfer.model.layers.norm import RMSNorm
from minfer.model.layers.rotary import RotaryEmbedding
from minfer.model.models.llama import LlamaAttention, LlamaForCausalLM
from minfer.model.quantization.base import QuantConfig
from minfer.ops import AttentionMetadata, Ops

SLIDING = "sliding_attention"
FULL = "full_attention"


class GemmaAttention(LlamaAttention):
    """Llama's fused qkv, rotary and paged attention, with Gemma's scale (``query_pre_attn_scalar ** -0.5``),
    score soft-cap and per-layer window; Gemma 3's q/k norms are ``1 + w`` norms, whose float32 weights the
    ops' q/k norm path reads as Gemma's rounding (the multiply in float32, one rounding)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, ops: Ops,
                 tp: TensorParallel = SINGLE, quant: QuantConfig | None = None, prefix: str = "self_attn",
                 index: int = 0) -> None:
        window = cfg.layer_window(index)
        super().__init__(cfg, rotary, dtype, ops, tp, quant, prefix, window)
        if cfg.qk_norm:  # (Llama's plain norms, built above, give way to Gemma's)
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops, offset=True)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops, offset=True)
        extra = cfg.extra
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, ops,
                              scale=extra["query_pre_attn_scalar"] ** -0.5, window=window,
                              softcap=extra["attn_logit_softcapping"])


class GemmaDecoderLayer(nn.Module):
    """Norms on both sides of attention and of the MLP; the residual stream is added after the post-norms.

    As in Llama's layer, the stream travels beside the output and the next pre-norm adds it (its fused
    add + norm): ``forward`` returns (post-normed MLP output, residual), whose sum is HF's hidden state."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, ops: Ops, mlp: nn.Module,
                 tp: TensorParallel = SINGLE, quant: QuantConfig | None = None, index: int = 0) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops, offset=True)

        self.input_layernorm = norm()
        self.self_attn = self.make_attention(cfg, rotary, dtype, ops, tp, quant, index)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = mlp
        self.post_feedforward_layernorm = norm()
        # the formats the projections want their inputs in, emitted by the pre-norms
        self.attn_in = self.self_attn.qkv_proj.input_quant
        self.mlp_in = mlp.gate_up_proj.input_quant if isinstance(mlp, GatedMLP) else None

    def make_attention(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, ops: Ops,
                       tp: TensorParallel, quant: QuantConfig | None, index: int) -> nn.Module:
        """Layer ``index``'s attention (a module with ``qkv_proj`` and ``attn``)."""
        return GemmaAttention(cfg, rotary, dtype, ops, tp, quant, f"layers.{index}.self_attn", index)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x, out=self.attn_in)
        else:
            x, residual = self.input_layernorm(x, residual, out=self.attn_in)
        x = self.post_attention_layernorm(self.self_attn(x, positions, meta))
        x, residual = self.pre_feedforward_layernorm(x, residual, out=self.mlp_in)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


def _rope_args(params: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) of one rope parameter dict, as ``RotaryEmbedding`` takes them."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"unsupported rope type {kind!r} in {where}; supported: default, linear, llama3")
    scaling = None if kind == "default" else {k: v for k, v in params.items() if k != "rope_theta"} | {"rope_type": kind}
    return float(params["rope_theta"]), scaling


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: soft-capped attention scores and logits, alternating sliding / global layers."""

    fused_one_token = "gemma"  # the Triton fused batch-1 forward's Gemma layout (ops/one_token.py)
    qk_norm = False
    # HF's config defaults (Gemma2Config) for the keys this family reads: a config written with only the
    # fields that differ from them (older transformers' diff) means these
    hf_defaults: dict[str, Any] = dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
        rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, attention_bias=False,
        query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)

    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        hf = {**cls.hf_defaults, **hf}
        name = (hf.get("architectures") or [cls.__name__])[0]
        if hf.get("attention_bias"):
            raise ValueError(f"{name}: attention_bias=true is not supported (no released Gemma has it)")
        if hf.get("use_bidirectional_attention"):
            raise ValueError(f"{name}: use_bidirectional_attention=true (an encoder) is not supported")
        if hf["hidden_activation"] != "gelu_pytorch_tanh":
            raise ValueError(f"{name}: hidden_activation {hf['hidden_activation']!r} is not supported; "
                             f"supported: gelu_pytorch_tanh")
        types = tuple(hf.get("layer_types") or cls.default_layer_types(hf, int(hf["num_hidden_layers"])))
        global_hf, local = cls.split_rope(hf)
        return ModelConfig.from_hf(global_hf, qk_norm=cls.qk_norm, layer_types=types,
                                   extra=cls.family_extra(hf, local))

    @classmethod
    def default_layer_types(cls, hf: dict[str, Any], n: int) -> list[str]:
        """HF's pattern when a config names no ``layer_types``: odd layers (from 0) global."""
        return [SLIDING if (i + 1) % 2 else FULL for i in range(n)]

    @classmethod
    def split_rope(cls, hf: dict[str, Any]) -> tuple[dict[str, Any], tuple[float, dict[str, Any] | None] | None]:
        """The config as ``ModelConfig.from_hf`` reads its (global) rope, and the sliding layers' own rope
        (theta, scaling), None when they share the global one (Gemma 2)."""
        return hf, None

    @classmethod
    def family_extra(cls, hf: dict[str, Any], local_rope: tuple[float, dict[str, Any] | None] | None) -> dict[str, Any]:
        """``ModelConfig.extra``: the scalar, the soft-caps (0: none) and the sliding layers' rope."""
        return dict(query_pre_attn_scalar=float(hf["query_pre_attn_scalar"]),
                    attn_logit_softcapping=float(hf.get("attn_logit_softcapping") or 0.0),
                    final_logit_softcapping=float(hf.get("final_logit_softcapping") or 0.0),
                    local_rope=local_rope)

    @classmethod
    def layer_rope(cls, cfg: ModelConfig, index: int) -> tuple[float, dict[str, Any] | None]:
        """Layer ``index``'s rotary (theta, scaling): the sliding layers' own where the config has one."""
        local = cfg.extra.get("local_rope")
        if local is not None and cfg.layer_types and cfg.layer_types[index] == SLIDING:
            return local
        return cfg.rope_theta, cfg.rope_scaling

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Llama's tensors plus each layer's pre/post feed-forward norms (after its post-attention norm)."""
        h = config.hidden_size
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in super().checkpoint_shapes(config).items():
            shapes[name] = shape
            if name.endswith(".post_attention_layernorm.weight"):
                layer = name.removesuffix("post_attention_layernorm.weight")
                shapes |= {layer + "pre_feedforward_layernorm.weight": (h,),
                           layer + "post_feedforward_layernorm.weight": (h,)}
        return shapes

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_position: int, ops: Ops,
                 tp: TensorParallel = SINGLE, quant: QuantConfig | None = None) -> None:
        nn.Module.__init__(self)  # (Llama's constructor builds Llama's layers)
        self.config = cfg
        self.quant = quant
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        # HF's normalizer: a float32 tensor rounded to the model dtype
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5, dtype=torch.float32).to(dtype),
                             persistent=False)
        tables: dict[str, RotaryEmbedding] = {}  # one table per distinct rope setting, shared by its layers

        def rotary(index: int) -> RotaryEmbedding:
            theta, scaling = self.layer_rope(cfg, index)
            key = json.dumps([theta, scaling], sort_keys=True)
            if key not in tables:
                tables[key] = RotaryEmbedding(cfg.head_dim, max_position, theta, scaling)
            return tables[key]

        self.layers = nn.ModuleList(self.make_layer(cfg, rotary(i), dtype, ops, tp, quant, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops, offset=True)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)

    def make_layer(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, ops: Ops,
                   tp: TensorParallel, quant: QuantConfig | None, index: int) -> nn.Module:
        """Decoder layer ``index``."""
        return GemmaDecoderLayer(cfg, rotary, dtype, ops, self.make_mlp(cfg, index, dtype, ops, tp, quant),
                                 tp, quant, index)

    def make_mlp(self, cfg: ModelConfig, index: int, dtype: torch.dtype, ops: Ops, tp: TensorParallel,
                 quant: QuantConfig | None) -> nn.Module:
        """GeGLU: the tanh-approximated GELU gates the up projection."""
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, ops, tp, quant, f"layers.{index}.mlp",
                        activation="gelu_tanh")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings times the normalizer, in the model dtype (after the ranks' sum, as on one rank)."""
        return self.embed_tokens(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
        """Llama's final norm and LM head, then the logit soft-cap in the model dtype; in place, so a CUDA
        graph's ``out`` buffer receives the capped logits."""
        logits = self.softcap_logits(super().compute_logits(hidden, float32=False, out=out))
        return logits.float() if float32 else logits

    def softcap_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``cap * tanh(logits / cap)``, each step rounded to the model dtype as HF's three ops are."""
        cap = self.config.extra["final_logit_softcapping"]
        return logits.div_(cap).tanh_().mul_(cap) if cap else logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): q/k norms, five sliding layers to one global, a local rotary base for the sliding
    layers and a global one (with its scaling) for the others; no soft-caps unless the config sets them."""

    qk_norm = True
    hf_defaults: dict[str, Any] = {
        **Gemma2ForCausalLM.hf_defaults, "vocab_size": 262208, "max_position_embeddings": 131072,
        "final_logit_softcapping": None, "attn_logit_softcapping": None}
    global_rope_theta = 1_000_000.0  # HF's defaults of the two bases
    local_rope_theta = 10_000.0

    @classmethod
    def default_layer_types(cls, hf: dict[str, Any], n: int) -> list[str]:
        """HF's pattern: every ``sliding_window_pattern``-th layer (6 unless the config says) global."""
        pattern = int(hf.get("sliding_window_pattern", 6))
        return [SLIDING if (i + 1) % pattern else FULL for i in range(n)]

    @classmethod
    def split_rope(cls, hf: dict[str, Any]) -> tuple[dict[str, Any], tuple[float, dict[str, Any] | None] | None]:
        """The two ropes as HF builds them: transformers 5's ``rope_parameters`` keyed by layer type, or the
        older ``rope_theta`` + ``rope_scaling`` (global) and ``rope_local_base_freq`` (local)."""
        by_type = hf.get("rope_parameters") or {}
        full = dict(by_type.get(FULL) or {"rope_type": "default"})
        scaling = dict(hf.get("rope_scaling") or {})
        if "type" in scaling and "rope_type" not in scaling:  # the oldest configs' name
            scaling["rope_type"] = scaling.pop("type")
        full.update(scaling)
        full.setdefault("rope_theta", float(hf.get("rope_theta", cls.global_rope_theta)))
        local = dict(by_type.get(SLIDING) or {"rope_type": "default"})
        local.setdefault("rope_theta", float(hf.get("rope_local_base_freq", cls.local_rope_theta)))
        return {**hf, "rope_parameters": full, "rope_scaling": None}, _rope_args(local, "the sliding layers' rope")
