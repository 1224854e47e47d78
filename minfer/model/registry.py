"""The supported architectures: HF ``config.json`` ``architectures`` names -> model classes.

The one place in ``minfer/`` that spells those names. A class reads its own config (``read_config``),
maps its checkpoint's names (``packed_modules``, ``moe_block``, ``expert_matrices``) and wires its layers;
adding an architecture is its class (in a family's file under ``models/``) and a line here.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from minfer.config import ModelConfig
from minfer.model.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from minfer.model.models.eagle3 import Eagle3Head
from minfer.model.models.gemma4 import Gemma4ForCausalLM
from minfer.model.models.gpt_oss import GptOssForCausalLM
from minfer.model.models.llama import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from minfer.model.models.mixtral import MixtralForCausalLM
from minfer.model.models.multimodal import (Gemma3ForConditionalGeneration, Gemma4ForConditionalGeneration,
                                            Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration)
from minfer.model.models.phi3 import Phi3ForCausalLM
from minfer.model.models.qwen3_5 import Qwen3_5ForCausalLM
from minfer.model.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from minfer.model.models.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
    # EAGLE-3 draft heads: they draft for a target (speculative_config method 'eagle3'), never serve alone
    "LlamaForCausalLMEagle3": Eagle3Head,
    "Eagle3LlamaForCausalLM": Eagle3Head,
    # multimodal checkpoints: their language model (models/multimodal.py)
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
}


def model_class(architecture: str | None, listed: list[str] | None = None) -> type[nn.Module]:
    """The class of an HF architecture name; an unknown one is an error naming the supported list
    (``listed``: the config's whole ``architectures`` entry, for the message)."""
    cls = ARCHITECTURES.get(architecture or "")
    if cls is None:
        raise ValueError(f"unsupported architecture {architecture!r} (config.json 'architectures'="
                         f"{listed if listed is not None else [architecture]}); minfer supports: "
                         f"{', '.join(ARCHITECTURES)}")
    return cls


def model_config(hf: dict[str, Any]) -> ModelConfig:
    """A checkpoint's ``ModelConfig`` from its ``config.json`` contents, read by its family."""
    archs = hf.get("architectures") or []
    return model_class(archs[0] if archs else None, archs).read_config(hf)


def load_model_config(model_dir: Path | str, draft_head: bool = False) -> ModelConfig:
    """The ``ModelConfig`` of a checkpoint folder: ``config.json``, then ``generation_config.json``'s
    end-of-sequence ids and sampling defaults. A draft head (EAGLE-3) loads only as one (``draft_head``)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}: not a Hugging Face model folder")
    config = model_config(json.loads(path.read_text()))
    if getattr(model_class(config.architecture), "is_draft_head", False) != draft_head:
        raise ValueError(f"{model_dir} holds a {config.architecture}: " + (
            "a draft head, not a model: serve its target with speculative_config={'method': 'eagle3', "
            f"'model': '{model_dir}', ...}}" if not draft_head else "not an EAGLE-3 draft head"))
    return config.add_generation_config(Path(model_dir))
