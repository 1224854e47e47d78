"""Random weights for a model config, named as a checkpoint names them: N(0, 0.02), norm weights 1.

The same code serves two users. ``minfer.benchmark.shapes`` writes these weights to safetensors as a
real HF folder. ``load_format="dummy"`` draws them on the target device while the model loads, for
shapes whose checkpoint does not fit on the disk (qwen3-30b-a3b: 61 GB, mixtral-8x7b: 93 GB). Both
draw in the same order from a generator with the same seed. So a dummy load equals loading the
checkpoint written with the same seed on the same kind of device (a CUDA generator's numbers are not
the CPU's). Throughput does not depend on the values, only on the shapes. The values are kept small
so that activations stay finite through every layer.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from minfer.config import ModelConfig
from minfer.model.registry import model_class

STD = 0.02  # the weights' standard deviation (HF's initializer_range)
SEED = 0  # the dummy load's seed; write_random_checkpoint's default


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of ``config`` holds, name -> shape, in drawing order."""
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
        shapes |= _mlp_shapes(config, n, p)
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return shapes


def _mlp_shapes(config: ModelConfig, layer: int, prefix: str) -> dict[str, tuple[int, ...]]:
    """A layer's MLP tensors: dense, or a MoE block's router and experts under the checkpoint's names."""
    h = config.hidden_size
    if layer not in config.moe_layers:
        i = config.intermediate_size
        return {prefix + "mlp.gate_proj.weight": (i, h), prefix + "mlp.up_proj.weight": (i, h),
                prefix + "mlp.down_proj.weight": (h, i)}
    family = model_class(config.architecture)  # its checkpoint names of the block and of the expert matrices
    block = family.moe_block
    names = tuple(next(n for n, ours in family.expert_matrices.items() if ours == m) for m in ("gate", "up", "down"))
    e, i = config.num_experts, config.moe_intermediate_size
    shapes = {f"{prefix}{block}.gate.weight": (e, h)}
    for x in range(e):
        gate, up, down = (f"{prefix}{block}.experts.{x}.{n}.weight" for n in names)
        shapes |= {gate: (i, h), up: (i, h), down: (h, i)}
    return shapes


def draw(name: str, shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype,
         device: torch.device | str) -> torch.Tensor:
    """One tensor on ``device``. A norm weight is 1 and uses no numbers from ``gen``: a random norm
    would only rescale its layer. Any other tensor is drawn in float32 from ``gen``, times STD, then
    rounded to ``dtype``, as a checkpoint stores it."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    return (torch.randn(shape, generator=gen, device=device) * STD).to(dtype)


def random_tensors(config: ModelConfig, device: torch.device | str,
                   seed: int = SEED) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor of ``config``. Each is drawn on ``device`` in the
    checkpoint's dtype (``config.torch_dtype``) only when the loop reaches it, so only one tensor
    exists at a time beside the model."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shape in tensor_shapes(config).items():
        yield name, draw(name, shape, gen, config.torch_dtype, device)
