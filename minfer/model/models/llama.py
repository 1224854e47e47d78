"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat batch of tokens, and the decoder the
other families extend.

Every layer but attention sees a ``[num_tokens, hidden]`` matrix; the members differ only by q/k/v bias
(Qwen2) and per-head q/k RMSNorm before rotary (Qwen3), read from the config by each class.

Under tensor parallelism (``tp``) each rank holds its share of the query heads and KV heads (q/k/v
column-parallel, o_proj row-parallel), of the MLP's intermediate features, and of the vocabulary;
q/k norm weights (per head_dim) and the other norms are whole on every rank. The residual stream is
whole everywhere: the row-parallel products and the embedding are summed across ranks.
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
from minfer.model.quantization.base import UNQUANTIZED, QuantConfig
from minfer.ops import AttentionMetadata, Ops, RopeInputs


class LlamaAttention(nn.Module):
    o_bias = False  # o_proj has a bias (gpt-oss)
    sinks = False  # a learned sink logit per head (gpt-oss)

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, ops: Ops,
                 tp: TensorParallel = SINGLE, quant: QuantConfig | None = None, prefix: str = "self_attn",
                 window: int = 0) -> None:
        super().__init__()
        self.head_dim = d = cfg.head_dim
        q_head, self.num_heads = tp.split(cfg.num_attention_heads)
        kv_head, self.num_kv_heads = tp.kv_heads(cfg.num_key_value_heads)
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        qkv_sizes = [self.q_size, self.kv_size, self.kv_size]
        qkv = quant.linear_method([f"{prefix}.{p}_proj" for p in "qkv"]) if quant else UNQUANTIZED
        o = quant.linear_method([f"{prefix}.o_proj"]) if quant else UNQUANTIZED
        self.qkv_proj = FusedLinear(cfg.hidden_size, qkv_sizes, cfg.attention_bias, dtype,
                                    rows_from=[q_head * d, kv_head * d, kv_head * d], method=qkv, ops=ops)
        self.o_proj = FusedLinear(self.q_size, [cfg.hidden_size], self.o_bias, dtype, cols_from=q_head * d, tp=tp,
                                  method=o, ops=ops)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, ops) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, ops, window=window,
                              sinks=self.sinks, dtype=dtype, tp=tp)

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
    """Pre-norm attention and MLP with the residual stream carried beside them (the norms add it)."""

    attention: type[LlamaAttention] = LlamaAttention  # a family's attention module (gpt-oss: biases, sinks)
    float32_norms = False  # norm weights kept in float32, the product rounded once (gpt-oss, as HF keeps them)
    # [tokens, hidden] rows that receive the residual stream entering this layer (an EAGLE-3 head reads it)
    capture: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, dtype: torch.dtype, ops: Ops, mlp: nn.Module,
                 tp: TensorParallel = SINGLE, quant: QuantConfig | None = None, index: int = 0) -> None:
        super().__init__()
        norm_dtype = torch.float32 if self.float32_norms else dtype
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops, weight_dtype=norm_dtype)
        self.self_attn = self.attention(cfg, rotary, dtype, ops, tp, quant, f"layers.{index}.self_attn",
                                        cfg.layer_window(index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops, weight_dtype=norm_dtype)
        self.mlp = mlp
        # the formats the projections want their inputs in, emitted by the norms before them
        self.attn_in = self.self_attn.qkv_proj.input_quant
        self.mlp_in = mlp.gate_up_proj.input_quant if isinstance(mlp, GatedMLP) else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x, out=self.attn_in)
        else:
            x, residual = self.input_layernorm(x, residual, out=self.attn_in)
        if self.capture is not None:
            self.capture[:residual.shape[0]].copy_(residual)
        x = self.self_attn(x, positions, meta)
        x, residual = self.post_attention_layernorm(x, residual, out=self.mlp_in)
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
    moe_block = "mlp"  # the checkpoint's name of a layer's MoE block (MoE families)
    decoder_layer: type[DecoderLayer] = DecoderLayer
    # the layer layout the Triton ops' fused one-token forward (ops/one_token.py) reads: 'llama', 'gemma' or None
    fused_one_token: str | None = "llama"
    expert_matrices: dict[str, str] = {}  # an expert's checkpoint matrix names -> 'gate' / 'up' / 'down'
    # a tensor stacking every expert's matrices (``<block>.experts.<name>``) -> the matrices it holds, in row order
    stacked_experts: dict[str, tuple[str, ...]] = {}

    @classmethod
    def stacked_modules(cls, config: ModelConfig) -> dict[str, tuple[str, list[int]]]:
        """Checkpoint module name -> (the fused module it fills, every shard's whole row count in the order the
        checkpoint stacks them), for checkpoints that store a fused matrix as one tensor (Phi-3's ``qkv_proj``);
        each shard of the fused layer reads its rows from it (``FusedLinear.stack_checkpoint_rows``)."""
        return {}

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """A checkpoint tensor's name as this family's text layout names it (None: a tensor the model does not
        have, skipped unread; multimodal checkpoints map their prefixed names, models/multimodal.py)."""
        return name

    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """The model's config from its HF ``config.json`` (``ModelConfig.from_hf`` reads what every family
        shares; a family passes what is its own)."""
        return ModelConfig.from_hf(hf, attention_bias=bool(hf.get("attention_bias", False)))

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor an HF checkpoint of ``config`` holds, name -> shape, in a fixed order (what
        ``random_weights`` draws for benchmark checkpoints and dummy loads)."""
        h, v, d = config.hidden_size, config.vocab_size, config.head_dim
        q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
        shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (v, h)
        for n in range(config.num_hidden_layers):
            p = f"model.layers.{n}."
            shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
            if config.attention_bias:
                shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)}
            shapes |= cls._mlp_shapes(config, n, p)
            if config.qk_norm:
                shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        return shapes

    @classmethod
    def _mlp_shapes(cls, config: ModelConfig, layer: int, prefix: str) -> dict[str, tuple[int, ...]]:
        """A layer's MLP tensors: dense, or a MoE block's router and experts under the family's names."""
        h = config.hidden_size
        if layer not in config.moe_layers:
            i = config.intermediate_size
            return {prefix + "mlp.gate_proj.weight": (i, h), prefix + "mlp.up_proj.weight": (i, h),
                    prefix + "mlp.down_proj.weight": (h, i)}
        block = prefix + cls.moe_block
        names = [next(n for n, ours in cls.expert_matrices.items() if ours == m) for m in ("gate", "up", "down")]
        e, i = config.num_experts, config.moe_intermediate_size
        shapes = {f"{block}.gate.weight": (e, h)}
        for x in range(e):
            gate, up, down = (f"{block}.experts.{x}.{n}.weight" for n in names)
            shapes |= {gate: (i, h), up: (i, h), down: (h, i)}
        return shapes

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_position: int, ops: Ops,
                 tp: TensorParallel = SINGLE, quant: QuantConfig | None = None) -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.quant = quant  # the linear layers' weight format (None: the model dtype); embeddings stay float
        self.layers = nn.ModuleList(self.decoder_layer(cfg, rotary, dtype, ops,
                                                       self.make_mlp(cfg, i, dtype, ops, tp, quant), tp, quant, i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, ops,
                            weight_dtype=torch.float32 if self.decoder_layer.float32_norms else dtype)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)  # a weight holder
        self.stack_checkpoint_rows()

    def stack_checkpoint_rows(self) -> None:
        """Point each fused layer that the checkpoint stores as one tensor (``stacked_modules``) at its rows."""
        for fused, sizes in self.stacked_modules(self.config).values():
            for name, module in self.named_modules():
                if name.rsplit(".", 1)[-1] == fused:
                    module.stack_checkpoint_rows(sizes)

    def make_mlp(self, cfg: ModelConfig, index: int, dtype: torch.dtype, ops: Ops, tp: TensorParallel,
                 quant: QuantConfig | None) -> nn.Module:
        """Layer ``index``'s MLP: SwiGLU here; the MoE families put their sparse block where the config says."""
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, dtype, ops, tp, quant, f"layers.{index}.mlp")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings the first layer takes (a family may scale them)."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
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
        """The layers that own KV cache tensors, in order (the engine sizes and allocates the cache by them)."""
        return [layer.self_attn.attn for layer in self.layers]


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v bias; its sliding window applies only with ``use_sliding_window``, and then (as HF
    writes ``layer_types``) to the layers from ``max_window_layers`` on."""

    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
        n = int(hf["num_hidden_layers"])
        first = int(hf.get("max_window_layers", n))
        types = tuple(hf.get("layer_types") or ("sliding_attention" if window and i >= first else "full_attention"
                                               for i in range(n)))
        return ModelConfig.from_hf(hf, attention_bias=True, sliding_window=int(window) if window else None,
                                   layer_types=types)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with per-head RMSNorm on q and k before rotary."""

    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        return ModelConfig.from_hf(hf, attention_bias=bool(hf.get("attention_bias", False)), qk_norm=True)
