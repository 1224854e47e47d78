"""Random-weight checkpoints of the model shapes in BENCHMARKS.md, written as real HF folders.

Benchmarks load them through the normal loader, so they measure exactly what a user's
checkpoint would run. The weights are random (no weights can be downloaded here): throughput
does not depend on their values, only on shapes and sequence lengths.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

SHAPES: dict[str, dict] = {
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       bos_token_id=151643, eos_token_id=151645),
    "llama-3.2-1b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling={**_LLAMA3_ROPE, "factor": 32.0}, bos_token_id=128000, eos_token_id=128001),
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}, bos_token_id=128000, eos_token_id=128001),
}


def _tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, v, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
        if cfg["model_type"] == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return shapes


def write_random_checkpoint(shape: str, out: Path, dtype: torch.dtype = torch.bfloat16,
                            shard_bytes: int = 2 << 30, seed: int = 0, device: str = "cpu") -> Path:
    """Write ``shape`` with N(0, 0.02) weights (norm weights 1) as sharded safetensors + index.
    ``device="cuda"`` draws them on the GPU (8B weights: seconds instead of a CPU minute; other values)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from {sorted(SHAPES)}")
    cfg = dict(SHAPES[shape], torch_dtype=str(dtype).removeprefix("torch."))
    out.mkdir(parents=True, exist_ok=True)
    if (out / "config.json").is_file() and json.loads((out / "config.json").read_text()) == cfg:
        return out  # already written
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, shp in _tensor_shapes(cfg).items():
        t = torch.ones(shp) if name.endswith("norm.weight") else torch.randn(shp, generator=gen, device=device) * 0.02
        t = t.to(dtype).cpu()
        if size and size + t.numel() * t.element_size() > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.numel() * t.element_size()
    weight_map = {}
    for k, tensors in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map |= {name: fname for name in tensors}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
