"""Gemma 4's dense text model (HF ``Gemma4ForCausalLM``, ``model_type: gemma4_text``), HF-exact.

Gemma's layer (embeddings scaled by sqrt(hidden), four norms around attention and the GeGLU MLP, sliding
and global layers by ``layer_types``), with what Gemma 4 adds. The model subclasses ``Gemma3ForCausalLM``
(``models/gemma.py``) for the embedding normalizer, the final norm + LM head and the logits' soft-cap; its
layers are its own, since every part of them differs:

- Norms multiply by ``w`` itself (Gemma 2/3: ``1 + w``), still in float32 (a float32 weight tells the ops
  so). q and k are normed per head, v by a weightless norm, and the scores are not scaled (scale 1).
- Global layers have their own head size and KV heads (``per_layer_config``, or ``global_head_dim`` /
  ``num_global_key_value_heads`` in configs written before it), and with ``attention_k_eq_v`` no v_proj:
  the keys' projection is the values' too (before k's norm and rotary; v takes its own norm).
- Each layer type has its own rotary table. ``proportional`` rotates only the first
  ``partial_rotary_factor * D / 2`` frequency pairs, its frequencies still spaced over the whole head
  (exponent ``2i / D``); HF writes the unrotated pairs as zero frequencies in a full-width table, and
  rotate-half pairs dimension i with i + D/2, so a zero frequency is cos 1, sin 0: the dimension passes
  through unchanged, bit for bit. The full-width table is therefore all the ops need.
- Per-layer input embeddings (PLE): a second embedding, packed ``[vocab, layers * P]``, plus a projection
  of the scaled embeddings, give each layer a P-wide input that gates a residual branch after the MLP.
- Shared KV: the last ``num_kv_shared_layers`` layers compute no K/V; each attends over the cache of the
  last earlier layer of its type (HF's ``kv_sharing_modes``). They own no cache (``attention_layers``
  lists only the owners) and rotate q alone (``Ops.rope_q``); a consumer's MLP is twice as wide with
  ``use_double_wide_mlp``.
- A learned scalar multiplies each layer's output; the logits are soft-capped.

Under tensor parallelism q/k/v, o and the MLP split as Llama's; both embedding tables split by
vocabulary rows; the PLE projections (small: hidden x layers*P, and hidden x P per layer) are replicated.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minfer.config import ModelConfig
from minfer.distributed import SINGLE, TensorParallel
from minfer.model.layers.attention import Attention
from minfer.model.layers.embedding import VocabParallelEmbedding
from minfer.model.layers.linear import FusedLinear
from minfer.model.layers.mlp import GatedMLP
from minfer.model.layers.norm import RMSNorm
from minfer.model.models.gemma import Gemma3ForCausalLM
from minfer.model.quantization.base import UNQUANTIZED, QuantConfig
from minfer.ops import AttentionMetadata, Ops, RopeInputs

LAYER_TYPES = ("sliding_attention", "full_attention")
# HF's defaults (Gemma4TextConfig) for the fields a config.json may leave out
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True, attention_bias=False,
    sliding_window=512, vocab_size_per_layer_input=262_144, hidden_size_per_layer_input=256, num_kv_shared_layers=0,
    attention_k_eq_v=False, use_double_wide_mlp=False, final_logit_softcapping=None,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                     "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1_000_000.0}})
# config fields minfer does not build, with the value that means "off"
_REFUSED = {"enable_moe_block": False, "use_bidirectional_attention": None}


def rope_table(params: dict[str, Any], head_dim: int, max_position: int) -> torch.Tensor:
    """``[max_position, head_dim]`` float32 ``[cos | sin]`` for one layer type, as HF's rotary computes it."""
    kind, theta = params.get("rope_type", "default"), float(params["rope_theta"])
    if kind == "default":
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    elif kind == "proportional":
        angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        rotated = 1.0 / theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / head_dim)
        inv_freq = torch.cat([rotated, torch.zeros(head_dim // 2 - angles)]) / float(params.get("factor", 1.0))
    else:
        raise ValueError(f"Gemma 4: rope_type {kind!r} is not supported (supported: default, proportional)")
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


class RopeTable(nn.Module):
    """One layer type's rotary table, shared by its layers."""

    def __init__(self, params: dict[str, Any], head_dim: int, max_position: int) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", rope_table(params, head_dim, max_position), persistent=False)


def _layer_shapes(hf: dict[str, Any], types: list[str]) -> tuple[list[int], list[int]]:
    """Each layer's (head size, KV heads): HF's ``per_layer_config`` overrides, or, in a config written
    before it, ``global_head_dim`` (and ``num_global_key_value_heads`` when ``attention_k_eq_v``) on the
    global layers, as HF's config derives them."""
    head_dim, kv = int(hf["head_dim"]), int(hf["num_key_value_heads"])
    if "per_layer_config" in hf:
        overrides = {int(i): dict(o) for i, o in (hf["per_layer_config"] or {}).items()}
    else:
        full = {"head_dim": hf.get("global_head_dim", 512)}
        if hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = hf["num_global_key_value_heads"]
        overrides = {i: full for i, t in enumerate(types) if t == "full_attention"}
    for i, o in overrides.items():
        if other := sorted(set(o) - {"head_dim", "num_key_value_heads"}):
            raise ValueError(f"Gemma 4: per_layer_config[{i}] sets {other}, which minfer does not support (only "
                             "head_dim and num_key_value_heads)")
    dims = [int(overrides.get(i, {}).get("head_dim", head_dim)) for i in range(len(types))]
    heads = [int(overrides.get(i, {}).get("num_key_value_heads", kv)) for i in range(len(types))]
    for t in set(types):  # one rotary table per type, as HF requires
        if len({d for d, u in zip(dims, types) if u == t}) > 1:
            raise ValueError(f"Gemma 4: the {t} layers have different head sizes (per_layer_config)")
    return dims, heads


def _kv_sources(types: list[str], shared: int) -> list[int]:
    """Layer i's K/V come from layer ``sources[i]``: itself, or for the last ``shared`` layers the last
    earlier non-shared layer of the same type (HF's ``kv_sharing_modes``)."""
    n = len(types)
    first = n - shared
    if shared and first <= 0:
        raise ValueError(f"Gemma 4: num_kv_shared_layers={shared} of {n} layers leaves none that computes K/V")
    sources = []
    for i, t in enumerate(types):
        owners = [j for j in range(min(i + 1, first)) if types[j] == t]
        if not owners:
            raise ValueError(f"Gemma 4: shared-KV layer {i} ({t}) has no earlier {t} layer to read K/V from")
        sources.append(i if i < first else owners[-1])
    return sources


def read_gemma4_config(hf: dict[str, Any]) -> ModelConfig:
    """The ``ModelConfig`` of a ``gemma4_text`` config (HF's defaults under it); what minfer does not build is
    refused by name."""
    hf = {**HF_DEFAULTS, **hf}
    for name, off in _REFUSED.items():
        if hf.get(name, off) not in (off, False, None):
            raise ValueError(f"Gemma 4: {name}={hf[name]!r} is not supported by minfer (dense, causal text only)")
    if hf["hidden_activation"] != "gelu_pytorch_tanh":
        raise ValueError(f"Gemma 4: hidden_activation={hf['hidden_activation']!r} is not supported "
                         "(only gelu_pytorch_tanh)")
    n = int(hf["num_hidden_layers"])
    types = list(hf.get("layer_types") or ("sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)))
    types[-1] = "full_attention"  # HF forces the last layer global
    if len(types) != n or set(types) - set(LAYER_TYPES):
        raise ValueError(f"Gemma 4: layer_types must list {n} of {LAYER_TYPES}, got {types}")
    rope = hf["rope_parameters"] or HF_DEFAULTS["rope_parameters"]
    if any(t not in rope for t in set(types)):
        raise ValueError(f"Gemma 4: rope_parameters must hold the parameters of each layer type {sorted(set(types))}")
    dims, kv_heads = _layer_shapes(hf, types)
    extra = dict(
        layer_head_dims=tuple(dims), layer_kv_heads=tuple(kv_heads),
        kv_sources=tuple(_kv_sources(types, int(hf["num_kv_shared_layers"] or 0))),
        rope={t: dict(rope[t]) for t in set(types)}, k_eq_v=bool(hf["attention_k_eq_v"]),
        ple_size=int(hf["hidden_size_per_layer_input"] or 0), ple_vocab=int(hf["vocab_size_per_layer_input"]),
        double_wide_mlp=bool(hf["use_double_wide_mlp"]),
        final_logit_softcapping=float(hf["final_logit_softcapping"] or 0.0))
    for t in set(types):
        rope_table(rope[t], dims[types.index(t)], 1)  # an unsupported rope_type fails here, at config read
    return ModelConfig.from_hf(
        hf, sliding_window=int(hf["sliding_window"]), layer_types=tuple(types),
        rope_theta=float(rope[types[0]]["rope_theta"]), rope_scaling=None, qk_norm=True,
        attention_bias=bool(hf["attention_bias"]), extra=extra)


class Gemma4RMSNorm(RMSNorm):
    """Gemma 4's norm: ``x * w`` (not ``1 + w``), the multiply in float32 as HF does; the weight is held in
    float32 (which tells the ops so) but with the model dtype's value, as HF holds it (a float32 checkpoint
    run in bfloat16 rounds w)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, ops: Ops) -> None:
        super().__init__(size, eps, torch.float32, ops)
        self.model_dtype = dtype

    def load_shard(self, name: str, source: Any, shard: Any) -> None:
        super().load_shard(name, source[:].to(self.model_dtype), shard)


def _linear(in_features: int, out: int, dtype: torch.dtype, ops: Ops, quant: QuantConfig | None,
            name: str) -> FusedLinear:
    """A replicated (unsharded) projection: every rank holds all of it and computes it whole."""
    return FusedLinear(in_features, [out], False, dtype, method=quant.linear_method([name]) if quant else UNQUANTIZED,
                       ops=ops)


class Gemma4Attention(nn.Module):
    """q/k/v (or q/k with ``attention_k_eq_v``, or q alone in a shared-KV layer), per-head norms, rotary,
    attention at scale 1, o. A shared-KV layer attends over ``source``, its producer's ``Attention``."""

    def __init__(self, cfg: ModelConfig, index: int, rotary: RopeTable, dtype: torch.dtype, ops: Ops,
                 tp: TensorParallel, quant: QuantConfig | None, source: Attention | None) -> None:
        super().__init__()
        x = cfg.extra
        prefix = f"layers.{index}.self_attn"
        self.head_dim = d = x["layer_head_dims"][index]
        q_head, self.num_heads = tp.split(cfg.num_attention_heads)
        kv_head, self.num_kv_heads = tp.kv_heads(x["layer_kv_heads"][index])
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.k_eq_v = x["k_eq_v"] and cfg.layer_types[index] == "full_attention"
        names = ["q"] if source is not None else ["q", "k"] if self.k_eq_v else ["q", "k", "v"]
        sizes = [self.q_size] + [self.kv_size] * (len(names) - 1)
        rows = [q_head * d] + [kv_head * d] * (len(names) - 1)
        qkv = quant.linear_method([f"{prefix}.{p}_proj" for p in names]) if quant else UNQUANTIZED
        o = quant.linear_method([f"{prefix}.o_proj"]) if quant else UNQUANTIZED
        self.qkv_proj = FusedLinear(cfg.hidden_size, sizes, cfg.attention_bias, dtype, rows_from=rows, method=qkv,
                                    ops=ops)
        self.o_proj = FusedLinear(self.q_size, [cfg.hidden_size], cfg.attention_bias, dtype, cols_from=q_head * d,
                                  tp=tp, method=o, ops=ops)
        self.q_norm = Gemma4RMSNorm(d, cfg.rms_norm_eps, dtype, ops)
        self.k_norm = Gemma4RMSNorm(d, cfg.rms_norm_eps, dtype, ops) if source is None else None
        self.register_buffer("v_norm_weight", torch.ones(d), persistent=False)  # HF's v norm has no weight
        self.rotary, self.ops, self.eps = rotary, ops, cfg.rms_norm_eps
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, ops, scale=1.0,
                              window=cfg.layer_window(index)) if source is None else None
        self.__dict__["source"] = source  # the producer's Attention, not a submodule of this layer

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
        rope = RopeInputs(positions, self.rotary.cos_sin_cache, self.q_norm.weight, eps=self.eps)
        if self.attn is None:  # shared KV: the producer's cache, already written this step
            q = self.ops.rope_q(q, rope)
            out = self.ops.paged_attention(q, self.source, meta, 1.0)
        else:
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
            v = k if self.k_eq_v else qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
            v = self.ops.rms_norm(v, self.v_norm_weight, self.eps)  # from k before its norm and rotary
            rope.k_norm_weight = self.k_norm.weight
            out = self.attn(q, k, v, rope, meta)
        return self.o_proj(out.reshape(t, self.q_size))


class Gemma4DecoderLayer(nn.Module):
    """Norms around attention and the MLP (each branch normed before its residual add), then the PLE
    branch, then the layer's scalar."""

    def __init__(self, cfg: ModelConfig, index: int, rotary: RopeTable, dtype: torch.dtype, ops: Ops, mlp: nn.Module,
                 tp: TensorParallel, quant: QuantConfig | None, source: Attention | None) -> None:
        super().__init__()
        h, ple = cfg.hidden_size, cfg.extra["ple_size"]
        self.input_layernorm = Gemma4RMSNorm(h, cfg.rms_norm_eps, dtype, ops)
        self.self_attn = Gemma4Attention(cfg, index, rotary, dtype, ops, tp, quant, source)
        self.post_attention_layernorm = Gemma4RMSNorm(h, cfg.rms_norm_eps, dtype, ops)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, cfg.rms_norm_eps, dtype, ops)
        self.mlp = mlp
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, cfg.rms_norm_eps, dtype, ops)
        if ple:
            self.per_layer_input_gate = _linear(h, ple, dtype, ops, quant, f"layers.{index}.per_layer_input_gate")
            self.per_layer_projection = _linear(ple, h, dtype, ops, quant, f"layers.{index}.per_layer_projection")
            self.post_per_layer_input_norm = Gemma4RMSNorm(h, cfg.rms_norm_eps, dtype, ops)
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, per_layer_input: torch.Tensor | None, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        attn = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, meta))
        normed, x = self.pre_feedforward_layernorm(attn, x)  # x + attn, and its norm
        x = x + self.post_feedforward_layernorm(self.mlp(normed))
        if per_layer_input is not None:
            # gelu(gate(x)) * the layer's PLE slice: [T, P], too small for a fused op to matter
            gated = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    """Embeddings (and PLE) → layers → final norm, LM head (tied by default) and the logits' soft-cap."""

    packed_modules = {**Gemma3ForCausalLM.packed_modules,
                      **{m: (m, 0) for m in ("per_layer_input_gate", "per_layer_projection",
                                             "per_layer_model_projection")}}
    hf_defaults = HF_DEFAULTS
    fused_one_token = None  # per-layer inputs and shared-KV layers: its own forward at one token too

    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        return read_gemma4_config({**cls.hf_defaults, **hf})

    @classmethod
    def checkpoint_shapes(cls, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        h, v, x = config.hidden_size, config.vocab_size, config.extra
        n, ple = config.num_hidden_layers, x["ple_size"]
        shapes = {"model.embed_tokens.weight": (v, h)}
        if ple:
            shapes |= {"model.embed_tokens_per_layer.weight": (x["ple_vocab"], n * ple),
                       "model.per_layer_model_projection.weight": (n * ple, h),
                       "model.per_layer_projection_norm.weight": (ple,)}
        for i in range(n):
            p, d = f"model.layers.{i}.", x["layer_head_dims"][i]
            q, kv = config.num_attention_heads * d, x["layer_kv_heads"][i] * d
            owner = x["kv_sources"][i] == i
            names = ["q", "k"] + ([] if x["k_eq_v"] and config.layer_types[i] == "full_attention" else ["v"])
            for m in names if owner else ["q"]:
                shapes[p + f"self_attn.{m}_proj.weight"] = (q if m == "q" else kv, h)
                if config.attention_bias:
                    shapes[p + f"self_attn.{m}_proj.bias"] = (q if m == "q" else kv,)
            shapes[p + "self_attn.o_proj.weight"] = (h, q)
            if config.attention_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            shapes |= {p + "self_attn.q_norm.weight": (d,)} | ({p + "self_attn.k_norm.weight": (d,)} if owner else {})
            inter = config.intermediate_size * (2 if x["double_wide_mlp"] and not owner else 1)
            shapes |= {p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter)}
            shapes |= {p + f"{m}.weight": (h,) for m in ("input_layernorm", "post_attention_layernorm",
                                                          "pre_feedforward_layernorm", "post_feedforward_layernorm")}
            if ple:
                shapes |= {p + "per_layer_input_gate.weight": (ple, h), p + "per_layer_projection.weight": (h, ple),
                           p + "post_per_layer_input_norm.weight": (h,)}
            shapes[p + "layer_scalar"] = (1,)
        shapes["model.norm.weight"] = (h,)
        if not config.tie_word_embeddings:
            shapes["lm_head.weight"] = (v, h)
        return shapes

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, max_position: int, ops: Ops,
                 tp: TensorParallel = SINGLE, quant: QuantConfig | None = None) -> None:
        nn.Module.__init__(self)  # Gemma 3's layers are not built: Gemma 4's are below
        self.config, self.quant, x = cfg, quant, cfg.extra
        h, n, self.ple_size = cfg.hidden_size, cfg.num_hidden_layers, x["ple_size"]
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, dtype, tp)
        # Gemma's normalizer (``embed``): sqrt(h) rounded to the model dtype (bfloat16: 55.5 for sqrt(3072) = 55.43)
        self.register_buffer("embed_scale", torch.tensor(h ** 0.5, dtype=torch.float32).to(dtype), persistent=False)
        if self.ple_size:
            self.embed_tokens_per_layer = VocabParallelEmbedding(x["ple_vocab"], n * self.ple_size, dtype, tp)
            self.register_buffer("ple_embed_scale", torch.tensor(self.ple_size ** 0.5).to(dtype), persistent=False)
            self.per_layer_model_projection = _linear(h, n * self.ple_size, dtype, ops, quant,
                                                      "per_layer_model_projection")
            self.per_layer_projection_norm = Gemma4RMSNorm(self.ple_size, cfg.rms_norm_eps, dtype, ops)
        types = cfg.layer_types
        self.rotary = nn.ModuleDict({t: RopeTable(x["rope"][t], x["layer_head_dims"][types.index(t)], max_position)
                                     for t in dict.fromkeys(types)})
        self.layers = nn.ModuleList()
        for i in range(n):
            src = x["kv_sources"][i]
            source = None if src == i else self.layers[src].self_attn.attn
            self.layers.append(Gemma4DecoderLayer(cfg, i, self.rotary[types[i]], dtype, ops,
                                                  self.make_mlp(cfg, i, dtype, ops, tp, quant), tp, quant, source))
        self.norm = Gemma4RMSNorm(h, cfg.rms_norm_eps, dtype, ops)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = VocabParallelEmbedding(cfg.vocab_size, h, dtype, tp)  # a weight holder

    def make_mlp(self, cfg: ModelConfig, index: int, dtype: torch.dtype, ops: Ops, tp: TensorParallel,
                 quant: QuantConfig | None) -> nn.Module:
        """GeGLU, twice as wide in a shared-KV layer with ``use_double_wide_mlp``."""
        wide = 2 if cfg.extra["double_wide_mlp"] and cfg.extra["kv_sources"][index] != index else 1
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size * wide, dtype, ops, tp, quant, f"layers.{index}.mlp",
                        activation="gelu_tanh")

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """``[T, layers, P]``: the projection of the scaled embeddings (scaled by 1/sqrt(hidden), normed per
        layer) plus the PLE table's rows (scaled by sqrt(P)), the sum scaled by 1/sqrt(2), in HF's order."""
        t, n, p = input_ids.shape[0], self.config.num_hidden_layers, self.ple_size
        proj = self.per_layer_model_projection(embeds) * self.config.hidden_size ** -0.5
        proj = self.per_layer_projection_norm(proj.view(t, n, p))
        table = (self.embed_tokens_per_layer(input_ids) * self.ple_embed_scale).view(t, n, p)
        return (proj + table) * 2.0 ** -0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        ple = self.per_layer_inputs(input_ids, x) if self.ple_size else None
        for i, layer in enumerate(self.layers):
            x = layer(x, None if ple is None else ple[:, i], positions, meta)
        return x  # the final norm runs in compute_logits, on the sampling rows only

    def attention_layers(self) -> list[Attention]:
        """The layers that own a cache (a shared-KV layer reads its producer's)."""
        return [layer.self_attn.attn for layer in self.layers if layer.self_attn.attn is not None]
