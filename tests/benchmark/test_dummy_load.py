"""``load_format="dummy"``: random weights drawn while the model loads, from a folder that holds only
config.json. The draws are those of ``write_random_checkpoint``: the same names, order and generator.
So on the CPU a dummy model equals the written checkpoint loaded. The tensors go down the loader's
real path, so tensor-parallel slices and online FP8 work as for a file."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.benchmark import shapes
from minfer.cli import main as cli_main
from minfer.config import EngineConfig
from minfer.model.registry import load_model_config
from minfer.distributed import TensorParallel
from minfer.model.loader import build_model
from minfer.ops import TorchOps

# each shape's layout (heads, tying, qk-norm, experts, sliding layers) at a few hundred KB
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
             intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
             # Qwen3.5: a linear layer then a full one (its default, every fourth, leaves two layers no attention)
             full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16)
SHAPES = ["llama-3.2-1b", "qwen3-30b-a3b", "mixtral-8x7b", "gemma-3-12b", "gemma-3-12b-it", "gpt-oss-20b", "qwen3.5-9b-mm",
          "qwen3.5-35b-a3b"]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def dummy_folder(tmp_path, shape: str, dtype: torch.dtype = torch.float32):
    return shapes.write_shape_config(shape, tmp_path / f"{shape}-dummy", dtype, layers=2, overrides=SMALL)


def build(path, load_format: str = "auto", tp: TensorParallel | None = None):
    cfg = load_model_config(path)
    extra = {} if tp is None else {"tp": tp}
    return build_model(path, cfg, torch.float32, torch.device("cpu"), 64, TorchOps(), load_format=load_format, **extra)


@pytest.mark.parametrize("shape", SHAPES)
def test_dummy_load_needs_only_config_json_and_generates(tmp_path, shape):
    path = dummy_folder(tmp_path, shape)
    assert [p.name for p in path.iterdir()] == ["config.json"]
    llm = LLM(str(path), load_format="dummy", device="cpu", skip_tokenizer_init=True, num_kv_blocks=16)
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [7, 8]}], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    with pytest.raises(FileNotFoundError, match="safetensors"):  # the default still reads the files
        LLM(str(path), device="cpu", skip_tokenizer_init=True, num_kv_blocks=16)


@pytest.mark.parametrize("shape,dtype", [("llama-3.2-1b", torch.float32), ("qwen3-30b-a3b", torch.float32),
                                         ("mixtral-8x7b", torch.bfloat16), ("gpt-oss-20b", torch.bfloat16)])
def test_dummy_weights_equal_the_written_checkpoint(tmp_path, shape, dtype):
    """The same draws as write_random_checkpoint on the CPU (seed 0), rounded to the config's dtype as the
    file stores them (bfloat16 here, in a float32 model)."""
    written = shapes.write_random_checkpoint(shape, tmp_path / shape, dtype, seed=0, device="cpu", layers=2,
                                             overrides=SMALL)
    real, dummy = build(written), build(dummy_folder(tmp_path, shape, dtype), "dummy")
    params = dict(dummy.named_parameters())
    assert params.keys() == dict(real.named_parameters()).keys()
    for name, p in real.named_parameters():
        assert torch.equal(p, params[name]), name
    for name, p in params.items():
        assert torch.isfinite(p).all()
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        elif p.numel() > 1000 and p.is_floating_point():  # (MXFP4 codes are random bytes)
            assert abs(p.float().std().item() - 0.02) < 0.002, name


def test_dummy_tensor_parallel_shard_is_a_slice_of_the_whole(tmp_path):
    """Every rank draws the whole tensors from the same seed and keeps its slice (rank 1 of 2 here), so
    two processes (the worker builds its runner from the same EngineConfig) generate what one does."""
    path = dummy_folder(tmp_path, "qwen3-30b-a3b")
    full, shard = build(path, "dummy"), build(path, "dummy", TensorParallel(1, 2))
    w = full.layers[1].mlp.w_down[3]
    assert torch.equal(shard.layers[1].mlp.w_down[3], w[:, w.shape[1] // 2:])
    qkv = full.layers[0].self_attn.qkv_proj.weight
    assert shard.layers[0].self_attn.qkv_proj.weight.shape[0] == qkv.shape[0] // 2
    prompts = [{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": list(range(10, 30))}]
    kw = dict(load_format="dummy", device="cpu", skip_tokenizer_init=True, num_kv_blocks=16)
    one = LLM(str(path), **kw).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(str(path), tensor_parallel_size=2, **kw)
    try:
        two = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in two]


def test_dummy_with_online_fp8(tmp_path):
    llm = LLM(str(dummy_folder(tmp_path, "qwen3-30b-a3b")), load_format="dummy", quantization="fp8", device="cpu",
              skip_tokenizer_init=True, num_kv_blocks=16)
    assert llm.get_stats()["weight_dtype"] == "fp8_e4m3 per channel (online)"
    assert llm.llm_engine.runner.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    out = llm.generate({"prompt_token_ids": [3, 4, 5]}, GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_dummy_rejects_a_pre_quantized_config(tmp_path):
    path = dummy_folder(tmp_path, "llama-3.2-1b")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="pre-quantized"):
        build(path, "dummy")


def test_bad_load_format_fails_at_construction(tmp_path):
    with pytest.raises(ValueError, match=r"load_format must be one of \['auto', 'dummy'\], got 'pt'"):
        EngineConfig(load_format="pt")
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(dummy_folder(tmp_path, "llama-3.2-1b")), load_format="random", device="cpu")


def test_bench_cli_with_a_dummy_shape_writes_no_weights(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(shapes.SHAPES, "tiny-moe", shapes.shape_config("qwen3-30b-a3b", layers=2, overrides=SMALL))
    out = tmp_path / "bench.json"
    argv = ["bench", "--shape", "tiny-moe", "--load-format", "dummy", "--checkpoint-dir", str(tmp_path / "ck"),
            "--input-len", "4", "--output-len", "3", "--num-prompts", "2", "--num-kv-blocks", "16",
            "--max-num-seqs", "4", "--device", "cpu", "--quiet", "--output-json", str(out)]
    assert cli_main(argv) == 0
    assert [p.name for p in (tmp_path / "ck" / "tiny-moe-dummy").iterdir()] == ["config.json"]
    assert not (tmp_path / "ck" / "tiny-moe").exists()
    result = json.loads(out.read_text())
    assert result["output_tokens"] == 6 and result["engine"]["load_format"] == "dummy"
    assert cli_main(argv + ["--compare-hf"]) == 2  # HF needs weights on disk
    assert "compare_hf needs the weights on disk" in capsys.readouterr().err


def test_bench_serve_launch_with_a_dummy_shape_writes_no_weights(tmp_path, monkeypatch):
    """``bench-serve --launch --shape S --load-format dummy`` hands the server a config-only folder, as
    ``minfer bench`` does (the child process is stood in for: starting a real server is test_bench_serve's)."""
    from minfer.benchmark import launch
    from minfer.cli.bench_serve import add_bench_serve_parser

    monkeypatch.setitem(shapes.SHAPES, "tiny-llama", shapes.shape_config("llama-3.2-1b", layers=2, overrides=SMALL))
    started = {}

    class Child:
        pid, exitcode = None, None

        def __init__(self, target, name, args, kwargs):
            started["model"], started["engine"] = args[0], args[1]

        def start(self):
            pass

    monkeypatch.setattr(launch.multiprocessing, "get_context", lambda method: type("Ctx", (), {"Process": Child}))
    monkeypatch.setattr(launch, "_wait_healthy", lambda *args: None)
    parser = argparse.ArgumentParser()
    add_bench_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench-serve", "--launch", "--shape", "tiny-llama", "--load-format", "dummy",
                              "--checkpoint-dir", str(tmp_path / "ck"), "--device", "cpu"])
    with launch.launched_server(args):
        pass
    folder = tmp_path / "ck" / "tiny-llama-dummy"
    assert started["model"] == str(folder) and started["engine"]["load_format"] == "dummy"
    assert [p.name for p in folder.iterdir()] == ["config.json"] and not (tmp_path / "ck" / "tiny-llama").exists()
