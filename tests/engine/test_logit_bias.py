"""logit_bias and allowed_token_ids: applied on the device before the draw, per row (a batch mixes rows with and
without them), through the sampler, the engine, and speculative verification; logprobs stay the raw model's;
bad token ids are refused naming the field."""
from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, make_checkpoint

from minfer import LLM, SamplingParams
from minfer.engine.input_batch import SamplingMetadata
from minfer.engine.sampler import Sampler
from minfer.ops import select_ops

CPU = torch.device("cpu")
PROMPT = [(i * 7) % 300 + 2 for i in range(20)]
NEW = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_checkpoint(tmp_path_factory.mktemp("bias") / "llama3", "llama3"))


@pytest.fixture(scope="module")
def llm(model: str) -> LLM:
    return LLM(model, num_kv_blocks=64)


def _sample(logits: torch.Tensor, params: list[SamplingParams], backend: str = "torch") -> tuple[list[int], list]:
    """``backend``: the argmax passes' ops; 'triton' runs the GPU's kernels in Triton's interpreter."""
    n = len(params)
    meta = SamplingMetadata.from_params(params, list(range(n)), [0] * n, CPU)
    out = Sampler(CPU, select_ops(backend, CPU, 16, 64))(logits, meta).result()
    return out.token_ids, out.logprobs


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_mixed_batch_biases_only_its_rows(backend):
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    before = logits.clone()
    top = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0, logit_bias={7: 100.0}, logprobs=2),  # forced
              SamplingParams(temperature=0, logprobs=2),  # untouched
              SamplingParams(temperature=0, logit_bias={top[2]: -100.0}),  # its best token banned
              SamplingParams(temperature=0, allowed_token_ids=[11, 12, 13]),
              SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[20, 21])]
    ids, logprobs = _sample(logits, params, backend)
    assert ids[0] == 7 and ids[1] == top[1]
    assert ids[2] == int(logits[2].topk(2).indices[1])
    assert ids[3] == 11 + int(logits[3, 11:14].argmax()) and ids[4] in (20, 21)
    assert torch.equal(logits, before)  # the caller's logits are not modified
    raw = logits.log_softmax(-1)
    assert logprobs[0][7] == pytest.approx(float(raw[0, 7]), abs=1e-5)  # the raw distribution's, before the bias
    assert set(logprobs[1]) == set(raw[1].topk(2).indices.tolist())


def test_random_rows_draw_only_allowed_tokens_in_their_proportions():
    """allowed_token_ids leaves the softmax over the allowed tokens; a bias of b multiplies a token's odds by e^b."""
    logits = torch.zeros(4000, 10)
    params = [SamplingParams(seed=i, allowed_token_ids=[1, 2], logit_bias={2: float(torch.log(torch.tensor(3.0)))})
              for i in range(4000)]
    ids, _ = _sample(logits, params)
    assert set(ids) == {1, 2}
    assert ids.count(2) / len(ids) == pytest.approx(0.75, abs=0.03)


def test_greedy_generation_is_forced_banned_and_restricted(llm: LLM, model: str):
    ref, ref_logits = hf_greedy(model, PROMPT, 1)
    second = int(ref_logits[0].topk(2).indices[1])
    allowed = [40, 41, 42]
    greedy = {"max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    params = [SamplingParams(**greedy, logit_bias={99: 100.0}),
              SamplingParams(**greedy),
              SamplingParams(**greedy, logit_bias={ref[0]: -100.0}),
              SamplingParams(**greedy, allowed_token_ids=allowed, logprobs=1)]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * 4, params, use_tqdm=False)
    forced, plain, banned, restricted = (o.outputs[0] for o in outs)
    assert forced.token_ids == [99] * NEW
    assert plain.token_ids == llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(**greedy),
                                           use_tqdm=False)[0].outputs[0].token_ids
    assert plain.token_ids[0] == ref[0] and banned.token_ids[0] == second
    assert set(restricted.token_ids) <= set(allowed)
    assert restricted.token_ids[0] == allowed[int(ref_logits[0][allowed].argmax())]
    raw = ref_logits[0].log_softmax(-1)  # logprobs of the raw model, not of the restricted distribution
    assert restricted.logprobs[0][restricted.token_ids[0]] == pytest.approx(float(raw[restricted.token_ids[0]]),
                                                                             abs=1e-4)


@pytest.mark.parametrize("kw,message", [
    ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {5: float("nan")}}, "logit_bias values must be finite"),
    ({"logit_bias": [5]}, "logit_bias must be a dict"),
    ({"allowed_token_ids": []}, "allowed_token_ids must be a non-empty list"),
    ({"allowed_token_ids": [3, -2]}, "allowed_token_ids must be a non-empty list"),
])
def test_bad_values_are_refused_at_construction(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw", [{"logit_bias": {5: 1.0, 320: 2.0}}, {"allowed_token_ids": [1, 10**6]}])
def test_ids_past_the_vocabulary_are_refused_before_anything_runs(llm: LLM, kw):
    name = next(iter(kw))
    with pytest.raises(ValueError, match=rf"^{name} has token id \d+, outside the vocabulary \[0, 320\)"):
        llm.generate([{"prompt_token_ids": PROMPT}] * 2, SamplingParams(max_tokens=2, **kw), use_tqdm=False)
    stats = llm.get_stats()
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_speculative_verification_applies_the_same_bias(model: str):
    """n-gram drafts are judged on the biased target: greedy output equals decoding without speculation, and
    drafts were made (the prompt repeats itself, so lookup finds them)."""
    prompt = [7, 8, 9, 10, 11, 12] * 3
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias={9: 5.0, 10: -3.0}),
              SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, allowed_token_ids=[7, 8, 9, 10, 11])]
    plain = LLM(model, num_kv_blocks=64).generate([{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False)
    spec_llm = LLM(model, num_kv_blocks=64, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    spec = spec_llm.generate([{"prompt_token_ids": prompt}] * 2, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert set(spec[1].outputs[0].token_ids) <= {7, 8, 9, 10, 11}
    assert spec_llm.get_stats()["spec_decode_num_draft_tokens"] > 0
