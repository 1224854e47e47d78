"""``LLM(model, data_parallel_size=2)``: two replica processes, the prompts spread over them, the outputs in input
order and equal to one engine's; ``shutdown()`` leaves no replica; and the two fields' checks."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from conftest import make_checkpoint
from minfer import LLM, SamplingParams, StructuredOutputsParams
from minfer.config import EngineConfig
from minfer.engine.dp.launcher import replica_gpus
from minfer.engine.request_stream import EngineDeadError

ENGINE = dict(num_kv_blocks=128, max_num_seqs=16, max_num_batched_tokens=512)
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "The quick brown fox", "class Stack:",
           {"prompt_token_ids": list(range(2, 40))}, "for i in range(10):", "Hello, world!", "def push(self, x):"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("dp-llm") / "llama3", "llama3")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in "ZX"


def test_dp2_generate_equals_one_engine_in_input_order_and_shutdown_stops_the_replicas(model: Path) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    params = [greedy] * 6 + [SamplingParams(temperature=0, max_tokens=6, n=2),
                             SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes",
                                                                                                               "no"]))]
    with LLM(str(model), **ENGINE) as one:
        ref = one.generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(str(model), data_parallel_size=2, **ENGINE)
    engine = llm.llm_engine
    pids = list(engine.pids)
    assert len(set(pids)) == 2 and all(_alive(pid) for pid in pids) and os.getpid() not in pids
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [o.prompt_token_ids for o in ref]  # input order
    for ours, theirs in zip(outs[:7], ref[:7]):
        assert [c.token_ids for c in ours.outputs] == [c.token_ids for c in theirs.outputs]
        assert [c.text for c in ours.outputs] == [c.text for c in theirs.outputs]
    for ours, theirs in zip(outs[0].outputs[0].logprobs, ref[0].outputs[0].logprobs):  # the same odds
        assert ours.keys() == theirs.keys() and all(abs(ours[t] - theirs[t]) < 1e-4 for t in ours)
    assert outs[7].outputs[0].text in ("yes", "no")  # sampled, constrained
    stats = llm.get_stats()
    assert stats["data_parallel_size"] == 2 and [r["engine"] for r in stats["replicas"]] == [0, 1]
    assert all(r["routed"] > 0 for r in stats["replicas"]), stats["replicas"]  # both replicas served prompts
    assert stats["num_kv_blocks"] == 2 * ENGINE["num_kv_blocks"]
    llm.shutdown()
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS[:1], greedy, use_tqdm=False)


def test_a_replica_killed_mid_generate_fails_the_call_naming_it_and_the_other_serves_on(model: Path) -> None:
    """Offline nobody waits for a lost request: the call fails at once with ``EngineDeadError`` naming the replica
    (``LLM.generate`` then aborts the rest); the live replica takes every later prompt; shutdown leaves nothing."""
    with LLM(str(model), data_parallel_size=2, **ENGINE) as llm:
        engine, pids = llm.llm_engine, list(llm.llm_engine.pids)
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        for k in range(2):  # one request on each replica, by load
            engine.add_request(f"r{k}", PROMPTS[k], long)
        assert sorted(route.replica for route in engine.routes.values()) == [0, 1]
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"data-parallel replica 0 died \(signal SIGKILL\)"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                engine.step()
        assert engine.failure == "data-parallel replica 0 died (signal SIGKILL)"
        engine.abort_request(list(engine.routes))
        outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4, 4]
        assert llm.get_stats()["replicas"][1]["routed"] == 4  # r1 and the three
    assert not any(_alive(pid) for pid in pids)


def test_the_fields_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1, got 0"):
        EngineConfig(model="m", data_parallel_size=0)
    with pytest.raises(ValueError, match=r"data_parallel_rank must be an integer in \[0, 1\], got 2"):
        EngineConfig(model="m", data_parallel_size=2, data_parallel_rank=2)
    config = EngineConfig(model="m", data_parallel_size=2, tensor_parallel_size=2)
    assert replica_gpus(config) is None  # on the CPU: processes, no GPU list
    monkeypatch.setattr(EngineConfig, "resolved_device", lambda self: torch.device("cuda"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7,")
    assert replica_gpus(config) == ["4,5", "6,7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    with pytest.raises(ValueError, match=r"data_parallel_size=2 x tensor_parallel_size=2 needs 4 GPUs; 3 are visible"):
        replica_gpus(config)
