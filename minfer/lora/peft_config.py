"""A PEFT ``adapter_config.json`` read for serving: rank, alpha, rsLoRA, targets and the per-module patterns,
and a refusal, naming the field, of everything that would make ``y += scale * B (A x)`` on the seven
projections the wrong answer (DoRA, biases, trained embeddings or heads, variants, base-changing inits).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from minfer.lora.layout import PROJECTIONS


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: a missing file, an unsupported feature, a shape that does not fit
    the base model or the engine's limits. The message names the adapter and what is wrong."""


# config fields that must be off (falsy): each changes the adapter's product or what it applies to
_MUST_BE_OFF = {
    "use_dora": "DoRA (use_dora=true): a magnitude vector rescales the adapted weight",
    "lora_bias": "LoRA biases (lora_bias=true)",
    "modules_to_save": "modules_to_save: whole trained copies of base modules",
    "trainable_token_indices": "trainable_token_indices: trained embedding rows",
    "fan_in_fan_out": "fan_in_fan_out=true (Conv1D-layout base weights)",
    "use_qalora": "QALoRA (use_qalora=true)",
    "use_bdlora": "BD-LoRA (use_bdlora): block-diagonal factors",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens): applied from an invocation on",
    "layer_replication": "layer_replication: the adapter's model repeats base layers",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config): a diagonal between A and B and a truncated base weight",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "target_parameters": "target_parameters: LoRA on raw parameters (MoE experts)",
}
# init_lora_weights values whose adapters are relative to a base the method changed (unless converted on save)
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")
_EMBEDDING_TARGETS = ("embed_tokens", "lm_head", "embed", "wte", "word_embeddings")


def _is_off(value: Any) -> bool:
    return value is None or value is False or value == "none" or (hasattr(value, "__len__") and len(value) == 0)


def pattern_matches(pattern: str, module_key: str) -> bool:
    """PEFT's rank_pattern / alpha_pattern rule: the pattern (a regex) matches the module's full name or a
    dotted suffix of it."""
    return re.fullmatch(rf"(?:.*\.)?(?:{pattern})", module_key) is not None


@dataclass(frozen=True, slots=True)
class PeftLoRAConfig:
    """The parts of a LoRA adapter's config that serving reads. Module keys are PEFT's names relative to
    the causal LM (``model.layers.3.self_attn.q_proj``), which its patterns are written against."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = ()
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    def rank_of(self, module_key: str) -> int:
        """The module's rank: the first rank_pattern entry that matches it, else ``r``."""
        return next((int(v) for k, v in self.rank_pattern.items() if pattern_matches(k, module_key)), self.r)

    def alpha_of(self, module_key: str) -> float:
        return next((float(v) for k, v in self.alpha_pattern.items() if pattern_matches(k, module_key)),
                    self.lora_alpha)

    def scaling_of(self, module_key: str) -> float:
        """alpha / r, or rsLoRA's alpha / sqrt(r) (which keeps the update's size steady as the rank grows),
        with the module's own rank and alpha."""
        r, alpha = self.rank_of(module_key), self.alpha_of(module_key)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def parse_peft_config(raw: Any, where: str) -> PeftLoRAConfig:
    """``raw`` (the parsed JSON of ``where``) checked and read; every refusal names its field."""
    if not isinstance(raw, dict):
        raise LoRAAdapterError(f"{where}: adapter_config.json must hold a JSON object, got {type(raw).__name__}")
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise LoRAAdapterError(f"{where}: peft_type {peft_type!r} is not supported (only LORA)")
    for name, what in _MUST_BE_OFF.items():
        if not _is_off(raw.get(name)):
            raise LoRAAdapterError(f"{where}: unsupported {what}; got {name}={raw[name]!r}")
    if raw.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{where}: unsupported bias={raw['bias']!r}: trained base biases (only 'none')")
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise LoRAAdapterError(f"{where}: unsupported init_lora_weights={init!r}: the adapter is relative to base "
                               f"weights that method changed (save it converted to plain LoRA)")
    r = _positive_int(raw.get("r", 8), "r", where)
    alpha = _number(raw.get("lora_alpha", 8), "lora_alpha", where)
    ranks = _pattern(raw.get("rank_pattern"), "rank_pattern", where, integer=True)
    alphas = _pattern(raw.get("alpha_pattern"), "alpha_pattern", where, integer=False)
    targets = _targets(raw.get("target_modules"), where)
    return PeftLoRAConfig(r, alpha, bool(raw.get("use_rslora", False)), targets, ranks, alphas)


def _targets(value: Any, where: str) -> tuple[str, ...] | str:
    """``target_modules`` as a tuple of names or one regex. A name or regex that reaches an embedding or the
    LM head is refused here; what else a regex reaches is decided by the tensors the adapter holds."""
    if value is None:
        return ()
    if isinstance(value, str):
        if value == "all-linear":
            return (value,)
        try:
            hits = [t for t in ("model.embed_tokens", "lm_head") if re.fullmatch(value, t)]
        except re.error as e:
            raise LoRAAdapterError(f"{where}: target_modules {value!r} is not a valid regex ({e})") from None
        if hits:
            raise LoRAAdapterError(f"{where}: unsupported target_modules {value!r}: it targets {hits} "
                                   f"(embedding and lm_head LoRA are not supported)")
        return value
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
        raise LoRAAdapterError(f"{where}: target_modules must be a list of names or a regex, got {value!r}")
    for target in value:
        if target == "all-linear":
            continue
        leaf = target.rsplit(".", 1)[-1]
        if leaf in _EMBEDDING_TARGETS:
            raise LoRAAdapterError(f"{where}: unsupported target_modules entry {target!r}: embedding and lm_head "
                                   f"LoRA are not supported")
        if leaf not in PROJECTIONS:
            raise LoRAAdapterError(f"{where}: unsupported target_modules entry {target!r}; LoRA is served on "
                                   f"{list(PROJECTIONS)}")
    return tuple(value)


def _positive_int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LoRAAdapterError(f"{where}: {name} must be an int >= 1, got {value!r}")
    return value


def _number(value: Any, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise LoRAAdapterError(f"{where}: {name} must be a finite number, got {value!r}")
    return float(value)


def _pattern(value: Any, name: str, where: str, integer: bool) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise LoRAAdapterError(f"{where}: {name} must be an object of pattern -> value, got {value!r}")
    for key, v in value.items():
        try:
            re.compile(key)
        except re.error as e:
            raise LoRAAdapterError(f"{where}: {name} key {key!r} is not a valid regex ({e})") from None
        if integer:
            _positive_int(v, f"{name}[{key!r}]", where)
        else:
            _number(v, f"{name}[{key!r}]", where)
    return dict(value)
