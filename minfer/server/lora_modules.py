"""``--lora-modules`` values and the runtime-updating gate, apart from the server's routes: ``minfer serve`` parses
its flags with them before anything heavy imports (FastAPI, the engine), so a bad value fails at once.

vLLM's two spellings of a module: ``name=path``, or a JSON object ``{"name": ..., "path": ...,
"base_model_name": ...}`` (the served model name an adapter lists as its ``parent`` on /v1/models). Loading and
unloading adapters while the server runs is vLLM's opt-in, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: any client with
the API key could then make the server read a folder of its disk, so it stays off unless the variable (or ours,
``MINFER_ALLOW_RUNTIME_LORA_UPDATING``) says true.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

RUNTIME_UPDATING_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "MINFER_ALLOW_RUNTIME_LORA_UPDATING")
_TRUE = ("1", "true")  # vLLM's reading of the variable (case-insensitive, spaces stripped)
_JSON_KEYS = ("name", "path", "base_model_name")


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """An adapter served from start-up (vLLM's class): ``name`` is what requests pass as ``model``."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """One ``--lora-modules`` value (argparse's ``type``): ``name=path`` or vLLM's JSON object; a ValueError
    names the value and the expected forms."""
    text = text.strip()
    if text.startswith("{"):
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{text!r} is not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{text!r}: expected a JSON object")
        unknown = sorted(set(raw) - set(_JSON_KEYS))
        if unknown:
            raise ValueError(f"{text!r}: unknown keys {unknown} (allowed: {list(_JSON_KEYS)})")
        name, path, base = raw.get("name"), raw.get("path"), raw.get("base_model_name")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"{text!r}: 'name' and 'path' must be non-empty strings")
        if base is not None and (not isinstance(base, str) or not base):
            raise ValueError(f"{text!r}: 'base_model_name' must be a non-empty string")
        return LoRAModulePath(name, path, base)
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"{text!r}: expected name=path or a JSON object "
                         f"'{{\"name\": ..., \"path\": ..., \"base_model_name\": ...}}'")
    return LoRAModulePath(name.strip(), path.strip())


def check_lora_modules(modules: Sequence[LoRAModulePath], served_model_names: Sequence[str],
                       enable_lora: bool) -> None:
    """What can be checked before the model loads: LoRA is on, names are unique and none is a served model's
    name (``model`` would mean both), and each ``base_model_name`` is a served name."""
    if modules and not enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    seen: set[str] = set()
    for module in modules:
        if module.name in served_model_names:
            raise ValueError(f"--lora-modules {module.name}: the name is the served model's (--served-model-name); "
                             f"give the adapter its own")
        if module.name in seen:
            raise ValueError(f"--lora-modules {module.name}: the name is given twice")
        seen.add(module.name)
        if module.base_model_name is not None and module.base_model_name not in served_model_names:
            raise ValueError(f"--lora-modules {module.name}: base_model_name {module.base_model_name!r} is not a "
                             f"served model name ({list(served_model_names)})")


def runtime_updating_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether /v1/load_lora_adapter and /v1/unload_lora_adapter may run (with ``--enable-lora``)."""
    return any(environ.get(name, "").strip().lower() in _TRUE for name in RUNTIME_UPDATING_ENV)
