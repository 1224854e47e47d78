"""Multi-LoRA serving over HTTP (vLLM's interface): a request's ``model`` names an adapter, ``--lora-modules`` at
start-up, /v1/models' ``parent`` and ``root``, loading and unloading at run time (bad adapters refused with nothing
left loaded, an unload waiting for the requests in flight), and the ``vllm:lora_requests_info`` gauge. Adapters are
written by the peft library itself on the tiny test checkpoint, with non-zero B so that they change the output."""
from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import httpx  # noqa: E402
import torch  # noqa: E402

from minfer import LLM, SamplingParams  # noqa: E402
from minfer.cli import main  # noqa: E402
from minfer.config import EngineConfig  # noqa: E402
from minfer.engine.async_engine import EngineDeadError  # noqa: E402
from minfer.engine.llm_engine import LLMEngine  # noqa: E402
from minfer.lora import LoRARequest  # noqa: E402
from minfer.outputs import RequestOutputKind  # noqa: E402
from minfer.server.app import build_app  # noqa: E402
from minfer.server.lora_modules import (LoRAModulePath, check_lora_modules, parse_lora_module,  # noqa: E402
                                        runtime_updating_allowed)
from .conftest import ENGINE_ARGS, MODEL_NAME, LiveServer  # noqa: E402

LORA_ARGS: dict[str, Any] = dict(ENGINE_ARGS, enable_lora=True, max_loras=2, max_lora_rank=8)
KEY = "lora-test-key"
PROMPT = [5, 9, 17, 33, 2, 41, 8]
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)


def _write_adapter(base: Path, folder: Path, seed: int, rank: int, modules: list[str]) -> Path:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules, init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-adapters")
    return {"sql": _write_adapter(tiny_model, root / "sql", 1, 4, ["q_proj", "v_proj", "down_proj"]),
            "chat": _write_adapter(tiny_model, root / "chat", 2, 8, ["q_proj", "k_proj", "o_proj", "up_proj"]),
            "wide": _write_adapter(tiny_model, root / "wide", 3, 16, ["q_proj"])}  # rank past max_lora_rank


class LoRAServer(LiveServer):
    """The shared live server's set-up with LoRA's engine and app arguments."""

    def __init__(self, model_dir: Path, lora_modules: list[LoRAModulePath], runtime: bool, **app_args: Any) -> None:
        super().__init__(model_dir, app_args=dict(lora_modules=lora_modules, allow_runtime_lora_updating=runtime),
                         **app_args, **{k: v for k, v in LORA_ARGS.items() if k not in ENGINE_ARGS})

    def engine_loras(self) -> dict[int, str]:
        """The engine's adapters (id: name), read on the engine thread (``AsyncLLMEngine.list_loras``)."""
        engine = self.app.state.ctx.engine
        loras = asyncio.run_coroutine_threadsafe(engine.list_loras(), engine._loop).result(10)
        return {i: r.lora_name for i, r in loras.items()}


@pytest.fixture(scope="module")
def live(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[LoRAServer]:
    server = LoRAServer(tiny_model, [LoRAModulePath("sql", str(adapters["sql"]))], runtime=True, api_key=KEY)
    yield server
    server.stop()


@pytest.fixture()
def client(live: LoRAServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.base_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_model: Path) -> Iterator[LLM]:
    llm = LLM(model=str(tiny_model), **LORA_ARGS)
    yield llm
    llm.shutdown()


def _complete(client: httpx.Client, model: str, **extra: Any) -> dict[str, Any]:
    resp = client.post("/v1/completions", json={"model": model, "prompt": PROMPT, **GREEDY, **extra})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _offline_text(llm: LLM, lora: LoRARequest | None) -> str:
    out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(**GREEDY), use_tqdm=False, lora_request=lora)
    return out[0].outputs[0].text


# --- routing by model ------------------------------------------------------------------------------------------

def test_model_names_the_adapter(client: httpx.Client, offline: LLM, adapters: dict[str, Path]) -> None:
    base = _complete(client, MODEL_NAME)
    sql = _complete(client, "sql")
    assert sql["model"] == "sql" and base["model"] == MODEL_NAME
    assert sql["choices"][0]["text"] != base["choices"][0]["text"]
    assert base["choices"][0]["text"] == _offline_text(offline, None)
    assert sql["choices"][0]["text"] == _offline_text(offline, LoRARequest("sql", 1, str(adapters["sql"])))
    chat = {"messages": [{"role": "user", "content": "hi"}], **GREEDY}
    chat_base = client.post("/v1/chat/completions", json={"model": MODEL_NAME, **chat}).json()
    chat_sql = client.post("/v1/chat/completions", json={"model": "sql", **chat}).json()
    assert chat_sql["model"] == "sql"
    assert chat_sql["choices"][0]["message"]["content"] != chat_base["choices"][0]["message"]["content"]
    streamed = client.post("/v1/completions", json={"model": "sql", "prompt": PROMPT, "stream": True, **GREEDY})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == sql["choices"][0]["text"]
    assert {c["model"] for c in chunks} == {"sql"}


def test_unknown_model_is_a_404_naming_what_is_served(client: httpx.Client) -> None:
    err = _error(client.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "nope" in err["message"] and "sql" in err["message"] and MODEL_NAME in err["message"]
    _error(client.get("/v1/models/nope"), 404)
    assert client.post("/tokenize", json={"model": "sql", "prompt": "ab"}).status_code == 200


def test_models_list_adapters_with_parent_and_root(client: httpx.Client, live: LoRAServer,
                                                   adapters: dict[str, Path]) -> None:
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert cards[MODEL_NAME]["parent"] is None and cards[MODEL_NAME]["root"] == str(live.engine.config.model)
    assert cards["sql"]["parent"] == MODEL_NAME and cards["sql"]["root"] == str(adapters["sql"])
    assert client.get("/v1/models/sql").json()["root"] == str(adapters["sql"])


# --- loading and unloading at run time ------------------------------------------------------------------------

def test_load_use_and_unload(client: httpx.Client, live: LoRAServer, adapters: dict[str, Path]) -> None:
    resp = client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(adapters["chat"])})
    assert resp.status_code == 200 and "chat" in resp.text
    ids = {name: i for i, name in live.engine_loras().items()}
    assert ids["chat"] > ids["sql"] == 1
    text = _complete(client, "chat")["choices"][0]["text"]
    assert text != _complete(client, MODEL_NAME)["choices"][0]["text"]
    err = _error(client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(adapters["sql"])}),
                 400)
    assert "already been loaded" in err["message"]
    _error(client.post("/v1/load_lora_adapter", json={"lora_name": MODEL_NAME, "lora_path": str(adapters["sql"])}),
           400)
    resp = client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
    assert resp.status_code == 200 and "chat" in resp.text
    assert _error(client.post("/v1/completions", json={"model": "chat", "prompt": "x"}), 404)["code"] == \
        "model_not_found"
    assert "chat" not in live.engine_loras().values()
    assert _error(client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}), 404)["param"] == "lora_name"
    _error(client.post("/v1/unload_lora_adapter", json={"lora_int_id": 999}), 404)
    _error(client.post("/v1/unload_lora_adapter", json={}), 400)
    # loaded again: a new id, the same output
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(adapters["chat"])}) \
        .status_code == 200
    assert _complete(client, "chat")["choices"][0]["text"] == text
    new_id = next(i for i, name in live.engine_loras().items() if name == "chat")
    assert new_id > ids["chat"]
    _error(client.post("/v1/unload_lora_adapter", json={"lora_name": "chat", "lora_int_id": ids["chat"]}), 404)
    # in place: the name runs through the new folder, the old id is forgotten
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(adapters["sql"]),
                                                      "load_inplace": True}).status_code == 200
    assert _complete(client, "chat")["choices"][0]["text"] == _complete(client, "sql")["choices"][0]["text"]
    assert new_id not in live.engine_loras()
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"}).status_code == 200
    assert set(live.engine_loras().values()) == {"sql"}


def test_adapter_routes_need_the_api_key(live: LoRAServer, adapters: dict[str, Path]) -> None:
    body = {"lora_name": "nokey", "lora_path": str(adapters["chat"])}
    assert httpx.post(live.base_url + "/v1/load_lora_adapter", json=body).status_code == 401
    assert httpx.post(live.base_url + "/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 401
    assert set(live.engine_loras().values()) == {"sql"}


def test_an_engine_call_that_raises_leaves_the_engine_serving(client: httpx.Client, live: LoRAServer) -> None:
    engine = live.app.state.ctx.engine
    with pytest.raises(ZeroDivisionError):
        asyncio.run_coroutine_threadsafe(engine.call(lambda _: 1 / 0), engine._loop).result(10)
    assert engine.healthy and _complete(client, "sql")["choices"][0]["text"]


@pytest.mark.parametrize("which, message", [("missing", "no such folder"), ("wide", "rank")])
def test_a_bad_adapter_is_a_400_and_leaves_nothing(client: httpx.Client, live: LoRAServer,
                                                    adapters: dict[str, Path], tmp_path: Path, which: str,
                                                    message: str) -> None:
    before = live.engine_loras()
    path = str(tmp_path / "absent") if which == "missing" else str(adapters[which])
    err = _error(client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path}), 400)
    assert message in err["message"] and err["param"] == "lora_path"
    assert live.engine_loras() == before
    _error(client.post("/v1/completions", json={"model": "bad", "prompt": "x"}), 404)
    assert "bad" not in {c["id"] for c in client.get("/v1/models").json()["data"]}


def test_unload_waits_for_requests_in_flight(client: httpx.Client, live: LoRAServer, adapters: dict[str, Path],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The name goes at once; the stream running through the adapter finishes through it (equal to the same
    request run alone), the engine forgets the adapter after it, and the gauge showed it running meanwhile."""
    assert client.post("/v1/load_lora_adapter", json={"lora_name": "tmp", "lora_path": str(adapters["chat"])}) \
        .status_code == 200
    long = dict(GREEDY, max_tokens=48)
    expected = _complete(client, "tmp", **long)["choices"][0]["text"]
    step = live.engine.step
    monkeypatch.setattr(live.engine, "step", lambda: (time.sleep(0.01), step())[1])  # the stream outlasts the calls
    body = {"model": "tmp", "prompt": PROMPT, "stream": True, **long}
    text, metrics = "", ""
    with client.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
                break
        metrics = client.get("/metrics").text
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "tmp"}).status_code == 200
        _error(client.post("/v1/completions", json={"model": "tmp", "prompt": "x"}), 404)
        assert "tmp" in live.engine_loras().values()  # still running through it
        for line in lines:
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    assert text == expected
    assert re.search(r'vllm:lora_requests_info\{max_lora="2",running_lora_adapters="tmp",'
                     r'waiting_lora_adapters=""\} \d\.\d+e\+09', metrics), metrics
    deadline = time.monotonic() + 10
    while "tmp" in live.engine_loras().values():
        assert time.monotonic() < deadline, "the engine kept the unloaded adapter"
        time.sleep(0.05)


def test_metrics_line_when_idle(client: httpx.Client) -> None:
    lines = [line for line in client.get("/metrics").text.splitlines() if line.startswith("vllm:lora_requests_info")]
    assert len(lines) == 1 and 'max_lora="2"' in lines[0] and 'running_lora_adapters=""' in lines[0]
    assert abs(float(lines[0].rsplit(" ", 1)[1]) - time.time()) < 60


# --- servers without LoRA, or without runtime updating -------------------------------------------------------

def test_routes_are_off_without_enable_lora(server: Any) -> None:  # conftest's shared server: no LoRA
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        err = _error(c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}), 404)
        assert "--enable-lora" in err["message"]
        assert "vllm:lora_requests_info" not in c.get("/metrics").text
        assert all(card["parent"] is None for card in c.get("/v1/models").json()["data"])


def test_start_up_loads_modules_and_fails_on_a_bad_one(tiny_model: Path, adapters: dict[str, Path],
                                                       tmp_path: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), **LORA_ARGS), RequestOutputKind.DELTA)
    try:
        with pytest.raises(ValueError, match=r"--lora-modules wide: .*rank"):
            build_app(engine, [MODEL_NAME], lora_modules=[LoRAModulePath("sql", str(adapters["sql"])),
                                                          LoRAModulePath("wide", str(adapters["wide"]))])
        with pytest.raises(ValueError, match="--lora-modules gone: .*no such folder"):
            build_app(engine, [MODEL_NAME], lora_modules=[LoRAModulePath("gone", str(tmp_path / "gone"))])
        assert engine.list_loras() == {}  # a failed start-up leaves nothing loaded
        app = build_app(engine, [MODEL_NAME], allow_runtime_lora_updating=False,
                        lora_modules=[LoRAModulePath("a", str(adapters["sql"])),
                                      LoRAModulePath("b", str(adapters["chat"]), base_model_name=MODEL_NAME)])
        assert {i: r.lora_name for i, r in engine.list_loras().items()} == {1: "a", 2: "b"}
        assert {n: (a.request.lora_int_id, a.parent) for n, a in app.state.ctx.loras.adapters.items()} == \
            {"a": (1, MODEL_NAME), "b": (2, MODEL_NAME)}
        app.state.ctx.close()
        with pytest.raises(EngineDeadError):  # its thread never started: a call fails at once, never hangs
            asyncio.run(app.state.ctx.engine.list_loras())
    finally:
        engine.shutdown()


def test_runtime_routes_need_the_variable(tiny_model: Path, adapters: dict[str, Path]) -> None:
    off = LoRAServer(tiny_model, [LoRAModulePath("sql", str(adapters["sql"]))], runtime=False)
    try:
        with httpx.Client(base_url=off.base_url, timeout=30) as c:
            err = _error(c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}), 404)
            assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in err["message"] and "--enable-lora" not in err["message"]
            assert c.post("/v1/completions", json={"model": "sql", "prompt": PROMPT, **GREEDY}).status_code == 200
            assert "/v1/load_lora_adapter" not in c.get("/openapi.json").json()["paths"]
    finally:
        off.stop()


# --- flags --------------------------------------------------------------------------------------------------

def test_lora_modules_values() -> None:
    assert parse_lora_module("a=/p/x") == LoRAModulePath("a", "/p/x")
    assert parse_lora_module('{"name": "b", "path": "/q", "base_model_name": "m"}') == LoRAModulePath("b", "/q", "m")
    for bad in ("noequals", "=path", "name=", '{"name": "b"}', '{"name": "b", "path": "/q", "extra": 1}', "{oops"):
        with pytest.raises(ValueError):
            parse_lora_module(bad)
    with pytest.raises(ValueError, match="needs --enable-lora"):
        check_lora_modules([LoRAModulePath("a", "/p")], ["m"], enable_lora=False)
    with pytest.raises(ValueError, match="given twice"):
        check_lora_modules([LoRAModulePath("a", "/p"), LoRAModulePath("a", "/q")], ["m"], enable_lora=True)
    with pytest.raises(ValueError, match="served model's"):
        check_lora_modules([LoRAModulePath("m", "/p")], ["m"], enable_lora=True)
    with pytest.raises(ValueError, match="base_model_name 'x'"):
        check_lora_modules([LoRAModulePath("a", "/p", "x")], ["m"], enable_lora=True)
    assert runtime_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert runtime_updating_allowed({"MINFER_ALLOW_RUNTIME_LORA_UPDATING": " 1 "})
    assert not runtime_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})
    assert not runtime_updating_allowed({})


def test_serve_refuses_lora_modules_without_enable_lora(tiny_model: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", str(tiny_model), "--lora-modules", "a=/p"]) == 2  # before the model loads
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
