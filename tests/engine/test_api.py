"""The user-facing contract: engine step/abort, stop strings, chat, loading, and clear errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import hf_greedy, make_checkpoint
from minfer import LLM, SamplingParams
from minfer.cli import main as cli_main
from minfer.config import EngineConfig
from minfer.engine.llm_engine import LLMEngine


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), num_kv_blocks=kw.pop("num_kv_blocks", 32), **kw))


def test_engine_streams_partial_outputs_and_abort_frees_blocks(checkpoints):
    engine = _engine(checkpoints["llama3"])
    engine.add_request("a", "def fibonacci(n):", SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": list(range(2, 40))}, SamplingParams(max_tokens=40, ignore_eos=True))
    texts: list[str] = []
    for _ in range(5):
        for out in engine.step():
            if out.request_id == "a":
                assert not out.finished
                texts.append(out.outputs[0].text)
    assert len(texts) >= 3 and all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    assert engine.get_stats()["num_free_kv_blocks"] < engine.get_stats()["num_kv_blocks"]
    engine.abort_request("a")
    engine.abort_request("b")
    engine.abort_request("unknown")  # ignored
    assert not engine.has_unfinished_requests() and engine.step() == []
    stats = engine.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_running"] == 0
    # a waiting (never scheduled) request can be aborted too
    engine.add_request("c", "x", SamplingParams(max_tokens=3))
    engine.abort_request("c")
    assert engine.get_stats()["num_waiting"] == 0


def _run_to_end(engine: LLMEngine, request_id: str) -> list[int]:
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return out.outputs[0].token_ids
    raise AssertionError(f"{request_id} did not finish")


def test_abort_all_after_a_failed_step_leaves_a_working_engine(checkpoints):
    """A step that raises mid-way (here the sampler, after the forward was queued) leaves some sequences
    advanced and others not; ``abort_all`` gets back to an engine whose next requests decode exactly as on a
    fresh one, prefix cache included (the prompt's blocks cached before the failure are reused)."""
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 60))}
    fresh = _engine(checkpoints["llama3"])
    fresh.add_request("ref", prompt, greedy)
    expected = _run_to_end(fresh, "ref")

    engine = _engine(checkpoints["llama3"], max_num_batched_tokens=32, max_num_seqs=4)  # the prompt: two chunks
    engine.add_request("a", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("b", "def f(x):", greedy)
    for _ in range(4):
        engine.step()
    real_sampler = engine.runner.sampler

    def failing_sampler(*args, **kwargs):
        raise OverflowError("simulated: a value too large for int64")

    engine.runner.sampler = failing_sampler
    with pytest.raises(OverflowError):
        engine.step()
    engine.runner.sampler = real_sampler
    assert sorted(engine.abort_all()) == ["a", "b"]
    stats = engine.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_running"] == stats["num_waiting"] == 0
    assert not engine.has_unfinished_requests() and engine.step() == []
    engine.add_request("c", prompt, greedy)
    assert _run_to_end(engine, "c") == expected
    assert engine.get_stats()["prefix_cache_hit_tokens"] > 0


def test_stop_string_across_tokens_is_cut_from_text(checkpoints):
    llm = LLM(str(checkpoints["llama3"]), num_kv_blocks=32)
    tok = llm.get_tokenizer()
    prompt = [5, 6, 7, 8]
    ref, _ = hf_greedy(checkpoints["llama3"], prompt, 20)
    full = tok.decode(ref, skip_special_tokens=True)
    # a stop string that starts inside one token's text and ends inside a later one
    pieces = [tok.decode(ref[:i], skip_special_tokens=True) for i in range(1, 21)]
    i = next(i for i in range(3, 19) if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i - 1]) >= 2)
    start = len(pieces[i - 1]) - 1
    stop = full[start:start + 3]
    expected = full[:full.find(stop)]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=20, temperature=0, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == expected and out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=20, temperature=0, stop=stop,
                                                                     include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == expected + stop


def test_output_capped_at_max_model_len(checkpoints):
    llm = LLM(str(checkpoints["llama3"]), num_kv_blocks=32, max_model_len=24)
    out = llm.generate({"prompt_token_ids": list(range(2, 22))}, SamplingParams(max_tokens=50, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4 and out.finish_reason == "length"


def test_chat_uses_the_template(checkpoints):
    llm = LLM(str(checkpoints["llama3"]), num_kv_blocks=32)
    msgs = [{"role": "user", "content": "hello"}]
    out = llm.chat(msgs, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)[0]
    assert out.prompt == "<s>user: hello\nassistant:"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    template = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = llm.chat(msgs, SamplingParams(max_tokens=2), use_tqdm=False, chat_template=template, tools=tools)[0]
    assert out.prompt == "[get_weather]hello"


def test_sharded_half_precision_checkpoint_loads(tmp_path, checkpoints):
    src = checkpoints["qwen2"]
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for k, part in enumerate([names[:half], names[half:]]):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n].to(torch.bfloat16) for n in part}, str(dst / fname))
        weight_map |= {n: fname for n in part}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    llm = LLM(str(dst), num_kv_blocks=32, dtype="float32")
    ours = llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    model = llm.llm_engine.runner.model
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    expected_q = tensors["model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16).float()
    assert torch.equal(model.layers[0].self_attn.qkv_proj.weight[: expected_q.shape[0]], expected_q)
    assert len(ours) == 8


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(block_size=24), "block_size"),
    (dict(dtype="int4"), "dtype"),
    (dict(device="tpu"), "device"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(attention_backend="flash"), "attention_backend"),
    (dict(kv_cache_dtype="int3"), "kv_cache_dtype"),
    (dict(max_num_batched_tokens=4, max_num_seqs=8), "max_num_batched_tokens"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size"),
    (dict(num_kv_blocks=-1), "num_kv_blocks"),
    (dict(bogus_arg=1), "bogus_arg"),
])
def test_bad_engine_arguments_name_the_field(checkpoints, kwargs, field):
    with pytest.raises((ValueError, TypeError), match=field):
        LLM(str(checkpoints["llama3"]), **kwargs)


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=2.0), "min_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"), (dict(n=0), "n"), (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(seed=-1), "seed"), (dict(seed=2**63), "seed"), (dict(logprobs=-1), "logprobs"), (dict(stop=[""]), "stop"),
    (dict(stop=123), "stop"), (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(temperature="hot"), "temperature"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_fail_cleanly_and_queue_nothing(checkpoints):
    llm = LLM(str(checkpoints["llama3"]), num_kv_blocks=8, max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["ok", {"prompt_token_ids": list(range(2, 80))}], use_tqdm=False)
    with pytest.raises(ValueError, match=r"\[0, 320\)"):
        llm.generate({"prompt_token_ids": [5, 100000]}, use_tqdm=False)
    for field in ("logprobs", "prompt_logprobs"):  # top-k over a 320-token vocabulary
        with pytest.raises(ValueError, match=f"{field} must be at most the vocabulary size"):
            llm.generate("ok", SamplingParams(**{field: 321}), use_tqdm=False)
    for bad in (1.5, True, "7"):
        with pytest.raises(ValueError, match="integers"):
            llm.generate({"prompt_token_ids": [5, bad]}, use_tqdm=False)
    with pytest.raises(ValueError, match="KV blocks"):  # 58 tokens need 4 blocks of 16; the cache has 2
        LLM(str(checkpoints["llama3"]), num_kv_blocks=2).generate(
            {"prompt_token_ids": list(range(2, 40))}, SamplingParams(max_tokens=20), use_tqdm=False)
    stats = llm.get_stats()
    assert stats["num_waiting"] == 0 and stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    # the engine still works after the rejections
    assert len(llm.generate("def", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) >= 1


def test_unsupported_architecture_and_missing_paths(tmp_path, checkpoints):
    bad = tmp_path / "gpt2ish"
    shutil.copytree(checkpoints["llama3"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        LLM(str(bad))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="could not be downloaded|HF_HUB_OFFLINE"):
        LLM("some-org/some-model-that-is-not-cached")


def test_cli_generate(checkpoints, capsys):
    rc = cli_main(["generate", "--model", str(checkpoints["llama3"]), "--max-tokens", "6", "--num-kv-blocks", "16",
                   "def f():"])
    assert rc == 0
    assert capsys.readouterr().out.startswith("def f():")
    assert cli_main(["generate", "--model", str(checkpoints["llama3"]), "--block-size", "7", "x"]) == 2


def test_generation_config_eos_ids_stop_too(tmp_path, checkpoints):
    dst = tmp_path / "eos"
    shutil.copytree(checkpoints["llama3"], dst)
    prompt = [5, 6, 7, 8]
    ref, _ = hf_greedy(checkpoints["llama3"], prompt, 12)
    extra_eos = ref[4]
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, extra_eos]}))
    out = LLM(str(dst), num_kv_blocks=16).generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=12, temperature=0),
                                                   use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:ref.index(extra_eos) + 1] and out.finish_reason == "stop"
    ignored = LLM(str(dst), num_kv_blocks=16).generate({"prompt_token_ids": prompt},
                                                       SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                                       use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == ref


def test_kv_cache_sizing_from_bytes(checkpoints):
    llm = LLM(str(checkpoints["llama3"]), kv_cache_memory_bytes=1 << 20)
    runner = llm.llm_engine.runner
    # 2 layers x (K, V) x 16 tokens x 2 kv heads x 16 dims x 4 bytes = 8 KiB per block
    assert runner.block_bytes == 8192 and llm.get_stats()["num_kv_blocks"] == (1 << 20) // 8192
    assert LLM(str(checkpoints["llama3"]), num_kv_blocks=7, kv_cache_memory_bytes=1 << 20).get_stats()["num_kv_blocks"] == 7


def test_memory_profile_covers_the_whole_token_budget():
    """The start-up profile (GPU) runs a step as large as any real one: the budget split into
    sequences no longer than max_model_len, as a step of several prompt chunks carries it."""
    from minfer.engine.kv_sizing import profile_lengths

    assert profile_lengths(16384, 4096) == [4096] * 4
    assert profile_lengths(16384, 5000) == [5000, 5000, 5000, 1384]
    assert profile_lengths(100, 4096) == [100]
    assert sum(profile_lengths(12345, 678)) == 12345


def test_memory_profile_stages_as_far_as_a_step_may():
    """Where 8-bit prefill stages (``Ops.staging_tokens``: the larger of the token budget and max_model_len on the
    target), the profile's last chunk continues a prompt over what is left of that reach, so that the staged
    scratch of the rest of a long prompt is inside the profiled peak; a budget past max_model_len already reaches
    it, and without staging the chunks are whole prompts."""
    from minfer.engine.kv_sizing import profile_context_lens, profile_lengths

    assert profile_context_lens([16384], 131072, 131072) == [131072]
    assert profile_context_lens([16384], 0, 131072) == [16384]
    assert profile_context_lens([4096] * 4, 16384, 4096) == [4096] * 4
    lens = profile_lengths(16384, 5000)
    assert profile_context_lens(lens, 16384, 5000) == lens
    assert profile_context_lens([100], 4096, 4096) == [4096]


def test_memory_profile_step_keeps_its_cache_to_the_budget():
    """The profile's step continuing a prompt to a 128k max_model_len still fills (and allocates) only the budget's
    blocks: its table and slots wrap around them; without staging the step is the whole prompts it always was."""
    import numpy as np

    from minfer.engine.kv_sizing import profile_step

    a, blocks = profile_step(16384, 131072, 131072, 16, 2)
    assert blocks == 1024 and a.tables.shape == (2, 1, 8192) and a.tables.max() == blocks - 1
    assert a.ctx_lens.tolist() == [131072] and a.positions[0] == 131072 - 16384 and a.positions[-1] == 131071
    assert a.slots.shape == (2, 16384) and a.slots.max() < blocks * 16 and len(np.unique(a.slots[0])) == 16384
    a, blocks = profile_step(16384, 5000, 0, 16, 1)
    assert blocks == 313 * 4 and a.ctx_lens.tolist() == a.q_lens.tolist() == [5000, 5000, 5000, 1384]
    assert (a.tables[0].ravel() == np.arange(blocks)).all() and (a.slots[0] == a.positions).all()


def test_input_batch_rows_are_given_back(checkpoints):
    """Every sequence's runner row is freed once it finishes, also when the step that reports it launches
    nothing (the last steps of a batch): with two rows, leaked ones would soon leave no row to run in."""
    llm = LLM(str(checkpoints["llama3"]), num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=64)
    for round_ in range(6):
        params = [SamplingParams(max_tokens=1 + (round_ + i) % 4, ignore_eos=True) for i in range(3)]
        outs = llm.generate([{"prompt_token_ids": [5 + i, 6, 7]} for i in range(3)], params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    rows = llm.llm_engine.runner.input_batch.row_of
    assert len(rows) <= 2, rows  # only the last step's finished sequences, freed at the next step
