"""How a pooling engine turns a prompt's hidden states into one vector: read once from the checkpoint.

A sentence-transformers checkpoint says it in ``modules.json``: a ``Transformer`` module (the model), a ``Pooling``
module whose ``config.json`` names the mode (``pooling_mode_lasttoken``, ``pooling_mode_mean_tokens`` or
``pooling_mode_cls_token``), and a ``Normalize`` module when the vector is L2-normalised. Anything else there (a
``Dense`` projection, max or weighted-mean pooling, ``include_prompt: false``) would make our vector differ from
the model's, so it is refused naming it. Without ``modules.json``: last-token pooling, normalised (vLLM's default
for a decoder used as an embedding model). ``config.json``'s ``is_matryoshka`` / ``matryoshka_dimensions`` (vLLM's
keys) say whether a request may cut the vector to fewer ``dimensions``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minfer.pooling_params import PoolingParams

POOLING_TYPES = ("LAST", "MEAN", "CLS")
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_MODE_NAMES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_ST_PREFIX = "sentence_transformers.models."


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """``pooling_type``: LAST (the prompt's last token), MEAN (every prompt token, averaged) or CLS (the first
    token); ``normalize``: the default of a request that does not say; ``matryoshka_dimensions``: the sizes a
    request may ask for (None: any up to ``hidden_size``, when ``matryoshka``); ``source``: where it was read."""

    hidden_size: int
    pooling_type: str = "LAST"
    normalize: bool = True
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    source: str = "default (no sentence-transformers modules.json)"

    @property
    def prefix_caching(self) -> bool:
        """A prefix-cache hit skips computing the prompt's first tokens: only last-token pooling, which reads the
        last one (always computed), may take it; mean and CLS need the skipped tokens' hidden states."""
        return self.pooling_type == "LAST"

    def check(self, params: PoolingParams) -> None:
        """What a request may ask of this model (a ValueError naming the field)."""
        d = params.dimensions
        if d is None:
            return
        if not self.matryoshka:
            raise ValueError(f"dimensions: this model does not support Matryoshka embeddings (its config.json sets "
                             f"neither is_matryoshka nor matryoshka_dimensions), so cutting its {self.hidden_size} "
                             f"dimensions to {d} would give poor embeddings")
        if self.matryoshka_dimensions is not None and d not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions must be one of the model's matryoshka_dimensions "
                             f"{list(self.matryoshka_dimensions)}, got {d}")
        if d > self.hidden_size:
            raise ValueError(f"dimensions must be at most the model's {self.hidden_size}, got {d}")


def read_pooler_config(model_dir: Path, hidden_size: int) -> PoolerConfig:
    """The checkpoint's pooling (see the module docstring); a setting minfer cannot follow is a ValueError."""
    hf = _json(model_dir / "config.json") if (model_dir / "config.json").is_file() else {}
    dims = hf.get("matryoshka_dimensions")
    matryoshka = bool(dims) or bool(hf.get("is_matryoshka", False))
    shared = dict(hidden_size=hidden_size, matryoshka=matryoshka,
                  matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None)
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return PoolerConfig(**shared)
    pooling_type, normalize = None, False
    for module in _json(modules_file):
        kind, path = str(module.get("type", "")), str(module.get("path", ""))
        if kind == _ST_PREFIX + "Transformer":
            continue
        if kind == _ST_PREFIX + "Normalize":
            normalize = True
        elif kind == _ST_PREFIX + "Pooling":
            pooling_type = _pooling_mode(_json(model_dir / path / "config.json"), hidden_size, path)
        else:
            raise ValueError(f"{modules_file}: the module {kind or module!r} is not supported (minfer applies "
                             f"Transformer, Pooling and Normalize only): its embeddings would differ from the model's")
    if pooling_type is None:
        raise ValueError(f"{modules_file} lists no sentence_transformers.models.Pooling module")
    return PoolerConfig(**shared, pooling_type=pooling_type, normalize=normalize,
                        source=f"sentence-transformers ({modules_file.name})")


def _pooling_mode(cfg: dict[str, Any], hidden_size: int, path: str) -> str:
    """The one pooling mode a Pooling module's config.json turns on."""
    where = f"{path}/config.json"
    if "pooling_mode" in cfg:  # the constructor's string form, where a config holds it
        mode = _ST_MODE_NAMES.get(str(cfg["pooling_mode"]))
        if mode is None:
            raise ValueError(f"{where}: pooling_mode {cfg['pooling_mode']!r} is not supported "
                             f"(supported: {sorted(_ST_MODE_NAMES)})")
        modes = [mode]
    else:
        on = [key for key, value in cfg.items() if key.startswith("pooling_mode_") and value]
        unsupported = [key for key in on if key not in _ST_MODES]
        if unsupported:
            raise ValueError(f"{where}: {unsupported} are not supported (supported: {sorted(_ST_MODES)})")
        modes = [_ST_MODES[key] for key in on]
    if len(modes) != 1:
        raise ValueError(f"{where} must turn on exactly one pooling mode, got {modes or 'none'}")
    if cfg.get("include_prompt", True) is False:
        raise ValueError(f"{where}: include_prompt false (an instruction prefix left out of the pooling) "
                         f"is not supported")
    width = cfg.get("word_embedding_dimension")
    if width is not None and int(width) != hidden_size:
        raise ValueError(f"{where}: word_embedding_dimension {width} is not the model's hidden size {hidden_size}")
    return modes[0]


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read the pooling configuration {path}: {exc}") from exc
