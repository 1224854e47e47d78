"""Work kept off the event loop, and the watch for a client going away.

The event loop keeps answering /health and streaming other clients' tokens, so nothing that grows with a
request runs on it. ``WorkPool`` is a few threads for one kind of work (``ServerContext`` keeps one per
kind, so that no kind waits behind another); where the pool holds ``Processor``s, each call borrows one no
other thread uses now, since a Rust tokenizer used from two threads at once can fail with 'Already
borrowed'. ``OffloadedBodyRoute`` has a request body decoded and validated on such a pool
(``parse_body``) rather than by FastAPI on the loop, where a large body would hold up every other client.
``until_disconnect`` awaits work unless the client leaves first, which cancels it (``ClientGone``).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from concurrent.futures import ThreadPoolExecutor
from queue import SimpleQueue
from typing import Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from minfer.engine.processor import Processor

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


class ClientGone(Exception):
    """The client closed the connection; its requests have been aborted."""


class WorkPool:
    """A few threads for one kind of work; with ``processors``, each call borrows one no other thread uses
    now (one per thread)."""

    def __init__(self, name: str, workers: int, processors: list[Processor] | None = None) -> None:
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix=f"minfer-{name}")
        self._processors: SimpleQueue[Processor | None] = SimpleQueue()
        for processor in processors or [None] * workers:
            self._processors.put(processor)

    async def run(self, fn: Callable[[Processor], T], on_cancel: Callable[[], None] | None = None) -> T:
        """``fn(processor)`` on a pool thread. Cancelled (the client left, the server stops), a call still
        queued never runs, and ``on_cancel`` is called for one already running (to stop it)."""
        def call() -> T:
            processor = self._processors.get()
            try:
                return fn(processor)  # type: ignore[arg-type]
            finally:
                self._processors.put(processor)

        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        except asyncio.CancelledError:
            if on_cancel is not None:
                on_cancel()
            raise

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first, which cancels it and raises ClientGone.

    Used for non-streamed responses and for the wait before a stream's first chunk: nothing is
    being written then, so a closed socket would otherwise go unnoticed until the very end.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):  # let it unwind before the caller cleans up after it
        await task
    raise ClientGone()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def parse_body(pool: WorkPool, request: Request, model: type[M]) -> M:
    """The request body as ``model``, decoded and validated on ``pool``; a body that is no JSON, or
    not the model, raises FastAPI's RequestValidationError (the 400s of ``errors.py``)."""
    try:
        body = await request.body()
    except ClientDisconnect:
        raise ClientGone() from None
    if not _is_json(request.headers.get("content-type")):  # as FastAPI: the body is then no object
        raise RequestValidationError([{"type": "model_attributes_type", "loc": ("body",),
                                       "msg": "the request body must be a JSON object"}])
    return await pool.run(lambda _: _parse(body, model))


def _is_json(content_type: str | None) -> bool:
    """``application/json`` or ``application/<x>+json``, parameters aside."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _parse(body: bytes, model: type[M]) -> M:
    if not body:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required"}])
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: brackets nested past Python's stack
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body",), "msg": "JSON decode error",
                                       "ctx": {"error": why}}]) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None
    except RecursionError:
        raise RequestValidationError([{"type": "value_error", "loc": ("body",),
                                       "msg": "the request body is nested too deeply"}]) from None


class OffloadedBodyRoute(APIRoute):
    """A POST route whose endpoint takes ``(req: <model>, raw: Request)`` and returns a Response or a model:
    FastAPI still documents both models, but the body is decoded and validated on the parse pool
    (``ServerContext.parse_body``, the app's ``state.ctx``), not on the event loop, where a large body would
    hold up every other client."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        assert self.body_field is not None, f"{self.path}: an offloaded route needs a body model"
        model, endpoint = self.body_field.field_info.annotation, self.endpoint

        async def handler(request: Request) -> Response:
            req = await request.app.state.ctx.parse_body(request, model)
            result = await endpoint(req, request)  # a Response, or a model FastAPI would have serialized
            return result if isinstance(result, Response) else JSONResponse(jsonable_encoder(result))

        return handler
