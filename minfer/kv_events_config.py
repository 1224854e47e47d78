"""``KVEventsConfig``: vLLM's ``kv_events_config`` (``--kv-events-config '<json>'``), checked once, each error naming
its field.

With it on, the engine publishes its prefix cache's block events (a block stored, blocks removed, all cleared) on a
ZeroMQ PUB socket, so that a prefix-aware router (llm-d's KV-cache-aware scorer, the inference gateway's endpoint
picker) knows which server holds which prompt prefix. The keys, their meaning and defaults are vLLM's, so a JSON
written for a vLLM server works unchanged; ``encoding`` is minfer's own (see ``ENCODINGS``). The publisher itself
is ``minfer.engine.kv_events``; this leaf holds only the settings, so ``EngineConfig`` can check them without
importing the engine (or pyzmq).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minfer.spec_config import config_fields

PUBLISHERS = ("null", "zmq")
# How each event is laid out in msgpack. "array": vLLM's tagged positional arrays (msgspec's array_like structs),
# the layout every KV-event consumer decodes (llm-d-kv-cache, Dynamo, SGLang's router, AIBrix); "map": tagged maps
# ({"type": "BlockStored", "block_hashes": ...}), what vLLM publishes since its PR #42892 (mid 2026); the batch
# around the events stays a positional array in both.
ENCODINGS = ("array", "map")
_ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's fields: ``enable_kv_cache_events`` turns recording on; ``publisher`` "zmq" sends (the default when
    enabled) and "null" drops everything (then nothing is recorded at all); ``endpoint`` is the PUB socket's address
    (bound when it holds a wildcard ``*`` or is ipc/inproc, connected to otherwise: a router that binds a SUB
    socket); ``replay_endpoint`` a ROUTER socket (always bound) answering requests for missed batches from the last
    ``buffer_steps`` ones; ``hwm`` the PUB socket's high-water mark; ``max_queue_size`` how many step batches may
    wait for the publishing thread before new ones are dropped (and counted); ``topic`` the first frame of every
    message (llm-d's pod discovery reads ``kv@<pod>@<model>``)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: str = "array"

    @classmethod
    def parse(cls, value: "KVEventsConfig | dict[str, Any] | str | None") -> "KVEventsConfig | None":
        """From ``LLM(kv_events_config=...)`` (a dict or this class) or ``--kv-events-config '<json>'``; None stays
        None."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        return cls(**config_fields(value, "kv_events_config", cls))

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config.enable_kv_cache_events must be true or false, "
                             f"got {self.enable_kv_cache_events!r}")
        if self.publisher is None:  # vLLM's default: zmq when enabled
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        _check_choice("publisher", self.publisher, PUBLISHERS)
        _check_choice("encoding", self.encoding, ENCODINGS)
        _check_endpoint("endpoint", self.endpoint)
        if self.replay_endpoint is not None:
            _check_endpoint("replay_endpoint", self.replay_endpoint)
            if self.replay_endpoint == self.endpoint:
                raise ValueError("kv_events_config.replay_endpoint must differ from endpoint")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config.topic must be a string, got {self.topic!r}")

    @property
    def publishing(self) -> bool:
        """Whether events are recorded and sent: enabled, through the zmq publisher."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The address data-parallel replica ``rank`` uses, as vLLM offsets it: a tcp port plus the rank
    (``tcp://*:5557`` -> ``tcp://*:5559`` for rank 2), an ipc or inproc name with ``_dp<rank>`` appended."""
    if rank == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def _check_endpoint(name: str, endpoint: Any) -> None:
    if not isinstance(endpoint, str) or not endpoint.startswith(_ENDPOINT_SCHEMES):
        raise ValueError(f"kv_events_config.{name} must be a ZeroMQ address starting with one of "
                         f"{list(_ENDPOINT_SCHEMES)}, got {endpoint!r}")
    if endpoint.startswith("tcp://"):
        port = endpoint.rpartition(":")[2]
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"kv_events_config.{name} needs a tcp port in [1, 65535] (host:port), got {endpoint!r}")


def _check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"kv_events_config.{name} must be one of {list(allowed)}, got {value!r}")
