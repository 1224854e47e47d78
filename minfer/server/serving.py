"""What both OpenAI endpoints share: ``ServerContext`` (the model check, prompt checks, SamplingParams,
the work pools, queueing), and running engine streams under a watch for the client going away
(``collect``, ``stream_response``).

None of it runs on the engine thread: a bad request is turned away here with a 4xx before the
engine sees it. Nothing that grows with the request runs on the event loop, which keeps answering
/health and streaming other clients' tokens; such work runs on small thread pools (``offload.WorkPool``),
one per kind, so that no kind waits behind another:

- ``parse``: the body's JSON and its pydantic model (``parse_body``, called by ``OffloadedBodyRoute``);
- ``check``: output constraints (a schema, a grammar, a tool choice's schema) and the tool plan;
- ``tokenize``: the server's chat template, tokenizing, checking token ids, decoding an echoed prompt,
  after the O(1) count and length checks that turn the largest requests away first;
- ``template``: a request's own ``chat_template`` (with ``--trust-request-chat-template``), rendered and
  tokenized apart, so that a template written to loop never holds up another client's tokenizing.

Each tokenizing thread borrows a ``Processor`` of its own: a Rust tokenizer used from two threads at once
can fail with 'Already borrowed'. Template renders run under a ``RenderBudget`` (a deadline and a cancel
flag the client's disconnect or the server's shutdown sets).
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from minfer.engine.async_engine import (AsyncLLMEngine, EngineDeadError, QueueFullError, RequestStream,
                                        StepFailedError)
from minfer.engine.processor import EngineRequest, Processor, PromptError
from minfer.lora.request import LoRARequest
from minfer.outputs import RequestOutput
from minfer.sampling_params import SamplingParams, StructuredOutputsParams
from minfer.server.chat_template import RENDER_TIMEOUT_S, RenderBudget
from minfer.server.errors import APIError, bad_request, error_body
from minfer.server.lora import LoRARegistry
from minfer.server.offload import ClientGone, WorkPool, parse_body, until_disconnect
from minfer.server.request_fields import SamplingFields
from minfer.server.stream import DONE, sse
from minfer.server.structured import build, request_constraint

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
_SAMPLING_FIELDS = set(SamplingParams.__dataclass_fields__) | {"max_completion_tokens", "top_logprobs"}
MAX_SEQUENCES = 1024  # prompts x n in one request
TOKENIZE_WORKERS = 2
TEMPLATE_WORKERS = 2  # a request's own chat template
CHECK_WORKERS = 2  # output constraints
PARSE_WORKERS = 2  # request bodies
MAX_STREAM_INTERVAL = 1024  # tokens a streamed chunk waits for
logger = logging.getLogger("minfer.server")


@dataclass
class ServerContext:
    """The engine, the event loop's processor (its own tokenizer copy), the served names and the work pools.

    ``auto_tool_parser``: the parser (``--tool-call-parser``) of ``tool_choice="auto"`` answers, None unless
    auto tool choice is enabled (``--enable-auto-tool-choice``). ``trust_request_chat_template``: a request
    may send its own ``chat_template`` (``--trust-request-chat-template``; else that field is a 400).
    ``render_timeout_s``: the time one chat template render may take. ``reasoning_parser``: the name
    (``--reasoning-parser``, in ``minfer.reasoning.REASONING_PARSERS``) that splits a chat answer's reasoning
    into ``reasoning_content``; None: the whole text is the content. ``stream_interval``: the new tokens of a
    streamed request that make a chunk (``--stream-interval``; ``RequestStream.interval``)."""

    engine: AsyncLLMEngine
    served_model_names: list[str]
    retry_after_s: int = 1
    created: int = field(default_factory=lambda: int(time.time()))
    tokenize_workers: int = TOKENIZE_WORKERS
    auto_tool_parser: str | None = None
    trust_request_chat_template: bool = False
    render_timeout_s: float = RENDER_TIMEOUT_S
    reasoning_parser: str | None = None
    stream_interval: int = 1

    def __post_init__(self) -> None:
        check_stream_interval(self.stream_interval)
        self.processor.clamp_max_tokens = False  # a max_tokens past the context is a 400, as in vLLM
        _ = self.processor.max_token_chars  # computed once, before the clones copy it
        self.worker_processors = [self.processor.clone() for _ in range(self.tokenize_workers)]
        self._tokenize = WorkPool("tokenize", self.tokenize_workers, self.worker_processors)
        self._template = WorkPool("template", TEMPLATE_WORKERS,
                                  [self.processor.clone() for _ in range(TEMPLATE_WORKERS)]
                                  if self.trust_request_chat_template else None)
        self._check = WorkPool("check", CHECK_WORKERS)
        self._parse = WorkPool("parse", PARSE_WORKERS)
        self._renders: set[RenderBudget] = set()  # in flight: cancelled when the server stops
        self.loras = LoRARegistry(self.engine, self.served_model_names)  # the adapters a ``model`` may name

    async def offload(self, fn: Callable[[Processor], T], on_cancel: Callable[[], None] | None = None) -> T:
        """``fn(processor)`` on the tokenizer pool, with a processor (and tokenizer) no other thread uses now."""
        return await self._tokenize.run(fn, on_cancel)

    async def offload_check(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the constraint-check pool (schemas, grammars: apart from tokenizing)."""
        return await self._check.run(lambda _: fn())

    async def render(self, request: Request, fn: Callable[[Processor, RenderBudget], T], own_template: bool) -> T:
        """``fn(processor, budget)``, which renders a chat template under ``budget`` and tokenizes it: on the
        tokenizer pool, or for a request's own template (``own_template``) on the template pool. The render
        stops when the client leaves (``ClientGone``) or the server stops."""
        budget = RenderBudget(self.render_timeout_s)
        pool = self._template if own_template else self._tokenize
        self._renders.add(budget)
        try:
            return await until_disconnect(request, pool.run(lambda p: fn(p, budget), budget.cancel))
        finally:
            self._renders.discard(budget)

    async def parse_body(self, request: Request, model: type[M]) -> M:
        """The request body as ``model``, decoded and validated on the parse pool (``offload.parse_body``)."""
        return await parse_body(self._parse, request, model)

    def close(self) -> None:
        for budget in list(self._renders):
            budget.cancel()
        for pool in (self._tokenize, self._template, self._check, self._parse):
            pool.close()

    @property
    def processor(self) -> Processor:
        return self.engine.processor

    @property
    def tokenizer(self) -> Any:
        return self.engine.processor.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.processor.max_model_len

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def pooling(self) -> bool:
        """The model runs with --runner pooling: it serves /v1/embeddings (``embeddings.py``) and generates nothing."""
        return self.engine.engine.pooler is not None

    # ---- checks ---------------------------------------------------------------------------
    def check_model(self, name: str | None) -> str:
        """The served name (the model's, or a LoRA adapter's: ``lora_request``) a request's ``model`` means."""
        if name is not None and name not in self.served_model_names and self.loras.get(name) is None:
            adapters = f" and the LoRA adapters {self.loras.names()}" if self.loras.adapters else ""
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{self.served_model_names}{adapters}", "model", "model_not_found")
        return name or self.model_name

    def lora_request(self, model: str) -> LoRARequest | None:
        """The adapter a checked ``model`` name runs through; None: the base model."""
        return self.loras.get(model)

    def require_tokenizer(self, what: str, param: str) -> Any:
        if self.tokenizer is None:
            raise APIError(400, f"{what} needs a tokenizer, but this server runs with --skip-tokenizer-init; "
                                f"send prompts as token-id lists", param)
        return self.tokenizer

    def check_count(self, num_prompts: int, n: int, param: str = "prompt") -> None:
        if num_prompts * n > MAX_SEQUENCES:
            raise APIError(400, f"{param}: a batch of {num_prompts} prompts with n={n} is over {MAX_SEQUENCES} "
                                f"sequences", param)

    async def constraint(self, req: SamplingFields) -> StructuredOutputsParams | None:
        """The request's ``response_format`` / ``structured_outputs`` / ``guided_*`` as the engine's params,
        checked on the constraint pool (building the grammar is work that grows with the schema)."""
        given = request_constraint(req)
        if given is None:
            return None
        return await self.offload_check(lambda: build(*given))

    def sampling_params(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        if stop and self.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer (the server runs with --skip-tokenizer-init)", "stop")
        kwargs = dict(n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                      presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                      repetition_penalty=req.repetition_penalty, seed=req.seed, stop=stop,
                      stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, max_tokens=max_tokens,
                      min_tokens=req.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                      skip_special_tokens=req.skip_special_tokens,
                      include_stop_str_in_output=req.include_stop_str_in_output,
                      structured_outputs=structured_outputs, allowed_token_ids=req.allowed_token_ids,
                      logit_bias={int(t): b for t, b in req.logit_bias.items()} if req.logit_bias else None)
        # A field left out takes the model's generation_config.json setting, else SamplingParams' default
        # (OpenAI's); max_tokens left out means up to the context.
        defaults = {k: v for k, v in self.processor.sampling_defaults.items() if k != "max_tokens"}
        given = {k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"}
        try:
            return SamplingParams(**{**defaults, **given})
        except ValueError as exc:
            raise bad_request(exc, _SAMPLING_FIELDS) from exc

    # ---- running requests -----------------------------------------------------------------
    def submit(self, requests: list[EngineRequest]) -> list[RequestStream]:
        """Queue the requests; all or none. One that runs through a LoRA adapter unloaded while it was being
        prepared is a 404, as its ``model`` would be now. A request of the other runner is a 400."""
        if any(isinstance(r.params, SamplingParams) == self.pooling for r in requests):
            raise APIError(400, "this server runs its model with --runner pooling: it serves /v1/embeddings, not text "
                           "generation" if self.pooling else "embeddings need a server started with --runner pooling")
        for request in requests:
            lora = request.lora_request
            if lora is not None and not self.loras.is_served(lora):
                raise APIError(404, f"the model {lora.lora_name!r} (a LoRA adapter) was unloaded", "model",
                               "model_not_found")
        streams: list[RequestStream] = []
        try:
            for request in requests:
                streams.append(self.engine.add_request(request))
                if request.lora_request is not None:
                    self.loras.hold(request.request_id, request.lora_request)
        except QueueFullError as exc:
            self.abort(streams)
            raise APIError(503, f"the server is overloaded: {exc}; retry in {self.retry_after_s} s",
                           code="queue_full", headers={"Retry-After": str(self.retry_after_s)}) from exc
        except EngineDeadError as exc:
            self.abort(streams)
            raise APIError(500, str(exc), code="engine_dead") from exc
        return streams

    def abort(self, streams: list[RequestStream]) -> None:
        """End the requests (those not finished are aborted); every request's way out, whatever ended it."""
        for stream in streams:
            if not stream.finished:
                self.engine.abort(stream.request_id)
            self.loras.release(stream.request_id)


def process(processor: Processor, request_id: str, text: str | None, ids: list[int] | None,
            params: SamplingParams, param: str, add_special_tokens: bool = True,
            lora_request: LoRARequest | None = None) -> EngineRequest:
    """Tokenize ``text`` unless ``ids`` are given, then the engine's own checks (``Processor``), before the
    request is queued; ``param`` names the prompt field in the error. Run on the tokenizer pool."""
    try:
        if ids is None:
            ids = encode(processor, text or "", param, add_special_tokens)
        return processor.process(request_id, {"prompt": text, "prompt_token_ids": ids}, params,
                                 lora_request=lora_request)
    except PromptError as exc:
        name = param if exc.field == "prompt" else exc.field
        message = str(exc) if str(exc).startswith(name) else f"{name}: {exc}"
        raise APIError(400, message, name) from exc
    except (ValueError, TypeError) as exc:
        raise bad_request(exc, _SAMPLING_FIELDS) from exc


def encode(processor: Processor, text: str, param: str, add_special_tokens: bool) -> list[int]:
    """Token ids of a text after the length bound; a tokenizer's refusal is the caller's 400, its text logged."""
    try:
        processor.check_text_length(len(text))
    except PromptError as exc:
        raise APIError(400, f"{param}: {exc}", param) from exc
    try:
        return processor.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception as exc:  # noqa: BLE001 - whatever the tokenizer refuses came from the request
        logger.info("the tokenizer rejected %s: %r", param, exc)
        raise APIError(400, f"{param}: the tokenizer could not encode this text", param) from exc


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_error(exc: BaseException) -> APIError:
    """Map an error raised by an engine stream to what the client sees. The engine's named failures (its loop
    died, the step serving the request failed) say so; anything else is logged and reported generically."""
    if isinstance(exc, (ValueError, TypeError)):
        return bad_request(exc)
    if isinstance(exc, EngineDeadError):
        return APIError(500, str(exc), code="engine_dead")
    if isinstance(exc, StepFailedError):
        return APIError(500, str(exc), code="step_failed")
    logger.error("unexpected error from an engine stream", exc_info=exc)
    return APIError(500, "internal server error (details are in the server log)", code="internal_error")


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def check_stream_interval(interval: int) -> None:
    if not isinstance(interval, int) or isinstance(interval, bool) or not 1 <= interval <= MAX_STREAM_INTERVAL:
        raise ValueError(f"stream_interval (--stream-interval) must be an integer in [1, {MAX_STREAM_INTERVAL}], "
                         f"got {interval!r}")


async def collect(ctx: ServerContext, request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of every stream (a non-streamed response); aborts all if anything fails. The streams wake
    their reader for the first and the last output only."""
    for stream in streams:
        stream.interval = 0
    async def drain() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in merged(streams):
            finals[i] = out
        return finals  # type: ignore[return-value]

    try:
        return await until_disconnect(request, drain())
    except (ClientGone, asyncio.CancelledError):
        raise
    except Exception as exc:  # noqa: BLE001
        raise engine_error(exc) from exc
    finally:
        ctx.abort(streams)


Render = Callable[[int, RequestOutput], list[bytes]]


async def stream_response(ctx: ServerContext, request: Request, streams: list[RequestStream], render: Render,
                          tail: Callable[[], list[bytes]]) -> StreamingResponse:
    """An SSE response of ``render(stream index, output)`` chunks, then ``tail()`` and [DONE].

    The status line waits for the first output, so an error before any token (the engine loop
    died, the engine refused the prompt) is still a proper 4xx/5xx rather than a 200 carrying an
    error. Later failures arrive as an ``{"error": ...}`` event, which OpenAI clients raise.
    Leaving the body iterator for any reason (the client went away, cancellation) aborts the
    requests, freeing their KV blocks at once. A chunk carries ``ctx.stream_interval`` new tokens
    (the first and the last may carry fewer).
    """
    for stream in streams:
        stream.interval = ctx.stream_interval
    outputs = merged(streams)
    try:
        first = await until_disconnect(request, outputs.__anext__())
    except BaseException as exc:
        ctx.abort(streams)
        await outputs.aclose()
        if isinstance(exc, Exception) and not isinstance(exc, ClientGone):
            raise engine_error(exc) from exc
        raise

    async def body() -> AsyncIterator[bytes]:
        try:
            for chunk in render(*first):
                yield chunk
            async for i, out in outputs:
                for chunk in render(i, out):
                    yield chunk
            for chunk in tail():
                yield chunk
        except Exception as exc:  # noqa: BLE001 - reported in-band: the 200 is already sent
            err = engine_error(exc)
            yield sse(error_body(err.status, err.message, err.param, err.code))
        finally:
            ctx.abort(streams)
            await outputs.aclose()
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
