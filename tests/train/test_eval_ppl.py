"""eval-ppl: the engine's perplexity equals HF transformers' on the same windows."""
from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from conftest import _CORPUS, _hf_model
from minfer import LLM
from minfer.cli import main as cli_main
from minfer.eval_ppl import evaluate_perplexity, text_files, text_windows
from minfer.train.corpus import collect_files


def test_perplexity_agrees_with_hf(checkpoints, tmp_path):
    files = []
    for i, text in enumerate(_CORPUS):
        files.append(tmp_path / f"f{i}.py")
        files[-1].write_text(text * 2)
    llm = LLM(str(checkpoints["qwen3"]), num_kv_blocks=64, max_model_len=64, max_num_batched_tokens=40,
              max_num_seqs=8)
    result = evaluate_perplexity(llm, files)
    model = _hf_model(checkpoints["qwen3"])
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in text_windows(llm, files, 63):
            lp = model(torch.tensor([w])).logits[0].float().log_softmax(-1)
            nll -= float(lp[torch.arange(len(w) - 1), torch.tensor(w[1:])].sum())
            count += len(w) - 1
    assert result.num_tokens_scored == count
    assert abs(result.perplexity / math.exp(nll / count) - 1) < 1e-4  # the issue asks 0.5%; float32 gives far less


def test_eval_ppl_cli_and_errors(checkpoints, tmp_path, capsys):
    f = tmp_path / "a.py"
    f.write_text(_CORPUS[0])
    assert cli_main(["eval-ppl", "--model", str(checkpoints["llama3"]), "--num-kv-blocks", "32", str(f)]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"] > 1
    assert cli_main(["eval-ppl", "--model", str(checkpoints["llama3"]), str(tmp_path / "missing.py")]) == 2
    empty = tmp_path / "empty.py"
    empty.write_text("")
    llm = LLM(str(checkpoints["llama3"]), num_kv_blocks=32)
    with pytest.raises(ValueError, match="fewer than two tokens"):
        evaluate_perplexity(llm, [empty])


def test_a_folder_is_read_as_minfer_train_reads_it(checkpoints, tmp_path, caplog):
    """Bytecode in __pycache__ and files that are not UTF-8 are not text: scored, stdlib json/'s *.pyc made its
    perplexity 8,045 instead of 10.24. eval-ppl and the trainer's corpus take the same files of a folder."""
    folder = tmp_path / "pkg"
    (folder / "__pycache__").mkdir(parents=True)
    (folder / "a.py").write_text(_CORPUS[0])
    (folder / "__pycache__" / "a.cpython-311.pyc").write_bytes(bytes(range(256)) * 8)
    (folder / "notes.txt").write_bytes(b"caf\xe9 cr\xe8me\n" * 20)  # Latin-1, not UTF-8
    (folder / "blob.bin").write_bytes(b"\x00\x01" * 100)
    assert text_files([folder]) == [folder / "a.py", folder / "notes.txt"] == [f for f, _ in collect_files([folder])]
    llm = LLM(str(checkpoints["llama3"]), num_kv_blocks=32)
    with caplog.at_level(logging.WARNING, logger="minfer"):
        whole = evaluate_perplexity(llm, [folder])
    assert "not UTF-8" in caplog.text and "notes.txt" in caplog.text
    alone = evaluate_perplexity(llm, [folder / "a.py"])
    assert (whole.perplexity, whole.num_tokens_scored) == (alone.perplexity, alone.num_tokens_scored)
    (folder / "a.py").unlink()
    (folder / "notes.txt").unlink()
    with pytest.raises(FileNotFoundError, match="no text files"):
        text_files([folder])
