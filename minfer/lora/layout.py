"""The base model's linear layers as LoRA sees them: each projection's features, how tensor parallelism
splits it, and which fused layer (and shard of it) holds it.

An adapter is checked against this description, not against a loaded model, so it can be validated (and
kept in the CPU cache) before any slot is touched, and the description is the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

from minfer.config import ModelConfig
from minfer.distributed import TensorParallel

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS

# fused layer -> its shards in the order the fused layer stacks their outputs (the model's packed_modules)
FUSED_LAYERS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "gate_up": ("gate_proj", "up_proj"),
    "o": ("o_proj",),
    "down": ("down_proj",),
}
# projection -> (fused layer, shard index)
SHARD_OF: dict[str, tuple[str, int]] = {m: (f, i) for f, shards in FUSED_LAYERS.items() for i, m in enumerate(shards)}
# row-parallel projections: their input is split across ranks (LoRA's A by columns), the output summed
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


def module_group(module: str) -> str:
    """The submodule of a decoder layer that holds ``module`` in HF's names ('self_attn' or 'mlp')."""
    return "self_attn" if module in ATTENTION_PROJECTIONS else "mlp"


@dataclass(frozen=True, slots=True)
class BaseLinears:
    """The seven projections of each decoder layer of a dense Llama-shaped model.

    ``moe_layers`` have no dense MLP (their experts are not LoRA targets), so their gate/up/down do not
    exist here and an adapter that targets them is refused."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe_layers: tuple[int, ...] = ()

    @classmethod
    def from_model_config(cls, cfg: ModelConfig) -> "BaseLinears":
        """The description of a minfer ``ModelConfig``. Layers that are not plain attention (linear attention)
        or whose head sizes differ per layer are refused: their projections are not the shapes given here."""
        odd = sorted({t for t in cfg.layer_types if t not in ("full_attention", "sliding_attention")})
        if odd:
            raise ValueError(f"LoRA supports decoder layers of full or sliding attention; {cfg.architecture} "
                             f"has layer_types {odd}")
        if cfg.extra.get("layer_head_dims"):
            raise ValueError(f"LoRA needs one head_dim for every layer; {cfg.architecture} has several "
                             f"({sorted(set(cfg.extra['layer_head_dims']))})")
        return cls(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                   cfg.num_key_value_heads, cfg.head_dim, tuple(cfg.moe_layers))

    def features(self, layer: int, module: str) -> tuple[int, int] | None:
        """(in_features, out_features) of ``module`` in ``layer`` (whole, before any tensor-parallel split);
        None where the layer has no such projection."""
        if not 0 <= layer < self.num_layers or module not in PROJECTIONS:
            return None
        if module in MLP_PROJECTIONS and layer in self.moe_layers:
            return None
        return self._whole(module)

    def _whole(self, module: str) -> tuple[int, int]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        h, i = self.hidden_size, self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[module]

    def shapes(self) -> dict[tuple[int, str], tuple[int, int]]:
        """Every projection: (layer, module) -> (in_features, out_features)."""
        return {(n, m): f for n in range(self.num_layers) for m in PROJECTIONS
                if (f := self.features(n, m)) is not None}

    def tp_range(self, module: str, tp: TensorParallel) -> tuple[int, int]:
        """(start, length) of this rank's part of the split dimension of ``module``: the output rows of a
        column-parallel projection, the input columns of a row-parallel one. The same split as the base
        layer's: query heads, KV heads (replicated when fewer than the ranks), intermediate features."""
        d = self.head_dim
        if module in ("q_proj", "o_proj"):
            first, count = tp.split(self.num_heads)
        elif module in ("k_proj", "v_proj"):
            first, count = tp.kv_heads(self.num_kv_heads)
        else:
            return tp.split(self.intermediate_size)
        return first * d, count * d

    def local_features(self, module: str, tp: TensorParallel) -> tuple[int, int]:
        """(in_features, out_features) of ``module`` on this rank (of a layer that has it)."""
        whole_in, whole_out = self._whole(module)
        _, length = self.tp_range(module, tp)
        return (length, whole_out) if module in ROW_PARALLEL else (whole_in, length)

    def fused_layers(self) -> list[tuple[int, str]]:
        """Every (layer, fused layer) that exists: a MoE layer has 'qkv' and 'o' only."""
        return [(n, f) for n in range(self.num_layers) for f, shards in FUSED_LAYERS.items()
                if self.features(n, shards[0]) is not None]
