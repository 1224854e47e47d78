"""vLLM's engine classes as a vLLM user writes them (``from minfer import EngineArgs, LLMEngine, AsyncLLMEngine,
AsyncEngineArgs``) on the built-in model: EngineArgs through argparse and its errors, the LLMEngine step loop against
``LLM.generate``, AsyncLLMEngine streaming two requests while a third is aborted, and the server extra's message."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import subprocess
import sys
import threading
from importlib import metadata
from typing import Any

import pytest

import minfer
from minfer import AsyncEngineArgs, AsyncLLMEngine, EngineArgs, LLMEngine, SamplingParams
from minfer.cli import build_parser
from minfer.config import EngineConfig
from minfer.engine.async_engine import EngineDeadError
from minfer.llm import LLM, builtin_model_path
from minfer.outputs import RequestOutput

MODEL = str(builtin_model_path())
ARGS: dict[str, Any] = dict(max_model_len=256, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)
PROMPTS = ["def fibonacci(n):", "import os\n"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)  # never finishes within these tests


@pytest.fixture(scope="module")
def reference() -> list[RequestOutput]:
    """``LLM.generate``'s greedy outputs of PROMPTS."""
    with LLM(MODEL, **ARGS) as llm:
        return llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_the_classes_import_from_minfer_without_torch() -> None:
    from minfer.engine import async_engine, llm_engine

    assert minfer.AsyncLLMEngine is async_engine.AsyncLLMEngine  # the server's class, not a second one
    assert minfer.LLMEngine is llm_engine.LLMEngine and issubclass(AsyncEngineArgs, EngineArgs)
    assert {"EngineArgs", "AsyncEngineArgs", "LLMEngine", "AsyncLLMEngine"} <= set(minfer.__all__)
    code = "import sys; from minfer import EngineArgs; EngineArgs(max_model_len=8); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_engine_args_round_trip_through_argparse() -> None:
    parser = argparse.ArgumentParser()
    assert EngineArgs.add_cli_args(parser) is parser
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    flags = ["--model", MODEL, "--max-model-len", "128", "--dtype", "bf16", "--no-enable-prefix-caching",
             "--gpu-memory-utilization", "0.5", "--speculative-config", json.dumps(spec)]
    args = EngineArgs.from_cli_args(parser.parse_args(flags))
    given = dict(model=MODEL, max_model_len=128, dtype="bf16", enable_prefix_caching=False,
                 gpu_memory_utilization=0.5, speculative_config=spec)
    assert type(args) is EngineArgs and args == EngineArgs(**given)
    assert args.create_engine_config() == EngineConfig(**given)  # aliases (bf16) and the JSON resolved alike
    assert type(args.create_engine_config()) is EngineConfig
    defaults = AsyncEngineArgs.from_cli_args(parser.parse_args([]))
    assert type(defaults) is AsyncEngineArgs and defaults == AsyncEngineArgs()
    assert defaults.create_engine_config() == EngineConfig(model=MODEL)  # no model: the built-in one


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "bench-serve", "eval-ppl"])
def test_every_engine_command_parses_into_engine_args(command: str) -> None:
    positional = {"generate": ["hi"], "eval-ppl": ["a.txt"]}.get(command, [])
    args = build_parser().parse_args([command, "--max-num-seqs", "4", *positional])
    assert EngineArgs.from_cli_args(args) == EngineArgs(max_num_seqs=4)


@pytest.mark.parametrize("kwargs,flags,message", [
    (dict(dtype="int3"), ["--dtype", "int3"], "dtype must be one of"),
    (dict(block_size=7), ["--block-size", "7"], "block_size must be a power of two"),
    (dict(max_num_seqs=0), ["--max-num-seqs", "0"], "max_num_seqs must be an integer >= 1"),
    (dict(speculative_config='{"method": "ngram", "k": 1}'), ["--speculative-config", '{"method": "ngram", "k": 1}'],
     r"speculative_config has unknown field\(s\) \['k'\]"),
])
def test_a_bad_engine_arg_fails_naming_the_field(kwargs: dict[str, Any], flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    with pytest.raises(ValueError, match=message):
        AsyncEngineArgs.from_cli_args(parser.parse_args(flags))


def test_an_unknown_engine_arg_is_named() -> None:
    with pytest.raises(TypeError, match="max_num_sequences"):
        EngineArgs(max_num_sequences=4)  # type: ignore[call-arg]


def test_llm_engine_step_loop_equals_llm_generate(reference: list[RequestOutput]) -> None:
    engine = LLMEngine.from_engine_args(EngineArgs(model=MODEL, **ARGS))
    try:
        engine.add_request("0", PROMPTS[0], GREEDY)
        engine.add_request("1", PROMPTS[1], GREEDY, lora_request=None)
        assert engine.get_num_unfinished_requests() == 2 and engine.get_tokenizer() is engine.tokenizer
        seen: dict[str, list[RequestOutput]] = {"0": [], "1": []}
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id].append(out)
        for i, ref in enumerate(reference):
            outs = seen[str(i)]
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
            assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids  # the same greedy tokens
            assert outs[-1].outputs[0].text == ref.outputs[0].text
            assert _grow(outs) and len(outs) > 2
        engine.add_request("a", PROMPTS[0], LONG)
        engine.add_request("b", PROMPTS[1], LONG)
        for _ in range(3):
            engine.step()
        engine.abort_request(["a", "b", "unknown"])  # several ids at once, as vLLM takes them
        stats = engine.get_stats()
        assert not engine.has_unfinished_requests() and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    finally:
        engine.shutdown()


def _gate_victim(llm_engine: LLMEngine, request_id: str) -> tuple[threading.Event, threading.Event]:
    """Hold the engine thread before the step after ``request_id``'s second output token is known (so its first
    outputs were handed to the event loop), until released: the abort then lands mid-request, however fast the
    thread runs. Returns (held, release)."""
    held, release = threading.Event(), threading.Event()
    step = llm_engine.step

    def gated_step() -> list[RequestOutput]:
        seqs = llm_engine.requests.get(request_id)
        if seqs and not held.is_set() and seqs[0].num_known_tokens - seqs[0].num_prompt_tokens >= 2:
            held.set()
            release.wait(30)
        return step()

    llm_engine.step = gated_step  # type: ignore[method-assign]
    return held, release


def _grow(outs: list[RequestOutput]) -> bool:
    """Cumulative outputs (vLLM's default): each whole so far, so each extends the one before."""
    tokens = [o.outputs[0].token_ids for o in outs]
    return all(b[:len(a)] == a and len(b) > len(a) for a, b in zip(tokens, tokens[1:]))


async def _read(engine: AsyncLLMEngine, prompt: str, params: SamplingParams, request_id: str) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_async_engine_streams_two_requests_while_one_is_aborted(reference: list[RequestOutput]) -> None:
    threads_before = set(threading.enumerate())
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=MODEL, **ARGS))
    llm_engine = engine.engine
    held, release = _gate_victim(llm_engine, "victim")

    async def run() -> tuple[list[RequestOutput], list[RequestOutput]]:
        async def abort_when_held() -> None:
            assert await asyncio.to_thread(held.wait, 30)
            await engine.abort("victim")  # vLLM's form; the stream ends, its blocks go back before the next step
            release.set()

        keeper, victim, _ = await asyncio.gather(_read(engine, PROMPTS[0], GREEDY, "keeper"),
                                                 _read(engine, PROMPTS[1], LONG, "victim"), abort_when_held())
        return keeper, victim

    try:
        keeper, victim = asyncio.run(run())  # the engine thread starts with the first generate
        final = keeper[-1]
        assert final.finished and final.outputs[0].finish_reason == "length"
        assert final.outputs[0].token_ids == reference[0].outputs[0].token_ids
        assert final.outputs[0].text == reference[0].outputs[0].text
        assert _grow(keeper) and _grow(victim[:-1]) and len(keeper) > 2 and len(victim) >= 2
        assert not any(o.finished for o in keeper[:-1] + victim[:-1])
        end = victim[-1]  # after what it had streamed, the aborted stream's end
        assert end.finished and end.outputs[0].finish_reason == "abort" and end.request_id == "victim"
        got = end.outputs[0].token_ids
        assert got == victim[-2].outputs[0].token_ids and 0 < len(got) < LONG.max_tokens
        assert got == reference[1].outputs[0].token_ids[:len(got)]
        assert not llm_engine.requests  # the abort was applied before the keeper's last step
        assert llm_engine.block_manager.num_free_blocks == llm_engine.block_manager.num_blocks

        async def leave_early_then_run_another() -> list[RequestOutput]:
            async with contextlib.aclosing(engine.generate(PROMPTS[0], LONG, "leaver")) as outputs:
                async for _ in outputs:
                    break  # closing the generator aborts its request
            return await _read(engine, PROMPTS[1], GREEDY, "after")  # queued behind that abort

        after = asyncio.run(leave_early_then_run_another())  # a second event loop takes the engine over
        assert after[-1].outputs[0].token_ids == reference[1].outputs[0].token_ids
        assert not llm_engine.requests
        assert llm_engine.block_manager.num_free_blocks == llm_engine.block_manager.num_blocks
    finally:
        release.set()
        engine.shutdown()
    assert set(threading.enumerate()) <= threads_before  # the engine thread has stopped
    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(_read(engine, PROMPTS[0], GREEDY, "late"))


def test_the_missing_server_extra_message_names_an_extra_that_exists() -> None:
    """The command it names installs the extra from the checkout: the installed package (built from pyproject.toml)
    has a ``server`` extra holding every module the check looks for."""
    from minfer.server import run

    assert 'pip install -e ".[server]"' in run._INSTALL and "checkout" in run._INSTALL
    installed = metadata.metadata("minfer")
    assert "server" in installed.get_all("Provides-Extra")
    extra = {req.split(";")[0].split(">")[0].strip().lower() for req in installed.get_all("Requires-Dist")
             if req.endswith('extra == "server"')}
    assert {module.replace("_", "-") for module in run.SERVER_EXTRA} <= extra
