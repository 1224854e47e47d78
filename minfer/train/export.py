"""Export the training model as an HF Llama checkpoint folder.

The training model already uses HF's module names (``embed_tokens``, ``layers.N.self_attn``,
``mlp.gate_proj``...), so the export is a prefix (``model.``) and a cast. With tied
embeddings there is no ``lm_head.weight`` in the file: HF (and our loader) re-tie it from
``tie_word_embeddings``, which saves vocab x hidden parameters on disk.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from minfer.config import DTYPE_NAMES, torch_dtype
from minfer.train.model import Llama, ModelConfig

HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json")

_DTYPE_NAMES = {torch_dtype(name): name for name in DTYPE_NAMES}


def hf_state_dict(model: Llama, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Tensors under HF ``LlamaForCausalLM`` names, contiguous and in ``dtype``."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            if model.config.tie_word_embeddings:
                continue
            key = name
        else:
            key = "model." + name
        out[key] = tensor.detach().to("cpu", dtype).contiguous().clone()
    return out


def hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """``config.json`` for ``LlamaForCausalLM``. ``rope_theta`` (transformers 4.x) and
    ``rope_parameters`` (5.x) both appear so either major version reads the same rotary."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "torch_dtype": _DTYPE_NAMES[dtype],
        "dtype": _DTYPE_NAMES[dtype],
    }


# Default sampling for a small code model: greedy decoding of an 8M-parameter model loops on the same
# few lines, and these settings (the built-in model's) give varied, readable code.
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.15}


def generation_config(cfg: ModelConfig) -> dict:
    return {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
            "pad_token_id": cfg.pad_token_id, **SAMPLING_DEFAULTS}


def export_hf(model: Llama, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json, generation_config.json and model.safetensors into ``out_dir``.

    The tokenizer files are written by the trainer into the same folder beforehand.
    """
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"export dtype must be one of {list(_DTYPE_NAMES.values())}, got {dtype}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_state_dict(model, dtype), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model.config, dtype), indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(generation_config(model.config), indent=2) + "\n")
    return out


def hf_checkpoint_bytes(out_dir: str | Path) -> int:
    """Size on disk of the HF files of a folder (what shipping the model costs)."""
    out = Path(out_dir)
    return sum((out / f).stat().st_size for f in HF_FILES if (out / f).is_file())
