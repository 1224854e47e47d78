"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat batch of tokens.

Every layer but attention sees a ``[num_tokens, hidden]`` matrix; the model differs between
families only by q/k/v bias (Qwen2) and per-head q/k RMSNorm before rotary (Qwen3).
"""
from __future__ import annotations

import torch
from torch import nn

from minfer.config import ModelConfig
from minfer.model.attention import Attention, AttentionMetadata, RopeInputs
from minfer.model.layers import FusedLinear, GatedMLP, RMSNorm, RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, backend: str) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        triton = backend == "triton"
        self.qkv_proj = FusedLinear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], cfg.attention_bias,
                                    dtype, triton)
        self.o_proj = FusedLinear(self.q_size, [cfg.hidden_size], False, dtype, triton)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, triton) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, triton) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, backend)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(self.qkv_proj(x), positions, meta)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Everything after the qkv projection: norms, rotary, KV store, attention, o_proj."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # views into the fused qkv output
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.attn.backend == "triton":  # norms + rotary + KV store: one kernel
            rope = RopeInputs(positions, self.rotary.cos_sin_cache)
            if self.q_norm is not None:
                rope.q_norm_weight, rope.k_norm_weight, rope.eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
            return self.o_proj(self.attn(q, k, v, meta, rope).reshape(t, self.q_size))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta).reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, backend: str) -> None:
        super().__init__()
        triton = backend == "triton"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, triton)
        self.self_attn = LlamaAttention(cfg, rotary, dtype, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, triton)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, triton)
        self.triton = triton

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if self.triton and x.shape[0] == 1:
            return self._forward_one_token(x, residual, positions, meta)
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def _forward_one_token(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                           meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch 1, where each small kernel costs about what a matrix-vector product does: both norms
        run in the prologue of the matrix-vector kernel after them and SwiGLU in the down projection's,
        three launches fewer per layer (``kernels/gemv.py``)."""
        from minfer.kernels.gemv import gemv_rms_norm, gemv_silu_mul

        ln, attn, mlp = self.input_layernorm, self.self_attn, self.mlp
        qkv, residual = gemv_rms_norm(x, residual, ln.weight, ln.eps, attn.qkv_proj.weight, attn.qkv_proj.bias)
        x = attn.attend(qkv, positions, meta)
        ln = self.post_attention_layernorm
        gate_up, residual = gemv_rms_norm(x, residual, ln.weight, ln.eps, mlp.gate_up_proj.weight)
        return gemv_silu_mul(gate_up, mlp.down_proj.weight), residual


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns final hidden states; ``compute_logits`` only for
    the rows that sample, since the LM head is the largest matmul of a decode step."""

    # checkpoint name fragment -> (fused parameter's module name, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
        "o_proj": ("o_proj", 0), "down_proj": ("down_proj", 0),
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_position: int, backend: str = "torch") -> None:
        super().__init__()
        self.config = cfg
        triton = backend == "triton"
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, dtype, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, triton)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)  # a weight holder
            self.lm_head.weight.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, meta)
        return x + residual  # the final norm runs in compute_logits, on the sampling rows only

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm + LM head for the selected rows, as float32 logits (or in the model dtype, for a
        consumer that converts as it reads: the cast writes and rereads [rows, vocab] floats).
        ``out`` (model dtype) receives the model-dtype logits: the decode CUDA graphs' static buffer."""
        logits = torch.mm(self.norm(hidden), self.lm_head.weight.t(), out=out)
        return logits.float() if float32 else logits

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]
