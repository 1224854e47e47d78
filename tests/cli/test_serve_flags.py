"""``minfer serve`` as vLLM users type it: a positional MODEL, --api-key / $MINFER_API_KEY, --chat-template,
the warning for a public host without a key, and one line (exit 2) when the server extra is missing."""
from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import minfer.cli.serve as server_cli
from minfer.cli import main
from minfer.server.chat_template import load_chat_template

TEMPLATE = "{% for m in messages %}<<{{ m['role'] }}: {{ m['content'] }}>>{% endfor %}" \
           "{% if add_generation_prompt %}<<assistant:{% endif %}"


@pytest.fixture()
def seen(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What ``cmd_serve`` hands to ``run_server`` (nothing is loaded or served)."""
    got: dict[str, Any] = {}
    monkeypatch.setattr(server_cli, "run_server", lambda model, engine_kwargs, **kw: got.update(model=model, **kw))
    monkeypatch.delenv("MINFER_API_KEY", raising=False)
    return got


def test_positional_model(seen: dict[str, Any]) -> None:
    assert main(["serve", "org/model", "--port", "9000"]) == 0
    assert seen["model"] == "org/model" and seen["port"] == 9000
    assert main(["serve", "--port", "9000", "org/other"]) == 0 and seen["model"] == "org/other"
    assert main(["serve", "--model", "org/model"]) == 0 and seen["model"] == "org/model"
    assert main(["serve", "org/model", "--model", "org/model"]) == 0 and seen["model"] == "org/model"
    assert main(["serve"]) == 0 and seen["model"] is None  # the built-in model


def test_two_different_models_is_an_error(seen: dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "a", "--model", "b"]) == 2
    assert "the model is given twice" in capsys.readouterr().err and not seen


def test_api_key_flag_and_environment(seen: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "m"]) == 0 and seen["api_key"] is None
    monkeypatch.setenv("MINFER_API_KEY", "from-env")
    assert main(["serve", "m"]) == 0 and seen["api_key"] == "from-env"
    assert main(["serve", "m", "--api-key", "from-flag"]) == 0 and seen["api_key"] == "from-flag"
    seen.clear()
    assert main(["serve", "m", "--api-key", " "]) == 2
    assert "API key is empty" in capsys.readouterr().err and not seen


def test_chat_template_file_or_inline(seen: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert main(["serve", "m", "--chat-template", str(path)]) == 0 and seen["chat_template"] == TEMPLATE
    assert main(["serve", "m", "--chat-template", TEMPLATE]) == 0 and seen["chat_template"] == TEMPLATE
    assert main(["serve", "m"]) == 0 and seen["chat_template"] is None
    seen.clear()
    for bad, message in ((str(tmp_path / "missing.jinja"), "neither a file nor a Jinja template"),
                         ("{% for m in messages %}", "not a valid Jinja template")):
        assert main(["serve", "m", "--chat-template", bad]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and not seen


def test_a_public_host_without_a_key_warns(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                            tmp_path: Path) -> None:
    import minfer.server.run as server_run

    monkeypatch.setattr("minfer.llm.builtin_model_path", lambda: tmp_path)  # stops before a model loads
    for host, key, hosts, warns in (("0.0.0.0", None, None, True), ("::", None, None, True),
                                    ("192.168.1.7", None, None, True), ("0.0.0.0", "k", None, False),
                                    ("127.0.0.1", None, None, False), ("localhost", None, None, False),
                                    ("::1", None, None, False), ("127.0.0.1", None, ["*"], True),  # rebinding open
                                    ("127.0.0.1", "k", ["*"], False), ("0.0.0.0", None, ["m.lan"], True)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="minfer"), pytest.raises(ValueError, match="built-in"):
            server_run.run_server(None, {}, host=host, api_key=key, allowed_hosts=hosts)
        warned = [r.getMessage() for r in caplog.records if "without an API key" in r.getMessage()]
        assert bool(warned) is warns, (host, key, warned)
        # any Host accepted without a key: the warning names DNS rebinding and the flag that narrows it
        assert any("DNS rebinding" in w and "--allowed-hosts" in w for w in warned) is (warns and hosts != ["m.lan"])


def test_allowed_hosts_and_origins_flags(seen: dict[str, Any], capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "m"]) == 0 and seen["allowed_hosts"] is None and seen["allowed_origins"] is None
    assert main(["serve", "m", "--allowed-hosts", "a.lan,.example.com", "--allowed-hosts", "[::2]",
                 "--allowed-origins", '["http://ui.lan:3000"]']) == 0
    assert seen["allowed_hosts"] == ["a.lan", ".example.com", "[::2]"]
    assert seen["allowed_origins"] == ["http://ui.lan:3000"]


def test_bad_host_patterns_fail_before_the_model_loads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import minfer.server.run as server_run

    monkeypatch.setattr("minfer.llm.builtin_model_path", lambda: tmp_path / "missing")  # would fail later
    with pytest.raises(ValueError, match="--allowed-hosts: 'localhost:8000' .* any port is allowed"):
        server_run.run_server(None, {}, allowed_hosts=["localhost:8000"])
    with pytest.raises(ValueError, match="--allowed-origins: 'ui.lan' is not an origin"):
        server_run.run_server(None, {}, allowed_origins=["ui.lan"])


@pytest.mark.parametrize("module", ["uvicorn", "fastapi", "fastapi_offline", "prometheus_client"])
def test_missing_server_extra_is_one_line(seen: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture, module: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # what an uninstalled package looks like to find_spec
    assert main(["serve", "m"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and module in err and 'pip install -e ".[server]"' in err
    assert "Traceback" not in err and not seen


def test_load_chat_template_keeps_the_text() -> None:
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template("{{ messages[0]['content'] }}\n") == "{{ messages[0]['content'] }}\n"


def test_without_the_extra_the_command_prints_one_line(tmp_path: Path) -> None:
    """In a fresh interpreter where neither FastAPI nor uvicorn imports: no traceback, exit 2."""
    code = ("import sys; sys.modules['fastapi'] = sys.modules['uvicorn'] = None; "
            "from minfer.cli import main; sys.exit(main(['serve', 'm']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "fastapi, uvicorn not installed" in proc.stderr, proc.stderr


def test_serve_command_end_to_end(checkpoints: dict[str, Path], tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """`minfer serve MODEL --chat-template FILE --api-key K --allowed-hosts testserver`: the app uvicorn would
    run renders chats with the file's template, on /v1/chat/completions and /tokenize alike, wants the key, and
    answers the test client's Host but not another."""
    import uvicorn
    from fastapi.testclient import TestClient

    model = str(checkpoints["llama3"])
    served: list[Any] = []

    class Server:
        """uvicorn.Server without a socket: ``run`` drives the app through a test client while the engine
        lives (``run_server`` shuts it down once ``run`` returns)."""

        def __init__(self, config: Any) -> None:
            self.config, self.started, self.should_exit = config, False, False

        def run(self) -> None:
            app, self.started = self.config.app, True
            served.append((self.config.host, self.config.port))
            assert self.config.http.__name__.startswith("OpenAIError")  # unparsable requests: the error shape
            messages = [{"role": "user", "content": "def f("}]
            with TestClient(app, headers={"Authorization": "Bearer k"}) as c:  # Host: testserver
                tok = app.state.ctx.tokenizer
                expected = tok.encode("<<user: def f(>><<assistant:", add_special_tokens=False)
                assert c.post("/tokenize", json={"messages": messages}).json()["tokens"] == expected
                chat = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3})
                assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(expected)
                assert chat.json()["model"] == model
                assert c.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
                refused = c.get("/v1/models", headers={"Host": "attacker.example"})  # not in --allowed-hosts
                assert refused.status_code == 400 and refused.json()["error"]["code"] == "host_not_allowed"
                stats = c.get("/stats").json()
                assert stats["kv_blocks_used"] == 0 and stats["healthy"]

    monkeypatch.setattr(uvicorn, "Server", Server)
    monkeypatch.delenv("MINFER_API_KEY", raising=False)
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    assert main(["serve", model, "--chat-template", str(path), "--api-key", "k", "--port", "8123",
                 "--num-kv-blocks", "64", "--max-num-seqs", "4", "--allowed-hosts", "testserver"]) == 0
    assert served == [("127.0.0.1", 8123)]


def test_engine_process_flag_defaults_by_device(seen: dict[str, Any]) -> None:
    """``--engine-process`` / ``--no-engine-process`` are passed on; with neither, ``run_server`` decides by the
    engine's device: its own process on one GPU, a thread on the CPU or under tensor parallelism."""
    import torch

    from minfer.config import EngineConfig
    from minfer.server.run import default_engine_process

    assert main(["serve"]) == 0 and seen["engine_process"] is None
    assert main(["serve", "--engine-process"]) == 0 and seen["engine_process"] is True
    assert main(["serve", "--no-engine-process"]) == 0 and seen["engine_process"] is False
    assert default_engine_process(EngineConfig.from_kwargs(model="m", device="cpu")) is False

    class OnGpus:
        def __init__(self, tensor_parallel_size: int) -> None:
            self.tensor_parallel_size = tensor_parallel_size

        def resolved_device(self) -> torch.device:
            return torch.device("cuda")

    assert default_engine_process(OnGpus(1)) is True and default_engine_process(OnGpus(2)) is False
