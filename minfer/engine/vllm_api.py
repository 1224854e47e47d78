"""The rest of vLLM's ``LLMEngine`` API, as a mixin of ``LLMEngine``.

``add_request(request_id, prompt, params, arrival_time=None, lora_request=None)``, ``step()`` and
``has_unfinished_requests()`` are the engine's own and already spelled as vLLM spells them; what a vLLM user also
calls lives here, apart from the step loop in ``llm_engine.py``: building the engine from ``EngineArgs``, aborting
one id or several at once, and the small getters.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

from minfer.config import EngineConfig

E = TypeVar("E", bound="VLLMEngineAPI")


class EngineArgsLike(Protocol):
    """What ``from_engine_args`` reads of its argument: ``minfer.EngineArgs`` (defined a layer above the engine, so
    named here by what it does)."""

    def create_engine_config(self) -> EngineConfig: ...


class VLLMEngineAPI:
    """vLLM's ``LLMEngine`` calls that minfer's engine does not define itself."""

    requests: dict[str, Any]
    tokenizer: Any
    block_manager: Any
    kv_events: Any  # engine/kv_events.py's KVEvents, or None
    _abort: Callable[[str], None]  # the engine's abort of one request

    @classmethod
    def from_engine_args(cls: type[E], engine_args: EngineArgsLike) -> E:
        """An engine of ``engine_args`` (``minfer.EngineArgs``) whose ``step`` returns whole outputs of every request
        that advanced (``RequestOutputKind.CUMULATIVE``, vLLM's default). One engine: replicas
        (``data_parallel_size`` > 1) run under ``LLM`` and ``minfer serve`` (``engine/dp/``)."""
        config = engine_args.create_engine_config()
        if config.data_parallel_size > 1:
            raise ValueError(f"data_parallel_size={config.data_parallel_size}: LLMEngine.from_engine_args builds one "
                             f"engine; replicas run under LLM(..., data_parallel_size=N) and minfer serve")
        return cls(config)  # type: ignore[call-arg]

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop a request, or each of several (vLLM takes either), now and free its blocks; unknown or finished ids
        are ignored."""
        for one in [request_id] if isinstance(request_id, str) else list(request_id):
            self._abort(one)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (after new weights, or to measure a cold cache); False, and nothing done,
        while requests hold blocks. With block events on, their ``AllBlocksCleared`` goes out at once."""
        done = self.block_manager.reset_prefix_cache()
        if done and self.kv_events is not None:
            self.kv_events.end_step()
        return done

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def get_tokenizer(self) -> Any:
        """The tokenizer (None with ``skip_tokenizer_init``)."""
        return self.tokenizer
