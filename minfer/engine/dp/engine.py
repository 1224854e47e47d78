"""DataParallelLLMEngine: ``LLMEngine``'s interface over ``data_parallel_size`` replica processes.

``LLM(data_parallel_size=N)`` drives it as it drives one engine (``add_processed_request``, ``step``,
``abort_request``, ``has_unfinished_requests``, the processor and tokenizer, LoRA calls, ``get_stats``,
``shutdown``), and under the server ``DataParallelEngine`` (``client.py``) wraps it as ``AsyncLLMEngine`` wraps an
``LLMEngine``. It holds no weights: the replicas load the model, each on its own GPUs; this process resolves (and so
downloads, once) the checkpoint, loads the tokenizer while they start, and builds its ``Processor`` from theirs (their
KV cache's size decides which requests fit: the smallest replica's), so every request check runs here, before a
request is sent.

Each request goes to the replica the ``Balancer`` picks; ``routes`` remembers which, and how many sequences, until
its last output or its failure comes back (``receive``: the bookkeeping the async wrapper shares). ``step`` waits for
the replicas' messages and returns their outputs: for ``LLM`` (``RequestOutputKind.FINAL_ONLY``) only finished
requests, whole. A replica that dies fails ``step`` with ``EngineDeadError`` naming it when requests of this caller
were on it; the others keep serving.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future, wait
from dataclasses import dataclass
from operator import methodcaller
from typing import Any

from minfer.config import EngineConfig
from minfer.engine.dp.balancer import Balancer, routing_from_env
from minfer.engine.dp.launcher import Replicas
from minfer.engine.dp.stats import merge_stats
from minfer.engine.llm_engine import _load_tokenizer
from minfer.engine.processor import EngineRequest, PromptType
from minfer.engine.request_stream import EngineDeadError
from minfer.lora.request import LoRARequest
from minfer.model.loader import resolve_model_path
from minfer.model.registry import load_model_config
from minfer.outputs import RequestOutput, RequestOutputKind
from minfer.sampling_params import SamplingParams

logger = logging.getLogger("minfer.dp")

POLL_S = 0.5  # ``step`` returns empty-handed after this long without a message


@dataclass(slots=True)
class Route:
    """Where a request runs: its replica, its sequences (``n``), whether it has produced a token yet, and its prompt
    (put back into the outputs that come without it: ``ReplicaLoop._strip_prompts``)."""

    replica: int
    n: int
    prompt: str | None
    prompt_token_ids: list[int]
    started: bool = False


@dataclass(slots=True)
class PoolerFacts:
    """What the server reads of a pooling engine's ``Pooler`` (its model's ``PoolerConfig``), without the model."""

    config: Any


class DataParallelLLMEngine:
    """See the module's docstring. ``output_kind``: ``FINAL_ONLY`` (``LLM``) or ``DELTA`` (the server's streams)."""

    def __init__(self, config: EngineConfig, output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> None:
        if output_kind not in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA):
            raise ValueError(f"a data-parallel engine streams deltas or finished outputs, not {output_kind}")
        if config.model is None:
            raise ValueError("model is required (a local folder or a Hugging Face hub id)")
        routing = routing_from_env()  # checked before any replica starts
        self.config, self.output_kind = config, output_kind
        self.model_dir = resolve_model_path(config.model, config.revision, config.download_dir, config.load_format)
        self.model_config = load_model_config(self.model_dir)
        self.replicas = Replicas(config, final_only=output_kind is RequestOutputKind.FINAL_ONLY)
        try:
            self.tokenizer = None if config.skip_tokenizer_init else _load_tokenizer(
                str(resolve_model_path(config.tokenizer)) if config.tokenizer else str(self.model_dir))
            infos = self.replicas.wait_ready()
        except BaseException:
            self.replicas.shutdown(grace_s=0.0)
            raise
        first = infos[0]
        self.processor = first["processor"]
        self.processor.tokenizer = self.tokenizer
        self.processor.num_kv_blocks = min(info["processor"].num_kv_blocks for info in infos)
        self.eos_token_ids: frozenset[int] = first["eos_token_ids"]
        self.max_model_len: int = first["max_model_len"]
        self.pooler = PoolerFacts(first["pooler_config"]) if first["pooler_config"] is not None else None
        self.pids: list[int] = [info["pid"] for info in infos]
        self.balancer = Balancer(config.data_parallel_size, config.block_size, config.max_num_seqs, routing=routing)
        self.routes: dict[str, Route] = {}
        self.step_errors: dict[str, Exception] = {}

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        self.add_processed_request(self.processor.process(request_id, prompt, params, arrival_time, lora_request))

    def add_processed_request(self, request: EngineRequest) -> int:
        """Send a checked request to the replica the balancer picks; returns its index."""
        if request.request_id in self.routes:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        n = request.params.n if isinstance(request.params, SamplingParams) else 1
        lora = request.lora_request
        for dead in list(self.replicas.failures):  # known dead, perhaps before its "exited" message is read
            if self.balancer.alive[dead]:
                self.balancer.remove(dead)
        self.balancer.kv_usage = [s.get("kv_cache_usage", 0.0) for s in self.replicas.stats]
        try:
            replica = self.balancer.route(request.prompt_token_ids, n, lora.lora_int_id if lora is not None else 0)
        except RuntimeError:
            raise EngineDeadError(f"the engine has stopped: {self.failure}") from None
        self.routes[request.request_id] = Route(replica, n, request.prompt, request.prompt_token_ids)
        self.replicas.send(replica, ("add", request))
        return replica

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop a request, or each of several (unknown or finished ids are ignored); its replica frees its blocks."""
        for one in [request_id] if isinstance(request_id, str) else list(request_id):
            route = self.routes.pop(one, None)
            if route is not None:
                self.balancer.finished(route.replica, route.n, route.started)
                self.replicas.send(route.replica, ("abort", one))

    def has_unfinished_requests(self) -> bool:
        return bool(self.routes)

    def get_num_unfinished_requests(self) -> int:
        return len(self.routes)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ---- messages from the replicas ------------------------------------------------------------
    def receive(self, replica: int, message: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """Update the routes and the balancer for one message of ``replica``; return what its reader acts on:
        ("out", outputs, new_tokens, now), ("fail", id, error, followed), ("fail_each", ids, error),
        ("aborted", id), ("exited", failure, ids of the requests lost with it); None for the rest."""
        kind = message[0]
        if kind == "out":
            _, outputs, new_tokens, now = message
            kept = [k for k, out in enumerate(outputs) if out.request_id in self.routes]  # not aborted meanwhile
            if len(kept) < len(outputs):
                outputs, new_tokens = [outputs[k] for k in kept], [new_tokens[k] for k in kept]
            for out in outputs:
                route = self.routes[out.request_id]
                if not out.prompt_token_ids:
                    out.prompt, out.prompt_token_ids = route.prompt, route.prompt_token_ids
                if not route.started:
                    route.started = True
                    self.balancer.started(replica, route.n)
                if out.finished:
                    del self.routes[out.request_id]
                    self.balancer.finished(replica, route.n, True)
            return ("out", outputs, new_tokens, now)
        if kind == "fail":
            if not message[3]:  # a followed failure ends with its output, which finishes the route
                self._drop(message[1])
            return message
        if kind == "fail_each":
            for request_id in message[1]:
                self._drop(request_id)
            return message
        if kind == "exited":
            if self.balancer.alive[replica]:
                self.balancer.remove(replica)
            lost = [request_id for request_id, route in self.routes.items() if route.replica == replica]
            for request_id in lost:
                del self.routes[request_id]
            return ("exited", message[1], lost)
        return message if kind == "aborted" else None

    def _drop(self, request_id: str) -> None:
        route = self.routes.pop(request_id, None)
        if route is not None:
            self.balancer.finished(route.replica, route.n, route.started)

    def step(self) -> list[RequestOutput]:
        """The outputs the replicas have sent (waiting up to ``POLL_S`` for the first); raises a request's failure,
        or ``EngineDeadError`` when a replica that held requests died."""
        outputs: list[RequestOutput] = []
        self.step_errors = {}
        item = self.replicas.get(timeout=POLL_S)
        while item is not None:
            event = self.receive(*item)
            if event is not None:
                kind = event[0]
                if kind == "out":
                    outputs += event[1]
                elif kind == "fail" and event[3]:
                    self.step_errors[event[1]] = event[2]
                elif kind in ("fail", "fail_each"):
                    raise event[2]
                elif kind == "exited" and event[2]:
                    raise EngineDeadError(f"the engine has stopped: {event[1]} (its log has the details)")
            item = self.replicas.get(timeout=0)
        return outputs

    # ---- LoRA adapters: on every replica ----------------------------------------------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.call(methodcaller("add_lora", lora_request))

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.call(methodcaller("remove_lora", lora_int_id))

    def list_loras(self) -> dict[int, LoRARequest]:
        return self.call(methodcaller("list_loras"))

    def call(self, fn: Any) -> Any:
        """``fn(engine)`` on every live replica, blocking until all have answered (``broadcast_result``)."""
        futures = self.replicas.call_all(fn)
        wait(futures)
        return broadcast_result(futures)

    # ---- state ---------------------------------------------------------------------------------
    @property
    def failure(self) -> str | None:
        """The dead replicas, named, with how each died; None while all serve."""
        return self.replicas.failure

    def get_stats(self) -> dict[str, Any]:
        """One engine's stats over the live replicas, and each replica's (``stats.merge_stats``); the balancer's rule
        and the requests its prefix affinity placed."""
        alive = [self.replicas.alive(i) for i in range(self.replicas.size)]
        stats = merge_stats(list(self.replicas.stats), alive, self.balancer.routed)
        stats["dp_routing"] = self.balancer.routing
        stats["dp_affinity_hits"] = self.balancer.affinity_hits
        return stats

    def shutdown(self) -> None:
        """Stop every replica (and their tensor-parallel workers). Idempotent."""
        self.replicas.shutdown()


def broadcast_result(futures: list[Future[Any]]) -> Any:
    """The answer of a call every replica ran: the first live replica's result; an error one raised (the same call
    fails alike everywhere: a bad adapter) is raised; a replica that died meanwhile is passed over unless all did."""
    errors = [f.exception() for f in futures]
    raised = next((e for e in errors if e is not None and not isinstance(e, EngineDeadError)), None)
    if raised is not None:
        raise raised
    for future, error in zip(futures, errors):
        if error is None:
            return future.result()
    raise errors[0]  # type: ignore[misc]
