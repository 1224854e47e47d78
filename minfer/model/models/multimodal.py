"""The language model of a multimodal checkpoint (Gemma 3 4B and up, Gemma 4, Qwen3.5): text only, as vLLM serves
such a checkpoint with images disabled.

Those checkpoints name ``*ForConditionalGeneration`` in config.json, nest the language model's settings under
``text_config`` and store its weights under a prefix, beside a vision (or audio) tower and its projector:
``language_model.model.*`` (the released files, and what transformers still writes) or ``model.language_model.*``
(transformers 5's module names). ``TextOfMultimodal`` reads the text config (with the top-level fields the text
model needs) and maps the prefixed names to the text model's; a tower's or projector's tensor maps to None,
which the loader skips without reading it (a safetensors slice reads nothing until it is indexed), and so does
a multi-token-prediction head (Qwen3.5's ``mtp.*``).
"""
from __future__ import annotations

from typing import Any

from minfer.config import ModelConfig
from minfer.model.models.gemma import Gemma3ForCausalLM
from minfer.model.models.gemma4 import Gemma4ForCausalLM
from minfer.model.models.qwen3_5 import Qwen3_5ForCausalLM
from minfer.model.models.qwen3_5_moe import Qwen3_5MoeForCausalLM

# top-level config.json fields the language model takes when its text_config lacks them
CARRIED = ("architectures", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype",
           "dtype", "quantization_config")
# what the language model is stored under -> the text checkpoint's names
TEXT_PREFIXES = {"language_model.model.": "model.", "language_model.lm_head.": "lm_head.",
                 "model.language_model.": "model."}
# the other parts of a multimodal checkpoint, at the top or under "model." (and a multi-token-prediction head)
OTHER_PARTS = ("vision_tower.", "multi_modal_projector.", "audio_tower.", "embed_vision.", "embed_audio.",
               "vision_model.", "visual.", "mtp.")


class TextOfMultimodal:
    """Mixed in before a text family: its ``read_config`` reads ``text_config``, its ``checkpoint_name`` maps the
    prefixed tensor names."""

    @classmethod
    def read_config(cls, hf: dict[str, Any]) -> ModelConfig:
        text = dict(hf.get("text_config") or {})
        if not text:
            raise ValueError(f"{(hf.get('architectures') or [cls.__name__])[0]}: config.json has no text_config")
        for key in CARRIED:
            if key in hf and (key not in text or key in ("architectures", "tie_word_embeddings")):
                text[key] = hf[key]
        return super().read_config(text)  # type: ignore[misc]

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """The text checkpoint's name of a tensor, or None for a part the text model does not have."""
        for prefix, ours in TEXT_PREFIXES.items():
            if name.startswith(prefix):
                return ours + name[len(prefix):]
        rest = name[len("model."):] if name.startswith("model.") else name
        return None if rest.startswith(OTHER_PARTS) else name


class Gemma3ForConditionalGeneration(TextOfMultimodal, Gemma3ForCausalLM):
    """Gemma 3's released checkpoints (4B and up): the text model, the SigLIP tower and projector skipped."""


class Gemma4ForConditionalGeneration(TextOfMultimodal, Gemma4ForCausalLM):
    """Gemma 4's released checkpoints: the text model, the vision and audio towers skipped."""


class Qwen3_5ForConditionalGeneration(TextOfMultimodal, Qwen3_5ForCausalLM):
    """Qwen3.5's released checkpoints: the text model under ``model.language_model.``, the vision tower
    (``model.visual.``) and the multi-token-prediction head (``mtp.``) skipped."""


class Qwen3_5MoeForConditionalGeneration(TextOfMultimodal, Qwen3_5MoeForCausalLM):
    """Qwen3.5-MoE's released checkpoints, laid out as the dense ones."""
