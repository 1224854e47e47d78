"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3; Qwen3-MoE and Mixtral with a sparse MoE
block, ``model/moe.py``, in place of the MLP) over a flat batch of tokens.

Every layer but attention sees a ``[num_tokens, hidden]`` matrix; the model differs between
families only by q/k/v bias (Qwen2) and per-head q/k RMSNorm before rotary (Qwen3).

Under tensor parallelism (``tp``) each rank holds its share of the query heads and KV heads (q/k/v
column-parallel, o_proj row-parallel), of the MLP's intermediate features, and of the vocabulary;
q/k norm weights (per head_dim) and the other norms are whole on every rank. The residual stream is
whole everywhere: the row-parallel products and the embedding are summed across ranks.
"""
from __future__ import annotations

import torch
from torch import nn

from minfer.config import ModelConfig
from minfer.model.attention import Attention
from minfer.distributed import SINGLE, TensorParallel
from minfer.model.layers import FusedLinear, GatedMLP, RMSNorm, RotaryEmbedding, VocabParallelEmbedding
from minfer.model.moe import SparseMoeBlock
from minfer.model.quant import Fp8Format
from minfer.ops import AttentionMetadata, Ops, RopeInputs


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, ops: Ops,
                 tp: TensorParallel = SINGLE, quant: Fp8Format | None = None, prefix: str = "self_attn") -> None:
        super().__init__()
        self.head_dim = d = cfg.head_dim
        q_head, self.num_heads = tp.split(cfg.num_attention_heads)
        kv_head, self.num_kv_heads = tp.kv_heads(cfg.num_key_value_heads)
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        qkv_sizes = [self.q_size, self.kv_size, self.kv_size]
        qkv_quant = quant if quant and quant.quantizes([f"{prefix}.{p}_proj" for p in "qkv"]) else None
        o_quant = quant if quant and quant.quantizes([f"{prefix}.o_proj"]) else None
        self.qkv_proj = FusedLinear(cfg.hidden_size, qkv_sizes, cfg.attention_bias, dtype,
                                    rows_from=[q_head * d, kv_head * d, kv_head * d], quant=qkv_quant, ops=ops)
        self.o_proj = FusedLinear(self.q_size, [cfg.hidden_size], False, dtype, cols_from=q_head * d, tp=tp,
                                  quant=o_quant, ops=ops)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, ops)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.o_proj(self.attention(self.qkv_proj(x), positions, meta))

    def attention(self, qkv: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Everything between the qkv projection and o_proj: q/k norms, rotary, KV store, attention."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # views into the fused qkv output
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        rope = RopeInputs(positions, self.rotary.cos_sin_cache)
        if self.q_norm is not None:
            rope.q_norm_weight, rope.k_norm_weight, rope.eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        return self.attn(q, k, v, rope, meta).reshape(t, self.q_size)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, ops: Ops,
                 tp: TensorParallel = SINGLE, quant: Fp8Format | None = None, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        self.self_attn = LlamaAttention(cfg, rotary, dtype, ops, tp, quant, f"layers.{index}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        if index in cfg.moe_layers:
            self.mlp: nn.Module = SparseMoeBlock(cfg, dtype, ops, tp, quant)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, ops, tp, quant, f"layers.{index}.mlp")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        fp8 = self.self_attn.qkv_proj.fp8_input  # FP8 layers take their input rounded by the norm's kernel
        if residual is None:
            residual, x = x, self.input_layernorm(x, fp8=fp8)
        else:
            x, residual = self.input_layernorm(x, residual, fp8=fp8)
        x = self.self_attn(x, positions, meta)
        mlp_in = self.mlp.gate_up_proj.fp8_input if isinstance(self.mlp, GatedMLP) else None
        x, residual = self.post_attention_layernorm(x, residual, fp8=mlp_in)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. ``forward`` returns final hidden states; ``compute_logits`` only for
    the rows that sample, since the LM head is the largest matmul of a decode step."""

    # checkpoint name fragment -> (fused parameter's module name, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
        "o_proj": ("o_proj", 0), "down_proj": ("down_proj", 0),
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_position: int, ops: Ops,
                 tp: TensorParallel = SINGLE, quant: Fp8Format | None = None) -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.quant = quant  # the linear layers' FP8 format (None: the model dtype); embeddings stay unquantized
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, dtype, ops, tp, quant, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)  # a weight holder

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, meta)
        return x + residual  # the final norm runs in compute_logits, on the sampling rows only

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm + LM head for the selected rows, as float32 logits (or in the model dtype, for a
        consumer that converts as it reads: the cast writes and rereads [rows, vocab] floats).
        ``out`` (model dtype) receives the model-dtype logits: the decode CUDA graphs' static buffer.
        Under tensor parallelism every rank computes its vocabulary share and all of them receive
        the whole rows (only rank 0 samples; the others take part in the gather)."""
        head = self.lm_head
        if head.tp.size == 1:
            logits = torch.mm(self.norm(hidden), head.weight.t(), out=out)
        else:
            logits = head.gather_logits(torch.mm(self.norm(hidden), head.weight.t()))
            if out is not None:
                logits = out.copy_(logits)
        return logits.float() if float32 else logits

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]
