"""Embeddings (runner='pooling'): LLM.embed equals HF AutoModel's final hidden states pooled as the checkpoint's
sentence-transformers config says (last token, mean, CLS; normalised or not), in float32 on the CPU, through
chunked prompts, preemption and the prefix cache; and what is refused."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import kv_settings, make_checkpoint

from minfer import LLM, SamplingParams
from minfer.config import EngineConfig
from minfer.engine.llm_engine import LLMEngine
from minfer.pooling_outputs import PoolingRequestOutput
from minfer.pooling_params import PoolingParams

# 1 token, exactly one block, one block + 1, several blocks (block_size 16): a batch of different lengths
PROMPTS = [[5], list(range(2, 18)), list(range(3, 20)), [(i * 7) % 300 + 2 for i in range(50)]]
SCENARIOS = {
    "default": dict(num_kv_blocks=64),
    # prompts cut into chunks of at most 6 tokens, several sequences a step
    "chunked": dict(num_kv_blocks=64, max_num_batched_tokens=6, max_num_seqs=4),
    # chunks and a 4-block cache: the 50-token prompt fills it alone, so the prompts wait for each other's blocks
    "small_cache": dict(num_kv_blocks=4, max_num_batched_tokens=6, max_num_seqs=4),
}
_ST = "sentence_transformers.models."
ST_MODES = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token"}


def write_st_config(model_dir: Path, mode: str, normalize: bool, extra_modules: tuple[dict, ...] = (),
                    **pooling: object) -> Path:
    """A sentence-transformers layout by hand: modules.json, 1_Pooling/config.json, 2_Normalize."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (model_dir / "2_Normalize").mkdir(exist_ok=True)
    modules += extra_modules
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    cfg = {"include_prompt": True, **{key: False for key in ST_MODES.values()},
           "pooling_mode_max_tokens": False, **({ST_MODES[mode]: True} if mode in ST_MODES else {}), **pooling}
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    return model_dir


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same tiny Llama weights without a sentence-transformers config (last token, normalised: the default),
    and with one that says mean + Normalize, mean alone, CLS + Normalize; plus a Matryoshka config.json."""
    root = tmp_path_factory.mktemp("embed")
    base = make_checkpoint(root / "default", "llama3")
    out = {"default": base}
    for name, mode, normalize in (("mean", "MEAN", True), ("mean_raw", "MEAN", False), ("cls", "CLS", True)):
        out[name] = write_st_config(Path(shutil.copytree(base, root / name)), mode, normalize)
    mat = Path(shutil.copytree(base, root / "matryoshka"))
    cfg = json.loads((mat / "config.json").read_text())
    (mat / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32, 64]}))
    out["matryoshka"] = mat
    return out


@pytest.fixture(scope="module")
def hf_states(models: dict[str, Path]) -> dict[tuple[int, ...], torch.Tensor]:
    """HF AutoModel's last_hidden_state (the final norm's output) of each prompt, float32."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(models["default"]), dtype=torch.float32).eval()
    with torch.no_grad():
        return {tuple(p): model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS + [list(range(2, 40))]}


def reference(states: torch.Tensor, mode: str, normalize: bool) -> torch.Tensor:
    pooled = {"LAST": states[-1], "MEAN": states.mean(0), "CLS": states[0]}[mode]
    return F.normalize(pooled, dim=-1) if normalize else pooled


def assert_close(ours: list[float], ref: torch.Tensor) -> None:
    vec = torch.tensor(ours)
    assert vec.shape == ref.shape
    assert F.cosine_similarity(vec, ref, dim=0) >= 0.9999
    assert torch.allclose(vec, ref, rtol=1e-4, atol=1e-4), (vec - ref).abs().max()


def check_all_free(llm: LLM) -> None:
    stats = llm.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"], stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("variant, mode, normalize", [("default", "LAST", True), ("mean", "MEAN", True),
                                                      ("cls", "CLS", True), ("mean_raw", "MEAN", False)])
def test_embed_matches_hf(models, hf_states, scenario, variant, mode, normalize):
    llm = LLM(str(models[variant]), runner="pooling", **SCENARIOS[scenario])
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    for prompt, out in zip(PROMPTS, outs):
        assert out.finished and out.outputs.hidden_size == 64
        assert_close(out.outputs.embedding, reference(hf_states[tuple(prompt)], mode, normalize))
    check_all_free(llm)


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "qwen3_5"])
def test_other_architectures_chunked(tmp_path, arch):
    """Gemma 3's final norm ((1 + w)) and sliding layers in a hybrid cache, Qwen3.5's recurrent state carried across
    chunks: the pooled states are still HF's, mean (from a sentence-transformers config) and last-token alike."""
    from transformers import AutoModel

    path = make_checkpoint(tmp_path / arch, arch)
    hf = AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        states = [hf(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]
    settings = kv_settings(path, SCENARIOS["chunked"])
    with LLM(str(path), runner="pooling", **settings) as llm:
        for out, s in zip(llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False), states):
            assert_close(out.outputs.embedding, reference(s, "LAST", True))
    with LLM(str(write_st_config(path, "MEAN", False)), runner="pooling", **settings) as llm:
        for out, s in zip(llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False), states):
            assert_close(out.outputs.embedding, reference(s, "MEAN", False))


def test_pooling_params_normalize_and_dimensions(models, hf_states):
    states = hf_states[tuple(PROMPTS[3])]
    with LLM(str(models["default"]), runner="pooling", num_kv_blocks=16) as llm:
        raw, = llm.embed({"prompt_token_ids": PROMPTS[3]}, pooling_params=PoolingParams(normalize=False),
                         use_tqdm=False)
        assert_close(raw.outputs.embedding, states[-1])
        with pytest.raises(ValueError, match="dimensions: this model does not support Matryoshka"):
            llm.embed("def f", pooling_params=PoolingParams(dimensions=16), use_tqdm=False)
        check_all_free(llm)
    with LLM(str(models["matryoshka"]), task="embed", num_kv_blocks=16) as llm:  # vLLM's older name
        cut, full = llm.embed([{"prompt_token_ids": PROMPTS[3]}] * 2, use_tqdm=False,
                              pooling_params=[PoolingParams(dimensions=16), PoolingParams()])
        assert_close(cut.outputs.embedding, F.normalize(states[-1][:16], dim=-1))  # cut, then normalised
        assert_close(full.outputs.embedding, F.normalize(states[-1], dim=-1))
        with pytest.raises(ValueError, match=r"matryoshka_dimensions \[16, 32, 64\], got 20"):
            llm.embed("def f", pooling_params=PoolingParams(dimensions=20), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be an integer >= 1"):
        PoolingParams(dimensions=0)


@pytest.mark.parametrize("variant, hits", [("default", True), ("mean", False)])
def test_prefix_cache_only_for_last_token(models, hf_states, variant, hits):
    """A repeated prompt hits the prefix cache under last-token pooling (its last token is always computed);
    mean pooling runs without the cache (a hit would skip tokens it averages); both stay equal to HF."""
    prompt = list(range(2, 40))
    llm = LLM(str(models[variant]), runner="pooling", num_kv_blocks=16)
    first, = llm.embed({"prompt_token_ids": prompt}, use_tqdm=False)
    again, = llm.embed({"prompt_token_ids": prompt}, use_tqdm=False)
    assert (llm.get_stats()["prefix_cache_hit_tokens"] >= 32) is hits
    ref = reference(hf_states[tuple(prompt)], "LAST" if variant == "default" else "MEAN", True)
    assert_close(first.outputs.embedding, ref)
    assert_close(again.outputs.embedding, ref)
    check_all_free(llm)


def test_text_prompts_and_the_whole_context(models):
    llm = LLM(str(models["default"]), runner="pooling", num_kv_blocks=16, max_model_len=32)
    text, = llm.embed("def fibonacci(n):", use_tqdm=False)
    ids, = llm.embed(llm.get_tokenizer().encode("def fibonacci(n):"), use_tqdm=False)
    assert text.outputs.embedding == ids.outputs.embedding
    full, = llm.embed({"prompt_token_ids": list(range(2, 34))}, use_tqdm=False)  # a prompt may fill the context
    assert len(full.prompt_token_ids) == 32
    with pytest.raises(ValueError, match="the prompt has 33 tokens, but max_model_len is 32: it must be at most"):
        llm.embed({"prompt_token_ids": list(range(2, 35))}, use_tqdm=False)
    check_all_free(llm)


def test_engine_steps_and_abort(models):
    """At the engine: one final PoolingRequestOutput per request; an abort mid-prompt frees everything."""
    engine = LLMEngine(EngineConfig(model=str(models["mean"]), runner="pooling", num_kv_blocks=16,
                                    max_num_batched_tokens=8, max_num_seqs=2))
    engine.add_request("a", {"prompt_token_ids": PROMPTS[3]}, PoolingParams())
    engine.add_request("b", {"prompt_token_ids": PROMPTS[2]}, PoolingParams())
    assert engine.step() == [] and engine.has_unfinished_requests()
    engine.abort_request("a")
    outputs: list = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    out, = outputs
    assert isinstance(out, PoolingRequestOutput) and out.request_id == "b" and out.finished
    assert out.data.shape == (64,) and abs(float(out.data.norm()) - 1) < 1e-5
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == []
    stats = engine.get_stats()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and not engine.pooler.requests
    assert engine.step() == []


def test_wrong_runner_is_a_clear_error(models):
    with LLM(str(models["default"]), runner="pooling", num_kv_blocks=16) as llm:
        with pytest.raises(ValueError, match="runner='pooling': it embeds prompts"):
            llm.generate("def f", SamplingParams(max_tokens=2), use_tqdm=False)
        check_all_free(llm)
    with LLM(str(models["default"]), num_kv_blocks=16) as llm:
        with pytest.raises(ValueError, match="LLM.embed needs an LLM built with runner='pooling'"):
            llm.embed("def f", use_tqdm=False)
        with pytest.raises(ValueError, match="need an engine built with runner='pooling'"):
            llm.llm_engine.add_request("x", "def f", PoolingParams())
        assert not llm.llm_engine.has_unfinished_requests()


def test_refused_configurations(models, tmp_path):
    with pytest.raises(ValueError, match="runner must be one of"):
        EngineConfig(model="x", runner="embed")
    with pytest.raises(ValueError, match="runner='pooling' runs without"):
        EngineConfig(model="x", runner="pooling", enable_lora=True)
    with pytest.raises(ValueError, match="task must be one of"):
        LLM(str(models["default"]), task="classify")
    with pytest.raises(ValueError, match="task='embed' asks for runner='pooling'"):
        LLM(str(models["default"]), task="embed", runner="generate")
    bad = {"max": dict(mode="none", pooling_mode_max_tokens=True),
           "two": dict(mode="MEAN", pooling_mode_cls_token=True),
           "prompt": dict(mode="MEAN", include_prompt=False),
           "width": dict(mode="MEAN", word_embedding_dimension=32),
           "dense": dict(mode="MEAN", extra_modules=({"path": "2_Dense", "type": _ST + "Dense"},))}
    messages = {"max": r"\['pooling_mode_max_tokens'\] are not supported", "two": "exactly one pooling mode",
                "prompt": "include_prompt false", "width": "word_embedding_dimension 32 is not the model's hidden",
                "dense": f"the module '{_ST}Dense' is not supported"}
    for name, kw in bad.items():
        path = write_st_config(Path(shutil.copytree(models["default"], tmp_path / name)), normalize=False, **kw)
        with pytest.raises(ValueError, match=messages[name]):
            LLM(str(path), runner="pooling", num_kv_blocks=16)


def test_serve_runner_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    """``minfer serve MODEL --runner pooling``: the flag comes from EngineConfig's field."""
    import minfer.cli.serve as serve_cli
    from minfer.cli import main

    got: dict = {}
    monkeypatch.setattr(serve_cli, "run_server", lambda model, engine_kwargs, **kw: got.update(engine_kwargs))
    assert main(["serve", "org/model", "--runner", "pooling"]) == 0
    assert EngineConfig(model="org/model", **got).runner == "pooling"
    assert main(["serve", "org/model"]) == 0 and EngineConfig(model="org/model", **got).runner == "generate"
