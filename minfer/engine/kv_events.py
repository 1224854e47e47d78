"""Prefix-cache block events, published as vLLM's ``--kv-events-config`` publishes them, for a prefix-aware router.

A router that sends each request where its prompt's prefix is already cached (llm-d's KV-cache-aware scorer behind
the inference gateway) needs to know what every server caches. The ``BlockManager`` tells a ``KVEventRecorder``
when a full block enters its prefix cache (``BlockStored``), when cached blocks are evicted for reuse
(``BlockRemoved``) and when the whole cache is reset (``AllBlocksCleared``); at the end of each engine step the
step's events go out as one ``KVEventBatch``.

The wire format is vLLM's, so its consumers read ours unchanged:

- a ZeroMQ PUB socket sends multipart messages ``[topic, sequence number (8 bytes, big-endian), payload]``, the
  numbers counting up from 0 per publisher; a ROUTER socket (``replay_endpoint``) answers a request carrying an
  8-byte start number with every buffered ``[sequence, payload]`` from there, then ``[-1 (signed), b""]``;
- the payload is msgpack as msgspec encodes vLLM's structs: the batch ``[ts, events, data_parallel_rank]``, each
  event a tagged array ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name]``, ``["BlockRemoved", block_hashes, medium]``, ``["AllBlocksCleared"]`` (fields with defaults are
  left off the end when they hold them: ``extra_keys`` and ``group_idx``, set here only for a model with several KV
  groups), or with ``encoding: "map"`` each event a map of those names with its tag under ``"type"``.

Block hashes: a block's hash is the int the prefix cache keys it by, Python's ``hash`` of (the previous block's
hash, the block's token ids), chained from the first block, whose "previous" is its LoRA adapter (none for the base
model); sent as its unsigned 64-bit pattern. As vLLM's documentation says of its own, a router must treat hashes
as opaque identifiers: equal prefixes hash alike within one server process, not across servers or restarts (and a
collision is possible: the cache itself checks the tokens). ``parent_block_hash`` links a stored run to the block
before it (None for a prompt's first block); ``token_ids`` are the run's tokens, ``block_size`` per block, so a
router that hashes tokens its own way (llm-d does) can rebuild its keys. ``medium`` is always "GPU", vLLM's name
for the engine's own KV cache (minfer has no offload tiers), whatever device holds it.

Publishing never blocks the step loop: a step hands its batch to a bounded queue, and a background thread encodes
and sends it; a batch that finds the queue full is dropped and counted (``ZmqEventPublisher.dropped``), as a
subscriber that falls behind the PUB socket's high-water mark loses messages. pyzmq and msgpack (the ``kv-events``
extra) are imported only when events are on.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from minfer.kv_events_config import KVEventsConfig, offset_endpoint

if TYPE_CHECKING:
    from minfer.config import EngineConfig
    from minfer.engine.sequence import Sequence

logger = logging.getLogger("minfer")

MEDIUM = "GPU"  # vLLM's MEDIUM_GPU: the engine's own KV cache
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_U64 = (1 << 64) - 1
_REQUIRED = object()  # a field msgspec always writes (no default)
_INSTALL = 'in the minfer checkout, run pip install -e ".[kv-events]"'


@dataclass(slots=True)
class BlockStored:
    """A run of consecutive full blocks of one sequence that entered the prefix cache."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks evicted (their block reused for other tokens): no longer a prefix hit."""

    block_hashes: list[int]
    medium: str | None = MEDIUM
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: nothing cached any more."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    """One step's events, in the order they happened."""

    ts: float
    events: list[KVCacheEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


# vLLM's fields of each event in its declaration order, with the default msgspec's omit_defaults leaves out.
_LAYOUT: dict[type, tuple[tuple[str, Any], ...]] = {
    BlockStored: (("block_hashes", _REQUIRED), ("parent_block_hash", _REQUIRED), ("token_ids", _REQUIRED),
                  ("block_size", _REQUIRED), ("lora_id", _REQUIRED), ("medium", _REQUIRED), ("lora_name", _REQUIRED),
                  ("extra_keys", None), ("group_idx", None)),
    BlockRemoved: (("block_hashes", _REQUIRED), ("medium", _REQUIRED), ("group_idx", None)),
    AllBlocksCleared: (),
}


def event_fields(event: KVCacheEvent, as_map: bool) -> list[Any] | dict[str, Any]:
    """An event as msgspec writes a tagged struct with ``omit_defaults``: an array starts with the class name and
    drops only trailing fields at their default; a map has the name under "type" and drops every such field."""
    layout = _LAYOUT[type(event)]
    values = [(name, getattr(event, name, None), default) for name, default in layout]
    if as_map:
        return {"type": type(event).__name__, **{n: v for n, v, d in values if d is _REQUIRED or v != d}}
    while values and values[-1][2] is not _REQUIRED and values[-1][1] == values[-1][2]:
        values.pop()
    return [type(event).__name__, *(v for _, v, _ in values)]


def encode_batch(batch: KVEventBatch, packb: Any, as_map: bool = False) -> bytes:
    """The payload of one message: ``[ts, events, data_parallel_rank]`` (the rank left off when None), packed by
    ``packb`` (``msgpack.packb``)."""
    body: list[Any] = [batch.ts, [event_fields(e, as_map) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        body.append(batch.data_parallel_rank)
    return packb(body)


class KVEventRecorder:
    """The ``BlockManager``'s event sink: collects a step's events, merging a sequence's consecutive stored blocks
    into one ``BlockStored`` (as vLLM sends one per newly cached run) and consecutive evictions into one
    ``BlockRemoved``. Runs on the engine thread only."""

    __slots__ = ("block_size", "grouped", "events")

    def __init__(self, block_size: int, num_groups: int = 1) -> None:
        self.block_size = block_size
        self.grouped = num_groups > 1  # group_idx is sent only when there are several KV groups
        self.events: list[KVCacheEvent] = []

    def stored(self, group: int, block_hash: int, parent: int | None, tokens: tuple[int, ...], seq: Sequence) -> None:
        h, p = block_hash & _U64, None if parent is None else parent & _U64
        lora_id = seq.lora_id or None
        g = group if self.grouped else None
        last = self.events[-1] if self.events else None
        if (type(last) is BlockStored and last.group_idx == g and last.lora_id == lora_id
                and last.block_hashes[-1] == p):
            last.block_hashes.append(h)
            last.token_ids.extend(tokens)
            return
        name = seq.lora_request.lora_name if lora_id else None
        self.events.append(BlockStored([h], p, list(tokens), self.block_size, lora_id, MEDIUM, name, g))

    def removed(self, group: int, block_hash: int) -> None:
        g = group if self.grouped else None
        last = self.events[-1] if self.events else None
        if type(last) is BlockRemoved and last.group_idx == g:
            last.block_hashes.append(block_hash & _U64)
        else:
            self.events.append(BlockRemoved([block_hash & _U64], MEDIUM, g))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events


def _import_extra() -> tuple[Any, Any]:
    try:
        import msgpack
        import zmq
    except ImportError as exc:
        raise ImportError(f"kv_events_config publishes through pyzmq and msgpack, the `kv-events` extra ({exc.name} "
                          f"is not installed): {_INSTALL}") from None
    return zmq, msgpack


class ZmqEventPublisher:
    """A PUB socket (and an optional replay ROUTER socket) served by one background thread, which encodes and sends
    each batch and keeps the last ``buffer_steps`` payloads for replay. The sockets are bound or connected here, so
    a taken port fails the engine's construction, naming the address."""

    POLL_S = 0.1  # how often the thread looks at the replay socket while no batch arrives

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        zmq, msgpack = _import_extra()
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = (offset_endpoint(config.replay_endpoint, data_parallel_rank)
                                if config.replay_endpoint else None)
        self.dropped = 0  # batches dropped because the queue was full
        self._topic = config.topic.encode()
        self._as_map = config.encoding == "map"
        self._packb = msgpack.packb
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 500)  # on shutdown, give queued messages half a second to leave
        self._replay = None
        self._closed = False
        address = self.endpoint
        try:
            _bind_or_connect(self._pub, address)
            if self.replay_endpoint is not None:
                address = self.replay_endpoint
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(address)
        except zmq.ZMQError as exc:
            self._close()
            raise ValueError(f"kv_events_config: cannot open {address}: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="minfer-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        """Queue a batch; never blocks (a full queue drops it, counted and logged)."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            if self.dropped & (self.dropped - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... drop
                logger.warning("kv events: %d step batch(es) dropped, the publishing queue is full (a router's view "
                               "of this server's prefix cache is now stale)", self.dropped)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every batch queued so far has been sent (and is in the replay buffer); False past ``timeout``."""
        with self._queue.all_tasks_done:
            return self._queue.all_tasks_done.wait_for(lambda: not self._queue.unfinished_tasks, timeout)

    def shutdown(self, timeout: float = 2.0) -> None:
        """Send what is queued, stop the thread, close the sockets (the ports are free afterwards)."""
        if not self._thread.is_alive():
            self._close()
            return
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        self._ctx.term()

    def _run(self) -> None:
        seq = 0
        poll = self.POLL_S if self._replay is not None else None
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # a malformed request must not end publishing
                    logger.exception("kv events: a replay request failed")
            try:
                batch = self._queue.get(timeout=poll)
            except queue.Empty:
                continue
            try:
                if batch is None:
                    return
                payload = encode_batch(batch, self._packb, self._as_map)
                self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
                self._buffer.append((seq, payload))
                seq += 1
            except Exception:  # one bad batch must not end publishing
                logger.exception("kv events: batch %d not sent", seq)
            finally:
                self._queue.task_done()

    def _serve_replay(self) -> None:
        """Answer one replay request: ``[identity, (b""), start]`` from a REQ or DEALER socket gets each buffered
        ``[sequence, payload]`` from ``start`` on, then the end marker, under the same envelope."""
        frames = self._replay.recv_multipart()
        envelope, start = frames[:-1], int.from_bytes(frames[-1], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart([*envelope, seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart([*envelope, END_OF_REPLAY, b""])


def _bind_or_connect(sock: Any, endpoint: str) -> None:
    """vLLM's rule: a wildcard address, ipc or inproc is bound (the server is the fixed end); any other address is
    connected to (a router that binds its SUB socket and lets the servers come and go)."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


class BlockManagerLike(Protocol):
    """What this module reads and sets of the engine's ``BlockManager`` (named by shape: that module imports this
    one for its hook's type)."""

    block_size: int
    windows: tuple[int, ...]
    enable_prefix_caching: bool
    kv_events: KVEventRecorder | None


class KVEvents:
    """The engine's side: the recorder its ``BlockManager`` fills and the publisher each step's batch goes to."""

    def __init__(self, config: KVEventsConfig, block_manager: BlockManagerLike, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank
        self.publisher = ZmqEventPublisher(config, data_parallel_rank)
        self.recorder = KVEventRecorder(block_manager.block_size, len(block_manager.windows))
        block_manager.kv_events = self.recorder

    def end_step(self) -> None:
        """Publish the events since the last call as one batch (nothing when there were none)."""
        if self.recorder.events:
            self.publisher.publish(KVEventBatch(time.time(), self.recorder.take(), self.data_parallel_rank))

    def shutdown(self) -> None:
        self.end_step()
        self.publisher.shutdown()


def start_kv_events(config: EngineConfig, block_manager: BlockManagerLike) -> KVEvents | None:
    """The engine's publisher when ``kv_events_config`` turns publishing on, else None (then nothing is imported,
    bound or recorded). A data-parallel replica publishes on the endpoint's port plus its rank, as vLLM's do."""
    kv = config.kv_events_config
    if kv is None or not kv.publishing:
        return None
    if not block_manager.enable_prefix_caching:
        logger.warning("kv events: prefix caching is off, so no block will ever be stored; publishing nothing")
    return KVEvents(kv, block_manager, getattr(config, "data_parallel_rank", 0))
