"""Prefix-cache block events as vLLM's ``--kv-events-config`` publishes them, received by a ZeroMQ SUB socket (or the
replay socket) and decoded with plain msgpack against vLLM's field order: a prompt's blocks stored with their tokens
and chained parents, evictions removed by exactly the evicted hashes, a LoRA request's blocks carrying its adapter,
missed batches replayed, a full queue dropping and counting, the data-parallel port offset, and nothing bound or
imported with events off."""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
import torch
import zmq

from conftest import make_checkpoint
from minfer import EngineArgs, LoRARequest, SamplingParams
from minfer.config import EngineConfig
from minfer.engine.block_manager import BlockManager
from minfer.engine.engine_stats import engine_stats
from minfer.engine.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventRecorder,
                                     ZmqEventPublisher, encode_batch, start_kv_events)
from minfer.engine.llm_engine import LLMEngine
from minfer.kv_events_config import KVEventsConfig, offset_endpoint
from minfer.lora import PROJECTIONS

BS = 4
U64 = (1 << 64) - 1
# vLLM's msgspec structs (vllm/distributed/kv_events.py), fields in declaration order; each event is a tagged array
# of them (array_like, tag=True), trailing fields at their default left off (omit_defaults).
VLLM_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys", "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
VLLM_BATCH = ("ts", "events", "data_parallel_rank")


def _event(raw: list) -> dict:
    """One decoded event as vLLM's names: ``{"type": tag, field: value, ...}``."""
    assert isinstance(raw, list) and raw[0] in VLLM_FIELDS, raw
    names = VLLM_FIELDS[raw[0]]
    assert len(raw) - 1 <= len(names), raw
    return {"type": raw[0], **dict(zip(names, raw[1:]))}


def _batch(payload: bytes) -> dict:
    raw = msgpack.unpackb(payload)
    assert isinstance(raw, list) and len(raw) == 3, raw  # the rank is always set: 0 without data parallelism
    batch = dict(zip(VLLM_BATCH, raw))
    assert isinstance(batch["ts"], float) and abs(batch["ts"] - time.time()) < 600
    return {**batch, "events": [_event(e) for e in batch["events"]]}


def _free_port(consecutive: int = 1) -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + consecutive < 65536 and all(_port_free(port + i) for i in range(consecutive)):
            return port
    raise AssertionError("no free ports")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class Subscriber:
    """A SUB socket on an engine's publisher. A subscription reaches the PUB socket a moment after ``connect``, and
    PUB drops what it sends before: so the engine's (empty) prefix cache is reset, which publishes an
    ``AllBlocksCleared`` at once, until one arrives."""

    def __init__(self, engine: LLMEngine, port: int) -> None:
        self.engine = engine
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        for _ in range(100):
            assert engine.reset_prefix_cache()
            if self.sock.poll(100):
                break
        else:
            raise AssertionError("no batch reached the subscriber")
        self.until_cleared(reset=False)

    def until_cleared(self, reset: bool = True) -> list[dict]:
        """Reset the prefix cache and return the events of every batch before the ``AllBlocksCleared`` that
        follows (PUB keeps a publisher's order), checking that sequence numbers count up by one."""
        if reset:
            assert self.engine.reset_prefix_cache()
        events, last = [], None
        while True:
            assert self.sock.poll(10_000), "no batch within 10 s"
            topic, seq, payload = self.sock.recv_multipart()
            seq = int.from_bytes(seq, "big")
            assert last is None or seq == last + 1
            last = seq
            batch = _batch(payload)
            if any(e["type"] == "AllBlocksCleared" for e in batch["events"]):
                assert batch["events"][-1]["type"] == "AllBlocksCleared"
                return events + batch["events"][:-1]
            events += batch["events"]

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("kv_events") / "llama3", "llama3")


def _engine(model: Path, kv: dict | None, **settings) -> LLMEngine:
    settings = dict(block_size=BS, num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=64) | settings
    return LLMEngine(EngineConfig(model=str(model), kv_events_config=kv, **settings))


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, lora: LoRARequest | None = None) -> list:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), lora_request=lora)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    return [o.outputs[0].token_ids for o in outputs.values()]


def _stored(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "BlockStored"]


def test_a_prompts_blocks_are_stored_with_their_tokens_and_chained_parents(model: Path) -> None:
    port = _free_port()
    engine = _engine(model, {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}", "topic": "kv@pod@m"})
    sub = Subscriber(engine, port)
    try:
        prompt = list(range(10, 23))  # 13 tokens: 3 full blocks, the 4th fills while decoding
        engine.add_request("held", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=6, temperature=0))
        engine.step()
        assert not engine.reset_prefix_cache()  # refused while a request holds blocks
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update((o.request_id, o) for o in engine.step())
        tokens = prompt + list(outputs["held"].outputs[0].token_ids)
        cached = {h & U64 for h in engine.block_manager.cached[0]}
        stored = _stored(sub.until_cleared())
        assert len(stored) >= 2  # the prompt's run, then the block its decoding filled, in a later step
        for e in stored:
            assert e["block_size"] == BS and len(e["token_ids"]) == BS * len(e["block_hashes"])
            assert e["lora_id"] is None and e["lora_name"] is None and e["medium"] == "GPU"
            assert "extra_keys" not in e and "group_idx" not in e  # defaults, left off
        hashes = [h for e in stored for h in e["block_hashes"]]
        assert [t for e in stored for t in e["token_ids"]] == tokens[:BS * len(hashes)]
        assert len(hashes) == (len(tokens) - 1) // BS == 4  # the last token is not computed yet
        assert stored[0]["parent_block_hash"] is None  # a prompt's first block
        for prev, e in zip(stored, stored[1:]):
            assert e["parent_block_hash"] == prev["block_hashes"][-1]  # chained
        assert set(hashes) == cached  # the prefix cache's own keys
        assert all(0 <= h <= U64 for h in hashes)
        # After the reset nothing is cached: the same prompt hits nothing and is stored again.
        hits = engine.block_manager.hit_tokens
        _run(engine, [prompt], 1)
        assert engine.block_manager.hit_tokens == hits
        assert _stored(sub.until_cleared())[0]["token_ids"] == prompt[:12]
    finally:
        sub.close()
        engine.shutdown()


def test_eviction_publishes_exactly_the_evicted_hashes(model: Path) -> None:
    port = _free_port()
    engine = _engine(model, {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}, num_kv_blocks=10)
    sub = Subscriber(engine, port)
    try:
        for start in (100, 140, 180, 220):  # 17-token prompts: each needs 5-6 of the 10 blocks
            _run(engine, [list(range(start, start + 17))], 3)
        cached = {h & U64 for h in engine.block_manager.cached[0]}
        events = sub.until_cleared()
        stored = [h for e in _stored(events) for h in e["block_hashes"]]
        removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert all(e["medium"] == "GPU" for e in events if e["type"] == "BlockRemoved")
        assert removed and len(removed) == len(set(removed))
        assert set(removed) == set(stored) - cached  # every evicted block, and only those
        order = {h: i for i, e in enumerate(events) for h in e["block_hashes"] if e["type"] == "BlockStored"}
        for i, e in enumerate(events):  # a hash is removed only after it was stored
            if e["type"] == "BlockRemoved":
                assert all(order[h] < i for h in e["block_hashes"])
    finally:
        sub.close()
        engine.shutdown()


@pytest.fixture(scope="module")
def adapter(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rank-4 adapter on every projection, written by peft on the test model (as tests/lora writes them)."""
    import peft
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(PROJECTIONS), init_lora_weights=False)
    out = tmp_path_factory.mktemp("kv_events_lora") / "ad"
    peft.get_peft_model(base, config).save_pretrained(str(out))
    return out


def test_a_lora_requests_blocks_carry_its_adapter(model: Path, adapter: Path) -> None:
    port = _free_port()
    engine = _engine(model, {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}, enable_lora=True,
                     max_loras=1, max_lora_rank=8, max_num_batched_tokens=8)
    sub = Subscriber(engine, port)
    try:
        lora, prompt = LoRARequest("ad", 7, str(adapter)), list(range(30, 43))
        _run(engine, [prompt], 1)
        base = _stored(sub.until_cleared())
        # Two samples through the adapter; the prompt comes in two chunks, so after one step sample 0 runs and the
        # other waits to fork from it: vLLM counts it (and its adapter) as a waiting request.
        engine.add_request("n2", {"prompt_token_ids": prompt}, SamplingParams(n=2, max_tokens=1, temperature=0),
                           lora_request=lora)
        engine.step()
        stats = engine_stats(engine)
        assert stats["num_waiting"] == 0 and stats["num_requests_waiting"] == 1 and stats["num_running"] == 1
        assert stats["lora_requests_info"]["waiting_lora_adapters"] == ["ad"]
        while engine.has_unfinished_requests():
            engine.step()
        adapted = _stored(sub.until_cleared())
        assert [e["token_ids"] for e in base] == [prompt[:8], prompt[8:12]]  # chunked by the 8-token budget
        assert [t for e in adapted for t in e["token_ids"]] == prompt[:12]
        assert all(e["lora_id"] is None and e["lora_name"] is None for e in base)
        assert all(e["lora_id"] == 7 and e["lora_name"] == "ad" for e in adapted)
        assert adapted[0]["parent_block_hash"] is None  # the adapter salts the first block, it is no parent
        assert not {h for e in base for h in e["block_hashes"]} & {h for e in adapted for h in e["block_hashes"]}
    finally:
        sub.close()
        engine.shutdown()


def _replay(port: int, start: int) -> list[tuple[int, bytes]]:
    """Ask the replay socket for the batches from ``start`` on, as a REQ-style envelope from a DEALER socket (REQ
    itself takes one reply per request); returns them up to the end marker."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(10_000), "no replay within 10 s"
            empty, seq, payload = sock.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert empty == b"" and payload == b""
                return out
            out.append((seq, payload))
    finally:
        sock.close(0)
        ctx.term()


def test_the_replay_socket_returns_missed_batches(model: Path) -> None:
    port, replay = _free_port(), _free_port()
    engine = _engine(model, {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}",
                             "replay_endpoint": f"tcp://*:{replay}", "buffer_steps": 100})
    try:
        prompts = [list(range(50, 63)), list(range(70, 79))]
        for prompt in prompts:  # one batch each; nobody subscribes: every batch is missed
            _run(engine, [prompt], 2)
        assert engine.kv_events.publisher.flush()
        batches = _replay(replay, 0)
        assert [seq for seq, _ in batches] == list(range(len(batches))) and len(batches) >= 2
        stored = _stored([e for _, payload in batches for e in _batch(payload)["events"]])
        assert sorted(e["token_ids"] for e in stored if e["parent_block_hash"] is None) == \
            sorted([prompts[0][:12], prompts[1][:8]])
        assert _replay(replay, 1) == batches[1:]  # from a given number on
        assert _replay(replay, len(batches)) == []
    finally:
        engine.shutdown()


def test_the_payload_is_vllms_layout() -> None:
    """The encoder against vLLM's structs written out: tagged arrays with trailing defaults left off, the batch as
    ``[ts, events, rank]``; with encoding "map", tagged maps (vLLM since its PR #42892)."""
    stored = BlockStored([1, U64], None, list(range(8)), 4, 3, "GPU", "ad")
    batch = KVEventBatch(12.5, [stored, BlockRemoved([5]), AllBlocksCleared()], 0)
    assert msgpack.unpackb(encode_batch(batch, msgpack.packb)) == [
        12.5, [["BlockStored", [1, U64], None, list(range(8)), 4, 3, "GPU", "ad"], ["BlockRemoved", [5], "GPU"],
               ["AllBlocksCleared"]], 0]
    grouped = KVEventBatch(1.0, [BlockStored([2], 1, [0] * 4, 4, None, "GPU", None, 1), BlockRemoved([2], "GPU", 1)])
    assert msgpack.unpackb(encode_batch(grouped, msgpack.packb)) == [
        1.0, [["BlockStored", [2], 1, [0] * 4, 4, None, "GPU", None, None, 1], ["BlockRemoved", [2], "GPU", 1]]]
    assert msgpack.unpackb(encode_batch(batch, msgpack.packb, as_map=True))[1] == [
        {"type": "BlockStored", "block_hashes": [1, U64], "parent_block_hash": None, "token_ids": list(range(8)),
         "block_size": 4, "lora_id": 3, "medium": "GPU", "lora_name": "ad"},
        {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}, {"type": "AllBlocksCleared"}]
    assert msgpack.unpackb(encode_batch(grouped, msgpack.packb, as_map=True))[1][1] == {
        "type": "BlockRemoved", "block_hashes": [2], "medium": "GPU", "group_idx": 1}
    # The recorder: Python's signed hashes as their unsigned 64-bit pattern, runs of one sequence merged.
    seq = SimpleNamespace(lora_id=0, lora_request=None)
    recorder = KVEventRecorder(4)
    recorder.stored(0, -1, None, (1, 2, 3, 4), seq)
    recorder.stored(0, 9, -1, (5, 6, 7, 8), seq)
    recorder.removed(0, -2)
    recorder.removed(0, 3)
    assert recorder.take() == [BlockStored([U64, 9], None, [1, 2, 3, 4, 5, 6, 7, 8], 4), BlockRemoved([U64 - 1, 3])]


def test_a_full_queue_drops_and_counts_without_blocking() -> None:
    port, replay = _free_port(), _free_port()
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                            replay_endpoint=f"tcp://*:{replay}", max_queue_size=1)
    publisher = ZmqEventPublisher(config)
    entered, release = threading.Event(), threading.Event()
    packb = publisher._packb

    def held_packb(obj):  # the publishing thread stalls inside the first batch's encoding
        entered.set()
        assert release.wait(30)
        return packb(obj)

    publisher._packb = held_packb
    try:
        batches = [KVEventBatch(float(i), [BlockRemoved([i])], 0) for i in range(4)]
        publisher.publish(batches[0])
        assert entered.wait(10)
        publisher.publish(batches[1])  # waits in the queue (size 1)
        publisher.publish(batches[2])  # dropped: the step loop does not wait
        publisher.publish(batches[3])
        assert publisher.dropped == 2
        release.set()
        assert publisher.flush()
        replayed = [(seq, msgpack.unpackb(p)[1][0][1]) for seq, p in _replay(replay, 0)]
        assert replayed == [(0, [0]), (1, [1])]
    finally:
        release.set()
        publisher.shutdown()
    for p in (port, replay):  # closed: the ports are free again
        assert _port_free(p)


def test_a_data_parallel_replica_publishes_on_the_port_plus_its_rank() -> None:
    port = _free_port(consecutive=3)
    kv = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}")
    manager = BlockManager(8, BS)
    events = start_kv_events(SimpleNamespace(kv_events_config=kv, data_parallel_rank=2), manager)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port + 2}")
    try:
        assert events.publisher.endpoint == f"tcp://*:{port + 2}" and _port_free(port)
        for _ in range(100):
            assert manager.reset_prefix_cache()
            events.end_step()
            if sub.poll(100):
                break
        batch = _batch(sub.recv_multipart()[2])
        assert batch["data_parallel_rank"] == 2 and batch["events"] == [{"type": "AllBlocksCleared"}]
    finally:
        sub.close(0)
        ctx.term()
        events.shutdown()
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://10.0.0.1:5557", 3) == "tcp://10.0.0.1:5560"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint("inproc://kv", 2) == "inproc://kv_dp2"


def test_events_off_bind_and_record_nothing(model: Path) -> None:
    port = _free_port()
    for kv in (None, {"enable_kv_cache_events": False, "endpoint": f"tcp://*:{port}"},
               {"enable_kv_cache_events": True, "publisher": "null", "endpoint": f"tcp://*:{port}"}):
        engine = _engine(model, kv)
        try:
            assert engine.kv_events is None and engine.block_manager.kv_events is None
            _run(engine, [list(range(5, 14))], 2)
            assert _port_free(port)
        finally:
            engine.shutdown()


def test_events_off_import_neither_pyzmq_nor_msgpack(model: Path) -> None:
    code = ("import sys\n"
            "from minfer.config import EngineConfig\n"
            "from minfer.engine.llm_engine import LLMEngine\n"
            "from minfer import SamplingParams\n"
            "e = LLMEngine(EngineConfig(model=sys.argv[1], num_kv_blocks=16, kv_events_config='{}'))\n"
            "e.add_request('a', {'prompt_token_ids': [5, 6, 7, 8, 9]}, SamplingParams(max_tokens=2))\n"
            "while e.has_unfinished_requests():\n"
            "    e.step()\n"
            "print(sorted({'zmq', 'msgpack'} & set(sys.modules)))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_events_on_without_the_extra_is_an_error_naming_it(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)  # `import zmq` now fails
    port = _free_port()
    with pytest.raises(ImportError, match=r"kv-events.*pip install -e \"\.\[kv-events\]\""):
        _engine(model, {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"})
    assert _port_free(port)


def test_the_config_is_vllms_json_checked_by_field(model: Path) -> None:
    parsed = EngineConfig(model=str(model), kv_events_config='{"enable_kv_cache_events": true, "topic": "kv"}')
    assert parsed.kv_events_config == KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", topic="kv")
    assert KVEventsConfig.parse({}).publisher == "null" and not KVEventsConfig.parse({}).publishing
    for bad, named in (({"enable_kv_cache_events": True, "endpont": "tcp://*:1"}, r"unknown field.*'endpont'"),
                       ({"publisher": "kafka"}, "kv_events_config.publisher"),
                       ({"endpoint": "http://x:1"}, "kv_events_config.endpoint"),
                       ({"endpoint": "tcp://*"}, "kv_events_config.endpoint"),
                       ({"hwm": 0}, "kv_events_config.hwm"),
                       ({"encoding": "json"}, "kv_events_config.encoding"),
                       ({"enable_kv_cache_events": "yes"}, "kv_events_config.enable_kv_cache_events"),
                       ("{not json", "not valid JSON"), ([1], "must be a dict")):
        with pytest.raises(ValueError, match=named):
            EngineConfig(model=str(model), kv_events_config=bad if isinstance(bad, (str, list)) else json.dumps(bad))
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6001", '
                                                    '"replay_endpoint": "tcp://*:6002", "buffer_steps": 5}'])
    config = EngineArgs.from_cli_args(args).kv_events_config
    assert (config.endpoint, config.replay_endpoint, config.buffer_steps) == ("tcp://*:6001", "tcp://*:6002", 5)
