"""``EngineArgs``, vLLM's engine arguments, and the command-line flags generated from them.

``EngineArgs`` is ``EngineConfig`` under vLLM's name and API: it inherits the config's fields (so the field
list is written once, in ``config.py``), is checked at construction as the config is (a bad value fails
naming the field), and adds vLLM's ``add_cli_args`` / ``from_cli_args`` / ``create_engine_config``.
Every field becomes ``--kebab-case`` with the dataclass's default, type, help text and allowed values, so a
new knob needs no CLI edit and no default is written twice. Booleans take both spellings
(``--enforce-eager`` / ``--no-enforce-eager``). Allowed values are shown, not enforced by argparse:
``EngineConfig`` checks them (aliases such as ``bf16`` included) and its message names the field, as it
does for ``LLM(...)`` keywords.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from importlib import resources
from typing import Any

from minfer.config import EngineConfig

# Older spellings kept working: BooleanOptionalAction derives ``--no-prefix-caching`` from this one.
FLAG_ALIASES: dict[str, tuple[str, ...]] = {"enable_prefix_caching": ("--prefix-caching",)}


def flag_name(field_name: str) -> str:
    """``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + field_name.replace("_", "-")


def _value_type(annotation: Any) -> type:
    """The flag's type from the field's annotation: ``int | None`` -> int."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


class EngineArgs(EngineConfig):
    """vLLM's ``EngineArgs``: ``EngineArgs(model=..., max_model_len=...)``, or ``from_cli_args`` of a parser that
    ``add_cli_args`` filled; ``create_engine_config()`` is what ``LLMEngine.from_engine_args`` builds on. Its
    fields are ``EngineConfig``'s (inherited, not listed again), ``model`` None meaning the built-in model."""

    __slots__ = ()

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One flag per field, in an "engine" group of ``parser``'s help; returns ``parser`` (as vLLM's)."""
        add_engine_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The arguments a parser filled by ``add_cli_args`` parsed, checked."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def create_engine_config(self) -> EngineConfig:
        """The config an engine is built from: these arguments with the model resolved (None: the built-in one)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)}
        return EngineConfig(**{**values, "model": self.model or builtin_model()})


class AsyncEngineArgs(EngineArgs):
    """vLLM's ``AsyncEngineArgs``, for ``AsyncLLMEngine.from_engine_args``: the same fields (vLLM's adds request
    logging switches, which minfer does not have)."""

    __slots__ = ()


def builtin_model() -> str:
    """The built-in model's folder (``minfer.llm.builtin_model_path``: that module sits beside this one, not below)."""
    return str(resources.files("minfer") / "assets" / "builtin-model")


def add_engine_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add one flag per ``EngineArgs`` field, in an "engine" group of ``parser``'s help."""
    group = parser.add_argument_group("engine", "how the engine runs the model (EngineArgs)")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        kind = _value_type(hints[f.name])
        flags = (flag_name(f.name), *FLAG_ALIASES.get(f.name, ()))
        help_text = f.metadata.get("help", "").replace("%", "%%")
        if kind is bool:
            action = group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction,
                                        default=f.default, help=help_text)
            if "%(default)" not in action.help:  # some Python versions append it themselves
                action.help += f" (default: {'on' if f.default else 'off'})"
            continue
        if kind not in (int, float, str):
            kind = str  # a structured value (speculative_config) arrives as JSON; EngineConfig parses it
        choices = f.metadata.get("choices")
        metavar = "{" + ",".join(choices) + "}" if choices else kind.__name__.upper()
        default = "" if f.default is None else f" (default: {f.default})"
        group.add_argument(*flags, dest=f.name, type=kind, default=f.default, metavar=metavar,
                           help=help_text + default)
    return group


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The parsed engine flags as ``EngineConfig`` keywords, all but ``model``: each command resolves
    the model itself (the built-in model, a random-weight ``--shape``) and passes it on its own."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs) if f.name != "model"}

