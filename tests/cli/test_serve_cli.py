"""``minfer serve`` argument handling (the server itself is exercised by the other tests)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

import minfer.cli.serve as server_cli
import minfer.server.run as server_run


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    server_cli.add_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_serve_flags_reach_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(server_cli, "run_server", lambda model, engine_kwargs, **kw: seen.update(
        model=model, engine=engine_kwargs, **kw))
    args = _parse(["--model", "m", "--port", "9001", "--host", "0.0.0.0", "--served-model-name", "a",
                   "--served-model-name", "b", "--max-waiting-requests", "7", "--num-kv-blocks", "64",
                   "--no-prefix-caching", "--skip-tokenizer-init", "--max-request-bytes", "4096"])
    assert args.func(args) == 0
    assert seen["model"] == "m" and seen["port"] == 9001 and seen["host"] == "0.0.0.0"
    assert seen["served_model_names"] == ["a", "b"] and seen["max_waiting_requests"] == 7
    assert seen["engine"]["skip_tokenizer_init"] is True and seen["max_request_bytes"] == 4096
    assert seen["engine"]["num_kv_blocks"] == 64 and seen["engine"]["enable_prefix_caching"] is False


def test_serve_defaults_to_the_builtin_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr("minfer.llm.builtin_model_path", lambda: tmp_path / "missing")
    with pytest.raises(ValueError, match="built-in model is not installed"):
        server_run.run_server(None, {})
    args = _parse([])
    assert args.model is None and args.port == 8000 and args.host == "127.0.0.1"


@pytest.mark.parametrize("port", ["65536", "-1", "http"])
def test_a_bad_port_fails_while_parsing(port: str, capsys: pytest.CaptureFixture) -> None:
    """Before the model loads (an out-of-range port used to surface as an OverflowError from bind)."""
    with pytest.raises(SystemExit):
        _parse(["--port", port])
    assert "--port: must be an integer in [0, 65535]" in capsys.readouterr().err
