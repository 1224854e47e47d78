"""Grammar compiles in child processes (``minfer.engine.grammar``): one past its time limit ends its request
with an error naming the flag while other requests go on; an abort of the only request waiting for a compile
kills its process; a compiler process killed mid-compile fails only that request; nothing outlives
``shutdown``. On the built-in model (a 4,096-token BPE vocabulary), where a 9,000-entry enum takes seconds to
compile and serialize, and a short regex milliseconds."""
from __future__ import annotations

import gc
import os
import re
import signal
import time
import uuid
from typing import Any, Callable

import pytest

from minfer import LLM, SamplingParams, StructuredOutputsParams
from minfer.engine.grammar import GrammarCompileError, GrammarCompiler

PROMPT = "data = "
WAIT = 180.0  # seconds any wait below may take before the test fails (it never decides an assertion)


def big_enum() -> StructuredOutputsParams:
    """A constraint whose compile runs for seconds, a key no other test compiles."""
    tag = uuid.uuid4().hex[:8]
    return StructuredOutputsParams(json={"enum": [f"{tag} value number {i}" for i in range(9000)]})


def regex(pattern: str) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=pattern))


def wait_for(condition: Callable[[], Any], what: str, step: Callable[[], None] = lambda: time.sleep(0.01)) -> Any:
    deadline = time.monotonic() + WAIT
    while not (value := condition()):
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        step()
    return value


def alive(pid: int) -> bool:
    """Whether a process with this id exists (a zombie included: an unreaped child still counts)."""
    return os.path.exists(f"/proc/{pid}")


@pytest.fixture(scope="module")
def llm() -> LLM:
    """An engine whose grammar compiler exists and has a process ready (a first constrained request)."""
    engine = LLM(max_num_seqs=8)
    assert engine.generate(PROMPT, regex("[a-z]{2,5}"), use_tqdm=False)[0].outputs[0].finish_reason == "stop"
    yield engine
    engine.shutdown()


class Driver:
    """Steps an engine, collecting finished outputs and the errors of failed requests."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.llm_engine
        self.finished: dict[str, Any] = {}
        self.errors: dict[str, Exception] = {}

    def step(self) -> None:
        self.finished |= {o.request_id: o for o in self.engine.step() if o.finished}
        self.errors |= self.engine.step_errors

    def run(self, *request_ids: str) -> None:
        wait_for(lambda: all(r in self.finished for r in request_ids), f"requests {request_ids}", self.step)


def test_a_compile_past_its_limit_fails_its_request_while_others_complete(llm):
    """The big compile gets a 0.05 s limit (read when a process takes it); a plain request and a cheap
    constrained one, added while it runs, complete, and the big one ends with the error naming the flag."""
    drive = Driver(llm)
    engine, compiler = drive.engine, llm.llm_engine._grammars
    default = compiler.timeout
    assert default == engine.config.structured_outputs_compile_timeout == 30.0
    compiler.timeout = 0.05
    try:
        engine.add_request("big", PROMPT, SamplingParams(max_tokens=8, structured_outputs=big_enum()))
        future = engine._compiling["big"][0]
        wait_for(lambda: compiler.running() or future.done(), "the big compile to start", drive.step)
    finally:
        compiler.timeout = default
    engine.add_request("plain", "def f(x):", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    engine.add_request("cheap", PROMPT, regex("[a-z]{3,6}"))
    drive.run("big", "plain", "cheap")

    assert drive.finished["big"].outputs[0].finish_reason == "abort" and not drive.finished["big"].outputs[0].token_ids
    error = drive.errors["big"]
    assert isinstance(error, GrammarCompileError) and isinstance(error, ValueError)
    assert "within the limit of 0.05 s" in str(error) and "--structured-outputs-compile-timeout" in str(error)
    assert len(drive.finished["plain"].outputs[0].token_ids) == 12
    cheap = drive.finished["cheap"].outputs[0]
    assert cheap.finish_reason == "stop" and re.fullmatch("[a-z]{3,6}", cheap.text), cheap
    assert set(drive.errors) == {"big"}
    blocks = engine.block_manager
    assert not engine.has_unfinished_requests() and blocks.num_free_blocks == blocks.num_blocks


def test_aborting_the_only_waiter_kills_its_compile(llm):
    drive = Driver(llm)
    engine = drive.engine
    engine.add_request("doomed", PROMPT, SamplingParams(max_tokens=8, structured_outputs=big_enum()))
    compiler, future = engine._grammars, engine._compiling["doomed"][0]
    pid, = wait_for(compiler.running, "the compile to start", drive.step)
    engine.abort_request("doomed")
    assert future.cancelled() and compiler.running() == []
    assert engine.get_stats()["num_grammars_compiling"] == 0 and not engine.has_unfinished_requests()
    wait_for(lambda: pid not in compiler.process_ids() and not alive(pid), "the compiler process to be killed")
    assert engine.step() == [] and engine.step_errors == {}


def test_an_abort_keeps_a_compile_another_request_waits_for(llm):
    """Two requests share one compile (the same key): aborting one leaves it running for the other."""
    drive = Driver(llm)
    engine = drive.engine
    params = regex(f"{uuid.uuid4().hex[:6]}[0-9]{{2}}")
    engine.add_request("gone", PROMPT, params)
    engine.add_request("kept", PROMPT, params)
    future = engine._compiling["kept"][0]
    assert engine._compiling["gone"][0] is future
    engine.abort_request("gone")
    assert not future.cancelled()
    drive.run("kept")
    out = drive.finished["kept"].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch(params.structured_outputs.regex, out.text), out
    assert "gone" not in drive.finished and drive.errors == {}


def test_a_compiler_process_killed_mid_compile_fails_only_its_request(llm):
    drive = Driver(llm)
    engine = drive.engine
    engine.add_request("victim", PROMPT, SamplingParams(max_tokens=8, structured_outputs=big_enum()))
    compiler = engine._grammars
    pid, = wait_for(compiler.running, "the compile to start", drive.step)
    os.kill(pid, signal.SIGKILL)
    drive.run("victim")
    assert drive.finished["victim"].outputs[0].finish_reason == "abort"
    assert isinstance(drive.errors["victim"], GrammarCompileError)
    assert "died (signal SIGKILL)" in str(drive.errors["victim"])
    assert pid not in compiler.process_ids()

    engine.add_request("next", PROMPT, regex("[A-Z]{2}-[0-9]{2}"))
    drive.run("next")
    out = drive.finished["next"].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch("[A-Z]{2}-[0-9]{2}", out.text), out
    assert drive.errors.keys() == {"victim"}


@pytest.fixture(scope="module")
def tokenizer(llm) -> Any:
    return llm.get_tokenizer()


def test_shutdown_leaves_no_process_and_no_waiter(tokenizer):
    """A compiler with one process running a long compile: ``shutdown`` kills and reaps every process and
    cancels what was pending; submitting afterwards is an error."""
    compiler = GrammarCompiler(tokenizer, 4096, frozenset({tokenizer.eos_token_id}))
    cheap = compiler.submit(StructuredOutputsParams(regex="[ab]+"))
    assert cheap.result(timeout=WAIT) is not None
    long = compiler.submit(big_enum())
    wait_for(compiler.running, "the long compile to start")
    queued = compiler.submit(StructuredOutputsParams(regex="[cd]+"))
    pids = compiler.process_ids()
    assert pids and all(alive(p) for p in pids)
    compiler.shutdown()
    assert not any(alive(p) for p in pids), pids
    assert compiler.process_ids() == [] and long.cancelled() and queued.done()
    with pytest.raises(RuntimeError, match="shut down"):
        compiler.submit(StructuredOutputsParams(regex="[ef]+"))
    compiler.shutdown()  # idempotent


def test_a_dropped_compiler_leaves_no_process(tokenizer):
    compiler = GrammarCompiler(tokenizer, 4096, frozenset({tokenizer.eos_token_id}))
    assert compiler.submit(StructuredOutputsParams(regex="[gh]+")).result(timeout=WAIT) is not None
    pids = compiler.process_ids()
    assert pids and all(alive(p) for p in pids)
    del compiler
    gc.collect()
    assert not any(alive(p) for p in pids), pids
