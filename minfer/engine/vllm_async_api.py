"""vLLM's ``AsyncLLMEngine`` API, as a mixin of minfer's ``AsyncLLMEngine``: ``from_engine_args`` and ``generate``.

The server hands the engine thread requests its own pools checked (``add_request``) and reads each ``RequestStream``'s
delta outputs. A vLLM caller writes ``async for out in engine.generate(prompt, params, request_id)`` and reads whole
outputs (``RequestOutputKind.CUMULATIVE``, vLLM's default), one per engine step that advanced the request (several
steps' tokens in one when the reader is slower than the engine). The engine thread starts with the first
``generate``, on its event loop, so ``from_engine_args`` may run before any loop exists.

``abort`` (the engine's own, in ``async_engine.py``) ends a ``generate`` with an output whose unfinished samples say
``finish_reason="abort"``; leaving a ``generate`` early (``break``, the task cancelled) aborts its request, so its
KV blocks are freed either way.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from minfer.engine.llm_engine import LLMEngine
from minfer.engine.processor import EngineRequest, Processor, PromptType
from minfer.engine.request_stream import RequestStream, StreamTable
from minfer.engine.vllm_api import EngineArgsLike
from minfer.lora.request import LoRARequest
from minfer.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind
from minfer.sampling_params import SamplingParams

A = TypeVar("A", bound="VLLMAsyncAPI")


class VLLMAsyncAPI:
    """vLLM's ``AsyncLLMEngine`` calls over the engine thread of ``AsyncLLMEngine`` (whose attributes these are)."""

    engine: LLMEngine
    processor: Processor
    owns_engine: bool
    _thread: threading.Thread | None
    _loop: asyncio.AbstractEventLoop | None
    _streams: StreamTable
    start: Callable[[], None]
    add_request: Callable[[EngineRequest], RequestStream]
    abort: Callable[[str], Any]

    @classmethod
    def from_engine_args(cls: type[A], engine_args: EngineArgsLike) -> A:
        """An engine of ``engine_args`` (``minfer.AsyncEngineArgs``) that ``shutdown`` stops with its thread; one engine
        (replicas, ``data_parallel_size`` > 1, serve under ``minfer serve``)."""
        config = engine_args.create_engine_config()
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={config.data_parallel_size}: AsyncLLMEngine.from_engine_args builds "
                             f"one engine; replicas serve under minfer serve --data-parallel-size N")
        engine = LLMEngine(config, RequestOutputKind.DELTA)  # the thread streams deltas
        async_engine = cls(engine)  # type: ignore[call-arg]
        async_engine.owns_engine = True
        return async_engine

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None, request_id: str,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as it runs, each whole (its text and tokens so far), the last one finished. A bad
        prompt or parameter raises here (a ``ValueError`` naming the field), a reused ``request_id`` too;
        ``sampling_params`` None: the model's defaults. The prompt is tokenized on the event loop."""
        self._serve_this_loop()
        request = self.processor.process(request_id, prompt, sampling_params, lora_request=lora_request)
        stream = self.add_request(request)
        whole = _WholeOutputs(request)
        finished = False
        try:
            async for out in stream:
                out = whole.add(out)
                finished = out.finished
                yield out
            if not finished:  # the stream closed before its request finished: aborted
                finished = True
                yield whole.aborted()
        finally:
            if not finished:  # the caller left early (break, cancelled) or the engine failed
                self.abort(request_id)

    def _serve_this_loop(self) -> None:
        """Start the engine thread on the running loop. A later loop (another ``asyncio.run``) takes it over once
        the first has closed with no stream open: the thread answers on whichever loop ``_loop`` names."""
        loop = asyncio.get_running_loop()
        if self._thread is None:
            self.start()
        elif self._loop is not loop:
            if (self._loop is not None and not self._loop.is_closed()) or self._streams:
                raise RuntimeError("this AsyncLLMEngine serves another event loop, still running; use one engine "
                                   "per event loop")
            self._loop = loop


class _WholeOutputs:
    """One request's delta outputs joined into whole ones, as vLLM's cumulative outputs are: each yielded output owns
    its lists, so a caller may keep it while later ones grow."""

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[dict[int, float]]] = {}
        self.prompt_logprobs: list[dict[int, float] | None] | None = None  # only a request's first delta has them
        self.last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> RequestOutput:
        """``out`` (a delta: each sample's tokens from ``token_offset``; or a whole, finished output) made whole."""
        completions = []
        for c in out.outputs:
            tokens = self.tokens.setdefault(c.index, [])
            del tokens[c.token_offset:]
            tokens += c.token_ids
            logprobs = None
            if c.logprobs is not None:
                logprobs = self.logprobs.setdefault(c.index, [])
                del logprobs[c.token_offset:]
                logprobs += c.logprobs
                logprobs = list(logprobs)
            completions.append(dataclasses.replace(c, token_ids=list(tokens), logprobs=logprobs, token_offset=0))
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.last = dataclasses.replace(out, outputs=completions, prompt_logprobs=self.prompt_logprobs)
        return self.last

    def aborted(self) -> RequestOutput:
        """The final output of an aborted request: what it had, its unfinished samples ending with "abort"."""
        now = time.time()
        last = self.last
        if last is None:
            r = self.request
            return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids,
                                 [CompletionOutput(i, "", [], None, None, "abort") for i in range(r.params.n)],
                                 True, RequestMetrics(r.arrival_time, finished_time=now))
        completions = [c if c.finish_reason is not None else dataclasses.replace(c, finish_reason="abort")
                       for c in last.outputs]
        metrics = dataclasses.replace(last.metrics, finished_time=now)
        return dataclasses.replace(last, outputs=completions, finished=True, metrics=metrics)
