"""Engine flags generated from EngineConfig: every field on every engine command, the dataclass's defaults,
the old spellings, validation by EngineConfig, and a ``minfer --help`` that does not import torch."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing

import pytest

from minfer.cli import build_parser, main
from minfer.config import EngineConfig
from minfer.engine_args import engine_kwargs, flag_name
from minfer.kv_events_config import KVEventsConfig
from minfer.spec_config import SpeculativeConfig

# Each engine command with the positional arguments it needs to parse.
COMMANDS = {"generate": ["hello"], "bench": [], "serve": [], "bench-serve": [], "eval-ppl": ["a.txt"]}
FIELDS = dataclasses.fields(EngineConfig)
HINTS = typing.get_type_hints(EngineConfig)


def _parse(command: str, *flags: str):
    return build_parser().parse_args([command, *flags, *COMMANDS[command]])


def _sample(f: dataclasses.Field) -> tuple[str, object]:
    """A non-default command-line value of the field, and what it parses to."""
    if f.metadata.get("choices"):
        value = next(c for c in f.metadata["choices"] if c != f.default)
        return value, value
    kind = next((a for a in typing.get_args(HINTS[f.name]) if a is not type(None)), HINTS[f.name])
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'  # JSON: EngineConfig parses it
    events = '{"enable_kv_cache_events": true, "publisher": "null"}'
    return {int: ("3", 3), float: ("0.5", 0.5), str: ("x", "x"), SpeculativeConfig: (spec, spec),
            KVEventsConfig: (events, events)}[kind]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_field_has_a_flag_with_the_dataclass_default(command: str) -> None:
    args = _parse(command)
    for f in FIELDS:
        assert getattr(args, f.name) == f.default, f.name
    assert EngineConfig(model=args.model, **engine_kwargs(args)) == EngineConfig()


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_reaches_its_field(command: str) -> None:
    for f in FIELDS:
        if HINTS[f.name] is bool:
            name = flag_name(f.name)
            assert getattr(_parse(command, name), f.name) is True, name
            assert getattr(_parse(command, "--no-" + name[2:]), f.name) is False, name
        else:
            text, value = _sample(f)
            assert getattr(_parse(command, flag_name(f.name), text), f.name) == value, f.name


def test_speculative_config_flag_is_parsed_json() -> None:
    args = _parse("generate", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    spec = EngineConfig(**engine_kwargs(args)).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 5)


def test_old_spellings_still_work() -> None:
    args = _parse("serve", "--no-prefix-caching", "--no-async-scheduling", "--enforce-eager", "--skip-tokenizer-init")
    kwargs = engine_kwargs(args)
    assert kwargs["enable_prefix_caching"] is False and kwargs["async_scheduling"] is False
    assert kwargs["enforce_eager"] is True and kwargs["skip_tokenizer_init"] is True
    assert "model" not in kwargs


def test_help_lists_the_allowed_values(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--help"])
    text = capsys.readouterr().out
    assert "{auto,float32,bfloat16,float16}" in text and "{auto,int8,fp8_e4m3,fp8_e5m2}" in text
    assert "{auto,torch,triton}" in text and "--no-prefix-caching" in text


@pytest.mark.parametrize("flags,field", [
    (["--dtype", "int3"], "dtype"), (["--kv-cache-dtype", "fp4"], "kv_cache_dtype"),
    (["--attention-backend", "flash"], "attention_backend"), (["--block-size", "7"], "block_size"),
])
def test_a_bad_value_fails_naming_the_field(flags: list[str], field: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", *flags, "x"]) == 2
    assert f"{field} must be" in capsys.readouterr().err


def test_aliases_are_left_to_engine_config() -> None:
    args = _parse("generate", "--dtype", "bf16", "--kv-cache-dtype", "fp8")
    config = EngineConfig(**engine_kwargs(args))
    assert config.dtype == "bfloat16" and config.kv_cache_dtype == "fp8_e4m3"


def test_building_the_parser_does_not_import_torch() -> None:
    code = "import sys; from minfer.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
