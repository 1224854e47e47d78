"""Multi-LoRA serving over HTTP, vLLM's interface: a request's ``model`` names an adapter, ``--lora-modules`` are
loaded at start-up, and with runtime updating allowed (``lora_modules.runtime_updating_allowed``) POST
/v1/load_lora_adapter and /v1/unload_lora_adapter change the set while the server runs.

``LoRARegistry`` is the served set, on the event loop: names to ``LoRARequest``s, whose ids count 1, 2, ... in load
order and are never reused, so an id the engine still holds for a request in flight can never mean another
adapter. Every load goes through the engine (``AsyncLLMEngine.add_lora``, between steps), which checks the adapter
against the model; a refused one is a 400 and leaves nothing loaded. Unloading takes the name away at once (a new
request naming it is a 404), but the engine refuses to forget an adapter its sequences still use, so the requests in
flight through it finish through it and the engine forgets it when the last of them ends (``hold`` / ``release``,
called by ``ServerContext`` as requests are queued and end).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from minfer.engine.async_engine import AsyncLLMEngine, EngineDeadError
from minfer.engine.llm_engine import LLMEngine
from minfer.lora.peft_config import LoRAAdapterError
from minfer.lora.request import LoRARequest
from minfer.server.errors import APIError
from minfer.server.lora_modules import RUNTIME_UPDATING_ENV, LoRAModulePath
from minfer.server.offload import OffloadedBodyRoute
from minfer.server.responses import ErrorResponse

logger = logging.getLogger("minfer.server")
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 404, 500)}


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    """An adapter the server routes to: the engine's request, and the served model it lists as its ``parent``."""

    request: LoRARequest
    parent: str


class LoRARegistry:
    """The adapters served by name, and which requests in flight run through which adapter (event loop only)."""

    def __init__(self, engine: AsyncLLMEngine, served_model_names: Sequence[str]) -> None:
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.enabled = engine.engine.config.enable_lora
        self.adapters: dict[str, ServedAdapter] = {}
        self._next_id = 1
        self._loading: set[str] = set()
        self._holds: dict[str, int] = {}  # request id -> the adapter id it runs through, while it is in the engine
        self._draining: set[int] = set()  # unloaded, with requests still in flight: removed when the last ends
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- lookups -----------------------------------------------------------------------------
    def get(self, name: str | None) -> LoRARequest | None:
        served = self.adapters.get(name) if name is not None else None
        return served.request if served is not None else None

    def is_served(self, lora: LoRARequest) -> bool:
        """Whether ``lora`` is still the adapter its name routes to (it may have been unloaded since)."""
        served = self.adapters.get(lora.lora_name)
        return served is not None and served.request == lora

    def names(self) -> list[str]:
        return list(self.adapters)

    # ---- loading -----------------------------------------------------------------------------
    def load_static(self, engine: LLMEngine, modules: Sequence[LoRAModulePath]) -> None:
        """Load ``--lora-modules`` on the engine itself, before its thread starts; the first that fails stops
        start-up with a ValueError naming it, and those loaded before it are removed."""
        for module in modules:
            request = self._new_request(module.name, module.path)
            try:
                engine.add_lora(request)
            except ValueError as exc:
                for served in self.adapters.values():
                    engine.remove_lora(served.request.lora_int_id)
                self.adapters.clear()
                raise ValueError(f"--lora-modules {module.name}: {exc}") from exc
            self.adapters[module.name] = ServedAdapter(request, module.base_model_name or self.served_model_names[0])
            logger.info("loaded LoRA adapter %r from %s (id %d)", module.name, module.path, request.lora_int_id)

    async def load(self, name: str, path: str, replace: bool = False) -> LoRARequest:
        """Load an adapter under a new id and serve it as ``name`` (``replace``: in place of the one of that name,
        which is then unloaded as ``unload`` does). Errors are ``APIError``s: 400 for a name in use or an adapter
        the engine refuses."""
        if name in self.served_model_names:
            raise APIError(400, f"lora_name: {name!r} is the served model's name; give the adapter its own",
                           "lora_name")
        if name in self._loading or (name in self.adapters and not replace):
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        self._loading.add(name)
        # shielded: a client that leaves mid-load still has the adapter served, never loaded in the engine unnamed
        return await asyncio.shield(asyncio.ensure_future(self._load(name, path)))

    async def _load(self, name: str, path: str) -> LoRARequest:
        request = self._new_request(name, path)
        try:
            await self.engine.add_lora(request)
        except LoRAAdapterError as exc:
            raise APIError(400, str(exc), "lora_path") from exc
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        except EngineDeadError as exc:
            raise APIError(500, str(exc), code="engine_dead") from exc
        finally:
            self._loading.discard(name)
        old = self.adapters.get(name)
        self.adapters[name] = ServedAdapter(request, self.served_model_names[0])
        logger.info("loaded LoRA adapter %r from %s (id %d)", name, path, request.lora_int_id)
        if old is not None:
            await self._forget(old.request.lora_int_id)
        return request

    def _new_request(self, name: str, path: str) -> LoRARequest:
        request = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return request

    # ---- unloading ---------------------------------------------------------------------------
    async def unload(self, name: str | None, lora_int_id: int | None) -> LoRARequest:
        """Stop serving an adapter (by name, id, or both naming the same one); 404 if none matches."""
        served = self.adapters.get(name) if name is not None else \
            next((a for a in self.adapters.values() if a.request.lora_int_id == lora_int_id), None)
        if served is None:
            what = f"'{name}'" if name is not None else f"with lora_int_id {lora_int_id}"
            raise APIError(404, f"The lora adapter {what} cannot be found.",
                           "lora_name" if name is not None else "lora_int_id", "lora_not_found")
        if lora_int_id is not None and served.request.lora_int_id != lora_int_id:
            raise APIError(404, f"The lora adapter '{name}' has lora_int_id {served.request.lora_int_id}, not "
                                f"{lora_int_id}.", "lora_int_id", "lora_not_found")
        del self.adapters[served.request.lora_name]
        logger.info("unloaded LoRA adapter %r (id %d)", served.request.lora_name, served.request.lora_int_id)
        await self._forget(served.request.lora_int_id)
        return served.request

    async def _forget(self, lora_int_id: int) -> None:
        """Have the engine forget an adapter no name routes to: now, or once its requests in flight have ended."""
        if lora_int_id in self._holds.values():
            self._draining.add(lora_int_id)
            return
        try:
            await self.engine.remove_lora(lora_int_id)
        except EngineDeadError:
            pass  # nothing left to free
        except Exception:  # noqa: BLE001 - the name is gone either way; the engine's cache evicts it in time
            logger.warning("the engine did not remove LoRA adapter %d", lora_int_id, exc_info=True)

    # ---- requests in flight ------------------------------------------------------------------
    def hold(self, request_id: str, lora: LoRARequest) -> None:
        """``request_id`` was queued to run through ``lora``: the engine keeps the adapter until ``release``."""
        self._holds[request_id] = lora.lora_int_id

    def release(self, request_id: str) -> None:
        """The request has ended (any way: finished, failed, aborted); idempotent. Its abort, if any, is queued
        before the removal, so the engine has let go of the request when it gets to it."""
        lora_int_id = self._holds.pop(request_id, None)
        if lora_int_id in self._draining and lora_int_id not in self._holds.values():
            self._draining.discard(lora_int_id)
            task = asyncio.ensure_future(self._forget(lora_int_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1, description="a PEFT adapter folder on the server's disk")
    load_inplace: bool = Field(False, description="replace the adapter of that name (new requests get the new one)")


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str | None = Field(None, min_length=1)
    lora_int_id: int | None = None


def lora_router(registry: LoRARegistry, runtime_updating: bool) -> APIRouter:
    """The adapter routes: working with ``--enable-lora`` and runtime updating allowed, else a 404 saying what
    turns them on (and out of the API docs)."""
    if not (registry.enabled and runtime_updating):
        needs = [flag for flag, off in (("--enable-lora", not registry.enabled),
                                        (f"{RUNTIME_UPDATING_ENV[0]}=true (or {RUNTIME_UPDATING_ENV[1]})",
                                         not runtime_updating)) if off]
        router = APIRouter()

        async def disabled() -> None:
            raise APIError(404, f"loading and unloading LoRA adapters at run time is off on this server (it needs "
                                f"{' and '.join(needs)} where the server starts)", code="not_found")

        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            router.add_api_route(path, disabled, methods=["POST"], include_in_schema=False)
        return router

    router = APIRouter(route_class=OffloadedBodyRoute)  # bodies parsed off the event loop

    @router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
        await registry.load(req.lora_name, req.lora_path, replace=req.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
        if req.lora_name is None and req.lora_int_id is None:
            raise APIError(400, "give lora_name or lora_int_id", "lora_name")
        lora = await registry.unload(req.lora_name, req.lora_int_id)
        return PlainTextResponse(f"Success: LoRA adapter '{lora.lora_name}' removed successfully.")

    return router
