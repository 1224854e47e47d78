"""`minfer bench` on tiny checkpoints: throughput, batch-1, HF comparison, plot, shape writer."""
from __future__ import annotations

import json

import pytest

from minfer import LLM, SamplingParams
from minfer.benchmark import shapes
from minfer.benchmark.offline import bench, write_outputs
from minfer.cli import main as cli_main

TINY = dict(num_kv_blocks=64, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)


def test_fixed_workload_bench_and_plot(checkpoints, tmp_path):
    result = bench(str(checkpoints["llama3"]), None, TINY, num_prompts=4, input_len=8, output_len=5, progress=False)
    assert result["requests"] == 4 and result["prompt_tokens"] == 32 and result["output_tokens"] == 20
    assert result["output_tok_s"] > 0 and result["num_preemptions"] == 0
    png = tmp_path / "bench.png"
    write_outputs(result, str(tmp_path / "bench.json"), str(png))
    assert json.loads((tmp_path / "bench.json").read_text())["output_tokens"] == 20
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_batch1_mode_reports_bound_share(checkpoints):
    result = bench(str(checkpoints["qwen3"]), None, TINY, input_len=6, output_len=8, batch1=True)["batch1"]
    assert result["decode_tok_s"] > 0 and result["bound_tok_s"] > result["decode_tok_s"]
    assert 0 < result["share_of_bound"] < 1


def test_compare_hf_same_requests(checkpoints):
    result = bench(str(checkpoints["llama3"]), None, TINY, num_prompts=2, input_len=6, output_len=3,
                   compare_hf=True, hf_num_prompts=2, hf_output_len=4, progress=False)
    c = result["compare_hf"]
    assert c["requests"] == 2 and c["minfer_output_tok_s"] > 0 and c["hf_output_tok_s"] > 0
    assert c["speedup"] == pytest.approx(c["minfer_output_tok_s"] / c["hf_output_tok_s"], rel=0.01)


def test_random_shape_checkpoint_is_a_loadable_sharded_hf_folder(tmp_path, monkeypatch):
    tiny = dict(shapes.SHAPES["qwen3-0.6b"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=512)
    monkeypatch.setitem(shapes.SHAPES, "tiny-qwen3", tiny)
    path = shapes.write_random_checkpoint("tiny-qwen3", tmp_path / "ck", shard_bytes=40_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=16)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    with pytest.raises(ValueError, match="unknown shape"):
        shapes.write_random_checkpoint("gpt-5", tmp_path / "x")


def test_bench_cli_needs_a_model(capsys):
    assert cli_main(["bench", "--quiet"]) == 2
    assert "--model or --shape" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs,field", [
    (dict(num_prompts=0, input_len=8), "num_prompts"), (dict(input_len=0), "input_len"),
    (dict(input_len=8, output_len=0), "output_len"),
])
def test_bench_rejects_empty_workloads(checkpoints, kwargs, field):
    with pytest.raises(ValueError, match=field):
        bench(str(checkpoints["llama3"]), None, TINY, progress=False, **kwargs)


def test_workload_a_needs_a_vocabulary_above_its_token_ids(checkpoints):
    with pytest.raises(ValueError, match="--input-len"):  # the tiny test models have a few hundred tokens
        bench(str(checkpoints["llama3"]), None, TINY, progress=False)


@pytest.mark.parametrize("argv,expected", [
    (["--batch1"], 512), (["--input-len", "8"], 128), (["--batch1", "--output-len", "32"], 32),
])
def test_cli_output_len_defaults(checkpoints, monkeypatch, argv, expected):
    """A batch-1 run measures 512 tokens unless told otherwise: 128 tokens last ~0.1 s on an H200, too short
    for a stable figure; fixed-length workloads keep 128."""
    import minfer.benchmark.offline as offline

    seen = {}
    monkeypatch.setattr(offline, "bench", lambda model, shape, kwargs, **kw: seen.update(kw) or {})
    monkeypatch.setattr(offline, "write_outputs", lambda *a: None)
    assert cli_main(["bench", "--quiet", "--model", str(checkpoints["llama3"])] + argv) == 0
    assert seen["output_len"] == expected
