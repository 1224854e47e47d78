"""A small Llama decoder in plain PyTorch, for training.

This is the *training* model: one sequence batch ``[batch, seq]`` at a time, causal attention
through ``F.scaled_dot_product_attention``, no KV cache. The inference engine has its own
model in ``minfer/model``; the two meet only through the HF checkpoint that ``export.py``
writes, so every numerical choice here follows HF ``LlamaForCausalLM`` exactly (RMSNorm in
float32, non-interleaved "rotate_half" rotary, SwiGLU, grouped-query attention) and the
exported weights give HF the same logits.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class ModelConfig:
    """Shape of the decoder; field names follow HF ``LlamaConfig`` where one exists."""

    vocab_size: int
    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 768
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    dropout: float = 0.0
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size", "max_position_embeddings")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim (hidden_size / heads = {self.head_dim}) must be even "
                             "for rotary embeddings")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, as HF does: the order
    matters for bit-level agreement under bf16."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rotary_cos_sin(seq_len: int, head_dim: int, theta: float,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[seq, head_dim]`` in float32, laid out as HF's default rope: the
    frequencies are repeated (``cat(freqs, freqs)``), pairing dimension i with i + head_dim/2."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device,
                                            dtype=torch.int64).float() / head_dim)
    pos = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: ``[batch, heads, seq, head_dim]``; cos/sin: ``[seq, head_dim]``."""
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.n_kv != self.n_heads:
            # Query head h reads KV head h // group, the same grouping as HF's repeat_kv.
            # An explicit repeat keeps every SDPA backend (flash included) available.
            group = self.n_heads // self.n_kv
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        # Residual dropout only: it regularises many-epoch runs on a small corpus and
        # vanishes at export (HF runs the model in eval mode).
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.drop(self.mlp(self.post_attention_layernorm(x)))


class Llama(nn.Module):
    """Decoder-only Llama. ``forward(ids) -> logits`` in float32 for a numerically sane loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._init_weights()

    def _init_weights(self) -> None:
        """N(0, 0.02) everywhere; the two projections that write into the residual stream
        are scaled by 1/sqrt(2 * layers) so its variance does not grow with depth."""
        std = 0.02
        out_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue
            last = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            nn.init.normal_(p, mean=0.0, std=last)

    def num_parameters(self) -> int:
        """Unique parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        cos, sin = rotary_cos_sin(t, self.config.head_dim, self.config.rope_theta,
                                  input_ids.device)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x)).float()
