"""An EAGLE-3 draft head (Li et al., 2025) in the public checkpoint format: one Llama decoder layer that drafts
from the target's own hidden states, not a model that serves on its own.

The target's residual stream at three of its layers (the inputs to the layers ``aux_layer_ids`` names; HF's
``output_hidden_states[i]``) is concatenated and projected to the head's width by ``fc``. At position p the
layer takes that feature of p with the embedding of token p + 1 (each normed: ``hidden_norm``,
``input_layernorm``), concatenated to twice the width for q/k/v; its output, before the final norm, is the
feature its next draft step takes in place of the target's. ``lm_head`` covers a smaller draft vocabulary:
draft id i is target id ``i + d2t[i]``. The token embedding is the target's unless the checkpoint brings one.

Checkpoint names: ``fc``, ``midlayer.*`` (or ``layers.0.*``), ``norm``, ``lm_head``, ``d2t`` (``t2d`` unread),
config ``draft_vocab_size``, ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minfer.config import ModelConfig
from minfer.distributed import SINGLE, TensorParallel
from minfer.model.layers.attention import Attention
from minfer.model.layers.embedding import VocabParallelEmbedding
from minfer.model.layers.linear import FusedLinear
from minfer.model.layers.mlp import GatedMLP
from minfer.model.layers.norm import RMSNorm
from minfer.model.layers.rotary import RotaryEmbedding
from minfer.model.models.llama import LlamaAttention, LlamaForCausalLM
from minfer.model.quantization.base import QuantConfig
from minfer.ops import AttentionMetadata, Ops


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's layers when the head does not name them: early, middle and late."""
    return 2, num_layers // 2, num_layers - 3


class Eagle3Attention(LlamaAttention):
    """Llama attention whose q/k/v read the embedding and the feature side by side (twice the width)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, ops: Ops) -> None:
        super().__init__(cfg, rotary, dtype, ops)
        self.qkv_proj = FusedLinear(2 * cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], False, dtype,
                                    ops=ops)


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, ops: Ops) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.hidden_norm = RMSNorm(h, eps, dtype, ops)
        self.input_layernorm = RMSNorm(h, eps, dtype, ops)
        self.self_attn = Eagle3Attention(cfg, rotary, dtype, ops)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, ops)
        self.mlp = GatedMLP(h, cfg.intermediate_size, dtype, ops)

    def forward(self, embeds: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], dim=-1)
        x, residual = self.post_attention_layernorm(self.self_attn(x, positions, meta), feature)
        return self.mlp(x) + residual


class DraftVocab(nn.Module):
    """``d2t``: each draft id's offset to its target id (zeros: the same vocabulary)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.d2t = nn.Parameter(torch.zeros(size, dtype=torch.int64), requires_grad=False)


class Eagle3Head(nn.Module):
    """``combine`` the target's captured states into features, ``forward`` one draft step, ``compute_logits``
    over the draft vocabulary, placed in the target's."""

    is_draft_head = True  # drafts for a target (speculative_config.method 'eagle3'); never serves alone
    packed_modules = LlamaForCausalLM.packed_modules | {"fc": ("fc", 0)}
    moe_block, expert_matrices, stacked_experts = "mlp", {}, {}
    stacked_modules = LlamaForCausalLM.stacked_modules

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        if name == "t2d":
            return None  # the inverse map: d2t says the same
        if name == "d2t":
            return "vocab.d2t"
        return name.replace("layers.0.", "midlayer.", 1) if name.startswith(("layers.0.", "model.layers.0.")) \
            else name

    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        cfg = ModelConfig.from_hf(hf)
        ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        cfg.extra = {"draft_vocab_size": int(hf.get("draft_vocab_size") or cfg.vocab_size),
                     "target_hidden_size": int(hf.get("target_hidden_size") or cfg.hidden_size),
                     "aux_layer_ids": tuple(int(i) for i in ids) if ids else None}
        if cfg.extra["draft_vocab_size"] > cfg.vocab_size:
            raise ValueError(f"EAGLE-3 head: draft_vocab_size {cfg.extra['draft_vocab_size']} > vocab_size "
                             f"{cfg.vocab_size}")
        return cfg

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
        q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
        p = "midlayer."
        own = {"embed_tokens.weight": (config.vocab_size, h)} if config.extra.get("own_embedding") else {}
        return own | {"fc.weight": (h, 3 * config.extra["target_hidden_size"]), "norm.weight": (h,),
                "lm_head.weight": (config.extra["draft_vocab_size"], h), "d2t": (config.extra["draft_vocab_size"],),
                p + "hidden_norm.weight": (h,), p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q, 2 * h), p + "self_attn.k_proj.weight": (kv, 2 * h),
                p + "self_attn.v_proj.weight": (kv, 2 * h), p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i)}

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_position: int, ops: Ops,
                 tp: TensorParallel = SINGLE, quant: QuantConfig | None = None) -> None:
        super().__init__()
        if tp.size > 1 or quant is not None:
            raise ValueError("an EAGLE-3 head runs unsplit and unquantized (tensor_parallel_size 1, no quantization)")
        self.config = cfg
        h = cfg.hidden_size
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.fc = FusedLinear(3 * cfg.extra["target_hidden_size"], [h], False, dtype, ops=ops)
        self.midlayer = Eagle3Layer(cfg, rotary, dtype, ops)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype, ops)
        self.lm_head = VocabParallelEmbedding(cfg.extra["draft_vocab_size"], h, dtype)  # a weight holder
        self.vocab = DraftVocab(cfg.extra["draft_vocab_size"])
        self.target_ids: torch.Tensor | None = None  # each draft id's target id, from d2t once it has loaded
        # the checkpoint's own token embedding, or the target's (``share_embedding``)
        self.embed_tokens: Any = VocabParallelEmbedding(cfg.vocab_size, h, dtype) \
            if cfg.extra.get("own_embedding") else None

    def share_embedding(self, embed: Any) -> None:
        """Embed with the target's ``embed`` (a callable on token ids)."""
        self.embed_tokens = embed

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's concatenated layer states [T, 3 * target hidden] as the head's features [T, hidden]."""
        return self.fc(aux)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                feature: torch.Tensor) -> torch.Tensor:
        """The head's output before its final norm: the next step's feature, and ``compute_logits``' input."""
        return self.midlayer(self.embed_tokens(input_ids), feature, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True, out: torch.Tensor | None = None
                       ) -> torch.Tensor:
        """Logits over the target's vocabulary ([R, V]; ``out``: a CUDA graph's buffer of that shape): the draft
        vocabulary's at their target ids (``d2t``), -inf at the ids the head cannot draft."""
        draft = torch.mm(self.norm(hidden), self.lm_head.weight.t())
        if draft.shape[1] == self.config.vocab_size:
            out = draft if out is None else out.copy_(draft)
        else:
            if out is None:
                out = draft.new_empty(draft.shape[0], self.config.vocab_size)
            if self.target_ids is None:
                self.target_ids = torch.arange(draft.shape[1], device=draft.device) + self.vocab.d2t
            out.fill_(float("-inf")).index_copy_(1, self.target_ids, draft)
        return out.float() if float32 else out

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn.attn]
