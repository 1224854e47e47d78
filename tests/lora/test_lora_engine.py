"""Multi-LoRA serving end to end: greedy tokens and logprobs equal HF transformers running each adapter merged
into the base by peft, with the base model and two adapters of different ranks in one batch, under preemption,
one slot swapped between adapters, the prefix cache keyed by adapter, and the Triton kernels (interpreted)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import assert_greedy_match, hf_greedy, make_checkpoint
from minfer import LLM, LoRARequest, SamplingParams
from minfer.lora import PROJECTIONS, LoRAAdapterError

peft = pytest.importorskip("peft")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], list(range(20, 60)), [3] * 5 + [40, 41, 42]]
NEW = 10
GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory) -> tuple[Path, dict[str, tuple[Path, Path]]]:
    """A tiny Llama, and two adapters written by peft (ranks 4 and 8, every projection, non-zero B), each with
    the base it merges into (peft's merge_and_unload), HF's reference for it."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora_engine")
    base = make_checkpoint(root / "base", "llama3")
    adapters = {}
    for name, rank, alpha, seed in (("a4", 4, 8, 1), ("a8", 8, 4, 2)):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(PROJECTIONS), init_lora_weights=False)
        wrapped = peft.get_peft_model(model, config)
        with torch.no_grad():  # peft's random init is large for a 64-wide model: keep the adapter a nudge
            for pname, p in wrapped.named_parameters():
                if "lora_" in pname:
                    p.mul_(0.5)
        wrapped.save_pretrained(str(root / name))
        merged = root / f"{name}_merged"
        wrapped.merge_and_unload().save_pretrained(str(merged))
        for f in base.iterdir():
            if "token" in f.name:
                shutil.copy(f, merged / f.name)
        adapters[name] = (root / name, merged)
    return base, adapters


def _request(adapters, name: str, lora_id: int) -> LoRARequest:
    return LoRARequest(name, lora_id, str(adapters[name][0]))


def _check(prompts, outs, loras, base: Path, adapters) -> None:
    for prompt, out, lora in zip(prompts, outs, loras, strict=True):
        ref_dir = base if lora is None else adapters[lora.lora_name][1]
        ref, ref_logits = hf_greedy(ref_dir, prompt, NEW)
        assert_greedy_match(out.outputs[0].token_ids, ref, ref_logits)
        first = out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]]
        assert first == pytest.approx(float(torch.log_softmax(ref_logits[0], -1)[ref[0]]), abs=1e-3)


def _all_free(llm: LLM) -> bool:
    s = llm.get_stats()
    return s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["num_running"] == s["num_waiting"] == 0


@pytest.mark.parametrize("settings", [dict(num_kv_blocks=64), dict(num_kv_blocks=5), dict(num_kv_blocks=64,
                                                                                         max_loras=1)],
                         ids=["default", "preempt", "one-slot"])
def test_base_and_two_adapters_in_one_batch_equal_hf_peft(base_and_adapters, settings):
    """Each prompt through the base, adapter a4 and adapter a8 in one call: each equals HF on peft's merged
    weights. With 5 blocks sequences are preempted; with one slot the adapters take turns in it."""
    base, adapters = base_and_adapters
    kwargs = dict(enable_lora=True, max_loras=2, max_lora_rank=8) | settings
    llm = LLM(str(base), **kwargs)
    loras = [None] * 3 + [_request(adapters, "a4", 1)] * 3 + [_request(adapters, "a8", 2)] * 3
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS * 3], GREEDY, use_tqdm=False, lora_request=loras)
    _check(PROMPTS * 3, outs, loras, base, adapters)
    if settings["num_kv_blocks"] == 5:
        assert llm.get_stats()["num_preemptions"] > 0
    assert _all_free(llm)
    assert llm.list_loras() and llm.list_loras() <= {1, 2}  # max_cpu_loras defaults to max_loras


def test_the_prefix_cache_is_keyed_by_adapter(base_and_adapters):
    base, adapters = base_and_adapters
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8, num_kv_blocks=64, enable_prefix_caching=True,
              block_size=4)
    prompt = [{"prompt_token_ids": PROMPTS[1]}]
    llm.generate(prompt, GREEDY, use_tqdm=False)
    lora = _request(adapters, "a4", 1)
    outs = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)  # the base's blocks must not serve it
    _check(PROMPTS[1:2], outs, [lora], base, adapters)
    again = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)  # its own blocks do
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert llm.get_stats()["prefix_cache_hit_tokens"] > 0


def test_triton_kernels_in_the_engine(base_and_adapters):
    """The Triton shrink and expand (interpreted) give the torch reference path's tokens and logprobs; so does a
    prompt alone, whose one-token steps add its adapter inside the fused matrix-vector kernels."""
    base, adapters = base_and_adapters
    loras = [_request(adapters, "a8", 2), _request(adapters, "a4", 1)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[::2]]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1)
    outs = []
    for backend in ("auto", "triton"):
        llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=16,
                  attention_backend=backend)
        outs.append(llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
                    + llm.generate(prompts[:1], params, use_tqdm=False, lora_request=loras[0]))
    for ref, out in zip(*outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_bad_requests_and_adapters_fail_clearly_and_leave_nothing(base_and_adapters, tmp_path):
    base, adapters = base_and_adapters
    plain = LLM(str(base), num_kv_blocks=16)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=_request(adapters, "a4", 1))
    assert _all_free(plain)
    llm = LLM(str(base), enable_lora=True, max_lora_rank=4, num_kv_blocks=16)
    with pytest.raises(LoRAAdapterError, match="rank"):  # a8's rank 8 > max_lora_rank 4
        llm.generate([[5, 6]], GREEDY, use_tqdm=False, lora_request=_request(adapters, "a8", 2))
    with pytest.raises(LoRAAdapterError):
        llm.add_lora(LoRARequest("missing", 3, str(tmp_path / "nowhere")))
    assert llm.list_loras() == set() and _all_free(llm)
    with pytest.raises(ValueError, match="lora_requests"):
        llm.generate([[5, 6], [7]], GREEDY, use_tqdm=False, lora_request=[None])
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": [5, 6]}, GREEDY, lora_request=_request(adapters, "a4", 1))
    with pytest.raises(ValueError, match="in flight"):
        llm.remove_lora(1)
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.remove_lora(1) and llm.list_loras() == set()
    with pytest.raises(ValueError, match="max_lora_rank"):
        LLM(str(base), enable_lora=True, max_lora_rank=0)


def test_stats_name_the_adapters(base_and_adapters):
    base, adapters = base_and_adapters
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64)
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": [5, 6]}, GREEDY, lora_request=_request(adapters, "a4", 1))
    info = llm.get_stats()["lora_requests_info"]
    assert info == {"running_lora_adapters": [], "waiting_lora_adapters": ["a4"], "max_lora": 2}
    engine.step()
    assert llm.get_stats()["lora_requests_info"]["running_lora_adapters"] == ["a4"]
    while engine.has_unfinished_requests():
        engine.step()


def test_tensor_parallel_adapters_equal_one_rank(base_and_adapters):
    """tp = 2 (gloo processes): each rank holds its share of every adapter, the slot writes reach the worker
    (Command.LORA), and the tokens and logprobs are tp = 1's."""
    base, adapters = base_and_adapters
    loras = [None, _request(adapters, "a4", 1), _request(adapters, "a8", 2)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    runs = []
    for tp in (1, 2):
        llm = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=8, num_kv_blocks=64,
                  tensor_parallel_size=tp)
        try:
            runs.append(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
        finally:
            llm.shutdown()
    for one, two in zip(*runs):
        assert two.outputs[0].token_ids == one.outputs[0].token_ids
        for a, b in zip(two.outputs[0].logprobs, one.outputs[0].logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_adapters_with_fp8_weights_speculation_and_structured_outputs(base_and_adapters):
    """FP8 base weights (quantized as they load): with no adapter LoRA changes nothing (its projections take their
    input unquantized and quantize it themselves), an adapter still applies. n-gram speculation and a JSON schema
    over an adapter's output: greedy tokens equal HF's on the merged weights, the schema holds."""
    import json

    from minfer.structured_outputs import StructuredOutputsParams

    base, adapters = base_and_adapters
    lora = _request(adapters, "a4", 1)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    plain = LLM(str(base), quantization="fp8", num_kv_blocks=32).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(str(base), quantization="fp8", enable_lora=True, max_lora_rank=8, num_kv_blocks=32)
    none, adapted = (llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=r) for r in (None, lora))
    for p, n, a in zip(plain, none, adapted):
        assert n.outputs[0].token_ids == p.outputs[0].token_ids
        assert n.outputs[0].logprobs[0] == pytest.approx(p.outputs[0].logprobs[0], abs=1e-4)
        assert a.outputs[0].logprobs[0] != pytest.approx(p.outputs[0].logprobs[0], abs=1e-2)
    llm = LLM(str(base), enable_lora=True, max_lora_rank=8, num_kv_blocks=64, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2})
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False, lora_request=lora)
    _check(PROMPTS, outs, [lora] * 3, base, adapters)
    assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    out = llm.generate(["x"], SamplingParams(max_tokens=40, temperature=0,
                                             structured_outputs=StructuredOutputsParams(json=schema)),
                       use_tqdm=False, lora_request=lora)
    assert set(json.loads(out[0].outputs[0].text)) == {"a"}
    assert _all_free(llm)
