"""What a new user meets first: the model's sampling defaults, streamed text, flags after the command,
escapes in stop strings, and errors that say what is wrong before anything loads."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from minfer import LLM, SamplingParams
from minfer.cli import build_parser
from minfer.cli import main as cli_main
from minfer.cli.generate import unescape


def _with_generation_config(src: Path, dst: Path, **settings: object) -> Path:
    shutil.copytree(src, dst)
    gen = json.loads((dst / "generation_config.json").read_text()) if (dst / "generation_config.json").exists() else {}
    (dst / "generation_config.json").write_text(json.dumps({**gen, **settings}))
    return dst


def test_generation_config_supplies_default_sampling(checkpoints, tmp_path):
    path = _with_generation_config(checkpoints["llama3"], tmp_path / "gen", temperature=0.3, top_k=7, top_p=0.8,
                                   repetition_penalty=1.2)
    d = LLM(str(path), num_kv_blocks=32).get_default_sampling_params()
    assert (d.temperature, d.top_k, d.top_p, d.repetition_penalty, d.min_p, d.max_tokens) == (0.3, 7, 0.8, 1.2, 0.0, 16)
    # generate() without params samples with them: the same tokens as those params given explicitly
    prompt = {"prompt_token_ids": [5, 6, 7]}
    implicit = LLM(str(path), num_kv_blocks=32, seed=3).generate(prompt, use_tqdm=False)[0].outputs[0].token_ids
    explicit = LLM(str(path), num_kv_blocks=32, seed=3).generate(
        prompt, SamplingParams(temperature=0.3, top_k=7, top_p=0.8, repetition_penalty=1.2), use_tqdm=False)
    assert implicit == explicit[0].outputs[0].token_ids
    ignored = LLM(str(path), num_kv_blocks=32, generation_config="vllm").get_default_sampling_params()
    assert (ignored.temperature, ignored.top_k, ignored.repetition_penalty) == (1.0, 0, 1.0)


def test_builtin_model_ships_sampling_defaults():
    from minfer.llm import builtin_model_path

    gen = json.loads((builtin_model_path() / "generation_config.json").read_text())
    assert gen["temperature"] > 0 and gen["repetition_penalty"] > 1  # greedy decoding of it loops


def test_generate_says_which_sampling_it_used_and_streams(checkpoints, tmp_path, capsys):
    path = _with_generation_config(checkpoints["llama3"], tmp_path / "gen", temperature=0.5, top_k=9)
    assert cli_main(["generate", "--model", str(path), "--max-tokens", "6", "--num-kv-blocks", "16", "def f():"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("def f():")
    assert "temperature=0.5" in out.err and "top_k=9" in out.err and "generation_config.json" in out.err
    assert cli_main(["generate", "--model", str(path), "--max-tokens", "4", "--num-kv-blocks", "16",
                     "--temperature", "0", "a", "b"]) == 0
    out = capsys.readouterr()
    assert "temperature=0.0" in out.err and "flags given" in out.err and out.out.count("-" * 40) == 2


def test_verbose_works_after_the_command():
    parser = build_parser()
    assert parser.parse_args(["generate", "x", "-v"]).verbose
    assert parser.parse_args(["-v", "generate", "x"]).verbose
    assert not parser.parse_args(["generate", "x"]).verbose


@pytest.mark.parametrize("given, meant", [(r"\n\n", "\n\n"), (r"a\tb", "a\tb"), (r"\\n", "\\n"), ("é\\x", "é\\x"),
                                          ("plain", "plain")])
def test_stop_strings_take_escapes(given, meant):
    assert unescape(given) == meant
    assert build_parser().parse_args(["generate", "p", "--stop", given]).stop == [meant]


def test_model_paths_that_are_wrong_say_why(checkpoints, capsys):
    assert cli_main(["generate", "--model", str(checkpoints["llama3"] / "config.json"), "x"]) == 2
    assert "is a file; pass the folder" in capsys.readouterr().err


def test_eval_ppl_takes_folders_and_checks_paths_before_loading(checkpoints, tmp_path, capsys, monkeypatch, caplog):
    folder = tmp_path / "src"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.py").write_text("def f(x):\n    return x + 1\n" * 8)
    (folder / "sub" / "b.py").write_text("class A:\n    pass\n" * 8)
    assert cli_main(["eval-ppl", "--model", str(checkpoints["llama3"]), "--num-kv-blocks", "64", str(folder)]) == 0
    assert json.loads(capsys.readouterr().out)["files"] == 2

    def no_model(*args, **kwargs):
        raise AssertionError("the model loaded before the paths were checked")

    monkeypatch.setattr("minfer.llm.LLM.__init__", no_model)
    assert cli_main(["eval-ppl", "--model", str(checkpoints["llama3"]), str(tmp_path / "missing.py")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger="minfer"):
        assert cli_main(["eval-ppl", "--model", str(checkpoints["llama3"]), "--num-kv-blocks", "64",
                         "--window", "100000", str(folder / "a.py")]) == 0
    assert "longer than max_model_len" in caplog.text


def test_bench_fits_the_model_context(checkpoints, tmp_path):
    """A fixed workload asks for the context it needs, not workload A's 4096 (the test models hold 512)."""
    assert cli_main(["bench", "--model", str(checkpoints["llama3"]), "--input-len", "16", "--output-len", "8",
                     "--num-prompts", "2", "--num-kv-blocks", "16", "--quiet",
                     "--output-json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["output_tokens"] == 16
