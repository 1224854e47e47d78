"""minfer.train: tokenizer round trip, a short CPU training run, HF export parity, bad input."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from minfer.train.command import add_train_parser, config_from_args
from minfer.train.corpus import heldout_files, is_heldout, load_corpus
from minfer.train.export import export_hf
from minfer.train.model import Llama, ModelConfig
from minfer.train.tokenizer import (BOS_ID, EOS_ID, PAD_ID, encode_documents, load_tokenizer,
                                    save_tokenizer, train_tokenizer)
from minfer.train.trainer import TrainConfig, lr_at, resolve_device, train

transformers = pytest.importorskip("transformers")

SNIPPET = '''\
def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()
'''

ROUND_TRIP = ["def f(x):\n\treturn x  # ok\n", "  leading spaces", "naïve café ü 中文 🐍",
              "a , b . c ;", "\n\n\n", "x=1\r\ny=2"]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest single-threaded, and CI's few cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _write_corpus(root: Path, copies: int = 6) -> Path:
    """A small stdlib-shaped tree: training files plus a held-out ``json`` package."""
    (root / "json").mkdir(parents=True)
    for i in range(copies):
        (root / f"mod{i}.py").write_text(SNIPPET.replace("Stack", f"Stack{i}"))
    (root / "json" / "__init__.py").write_text(SNIPPET.replace("fibonacci", "fib"))
    return root


def _tiny(out: Path, corpus: Path, **kw) -> TrainConfig:
    base = dict(out=out, paths=[str(corpus)], vocab_size=300, hidden_size=32, layers=2,
                heads=4, kv_heads=2, intermediate_size=64, seq_len=32, batch_size=8,
                steps=60, lr=1e-2, warmup=5, eval_every=30, device="cpu", dtype="float32",
                quiet=True, heldout="packages")  # the corpus is stdlib-shaped: hold out its json package
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("train")
    torch.set_num_threads(1)
    cfg = _tiny(tmp / "out", _write_corpus(tmp / "corpus"))
    return cfg.out, train(cfg)


def _load_training_model(out: Path) -> Llama:
    best = torch.load(out / "train" / "best.pt", weights_only=False)
    model = Llama(ModelConfig(**best["model_config"]))
    model.load_state_dict(best["model"])
    return model.eval()


def test_tokenizer_round_trip_through_autotokenizer(tmp_path):
    tok = train_tokenizer([SNIPPET] * 3, vocab_size=320)
    save_tokenizer(tok, tmp_path, model_max_length=128)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    for text in ROUND_TRIP + [SNIPPET]:
        ids = hf(text)["input_ids"]
        assert ids[0] == BOS_ID
        assert hf.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    stream = encode_documents(load_tokenizer(tmp_path), ["ab", "cd"])
    assert stream[0] == BOS_ID and stream[-1] == EOS_ID
    assert int((stream == BOS_ID).sum()) == 2 and int((stream == EOS_ID).sum()) == 2


def test_training_lowers_loss(trained):
    out, metrics = trained
    log = [json.loads(line) for line in (out / "train" / "log.jsonl").read_text().splitlines()]
    assert metrics["steps"] == 60 and metrics["split"] == "packages"
    # An untrained model scores about ln(vocab); the trained one must do far better.
    assert metrics["val_loss"] < math.log(metrics["vocab_size"]) - 1.5
    assert log[-1]["val_loss"] < log[0]["val_loss"] or metrics["best_step"] == log[0]["step"]
    assert log[-1]["train_loss"] < log[0]["train_loss"] < math.log(metrics["vocab_size"])


def test_export_loads_in_hf_with_equal_logits(trained):
    out, _ = trained
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["head_dim"] == 8
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok(SNIPPET, return_tensors="pt")["input_ids"][:, :48]
    with torch.no_grad():
        theirs = hf(ids).logits
        ours = _load_training_model(out)(ids)
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    gen = hf.generate(ids[:, :4], max_new_tokens=8, do_sample=False)
    assert gen.shape[1] > 4


def test_export_untied_gqa_custom_rope(tmp_path):
    cfg = ModelConfig(vocab_size=300, hidden_size=48, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, intermediate_size=80,
                      max_position_embeddings=64, rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Llama(cfg).eval()
    with torch.no_grad():  # give the gains some spread so a wrong norm placement shows
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.uniform_(0.5, 1.5)
    export_hf(model, tmp_path, dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), atol=1e-4, rtol=1e-4)


def test_resume_matches_uninterrupted(tmp_path):
    corpus = _write_corpus(tmp_path / "corpus", copies=3)
    kw = dict(steps=12, eval_every=6, warmup=2, dropout=0.1)  # dropout: RNG state resumes too
    full = train(_tiny(tmp_path / "full", corpus, **kw))
    assert train(_tiny(tmp_path / "part", corpus, **kw, stop_after=6))["paused"]
    resumed = train(_tiny(tmp_path / "part", corpus, **kw, resume=True))
    assert resumed["steps"] == 12
    assert resumed["val_loss"] == pytest.approx(full["val_loss"], abs=1e-4)


def test_heldout_rule(tmp_path):
    assert is_heldout("email/parser.py") and is_heldout("test/test_json/__init__.py")
    assert not is_heldout("emailx/parser.py") and not is_heldout("asyncio/tasks.py")
    root = _write_corpus(tmp_path / "corpus", copies=2)
    assert heldout_files(root) == [root / "json" / "__init__.py"]
    corpus = load_corpus([root], heldout="packages")
    assert [d.path for d in corpus.val] == [root / "json" / "__init__.py"]
    assert len(corpus.train) == 2
    # a corpus of one's own gets the tail split unless the package rule is asked for
    assert load_corpus([root]).split == "tail"
    assert load_corpus([root], heldout="tail").split == "tail"


def test_single_file_falls_back_to_tail_split(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text(SNIPPET * 20)
    corpus = load_corpus([f])
    assert corpus.split == "tail"
    assert corpus.train[0].text + corpus.val[0].text == SNIPPET * 20


@pytest.mark.parametrize("change, message", [
    (dict(vocab_size=100), "vocab size 100 is too small"),
    (dict(hidden_size=30), "divisible by num_attention_heads"),
    (dict(heads=4, kv_heads=3), "divisible by num_key_value_heads"),
    (dict(paths=["/nonexistent/corpus"]), "does not exist"),
])
def test_bad_input(tmp_path, change, message):
    corpus = _write_corpus(tmp_path / "corpus", copies=1)
    with pytest.raises(ValueError, match=message):
        train(_tiny(tmp_path / "out", corpus, **change))


def test_empty_corpus(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.py").write_text("   \n\n")
    with pytest.raises(ValueError, match="corpus is empty"):
        train(_tiny(tmp_path / "out", tmp_path / "empty"))


def test_cli_parser():
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "a.py", "dir", "--out", "x", "--vocab-size", "4096",
                              "--layers", "3", "--max-time", "60", "--dtype", "float16"])
    cfg = config_from_args(args)
    assert cfg.paths == ["a.py", "dir"] and cfg.vocab_size == 4096 and cfg.layers == 3
    assert cfg.max_time == 60.0 and cfg.dtype == "float16" and args.func.__name__ == "run_train"


def test_the_readme_cpu_recipe_warms_up_and_decays_within_its_budget():
    """README: ``--steps 200 --max-time 1800``. A fixed 200-step warm-up equal to --steps kept the run warming up to
    its end (it stopped at step 19, at 5% of the peak). Warm-up is now the first 10% of the run, counted in steps or,
    when --max-time ends the run first, in time, as the cosine decay already was."""
    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command"))
    cfg = config_from_args(parser.parse_args(
        "train my_code/ --out tiny --vocab-size 2048 --hidden-size 128 --layers 4 --seq-len 256 --batch-size 8 "
        "--steps 200 --max-time 1800".split()))
    floor = cfg.lr * cfg.min_lr_ratio
    by_steps = [lr_at(cfg, s, s / cfg.steps) for s in range(cfg.steps)]  # steps run out before the time
    assert by_steps[0] == pytest.approx(cfg.lr / 20) and max(by_steps) == by_steps[19] == pytest.approx(cfg.lr)
    assert by_steps[-1] == pytest.approx(floor, rel=0.01)
    by_time = [lr_at(cfg, s, s / 19) for s in range(19)]  # 19 steps fit in the time: the clock is ahead
    assert max(by_time) > 0.95 * cfg.lr and by_time.index(max(by_time)) == 2  # the decay has begun at the peak
    assert by_time[-1] < 1.1 * floor and by_time == sorted(by_time[:3]) + sorted(by_time[3:], reverse=True)
    fixed = TrainConfig(out=Path("x"), steps=200, warmup=50)  # an explicit --warmup stays a step count
    assert lr_at(fixed, 24, 0.9) == pytest.approx(fixed.lr / 2)


def test_minfer_generates_hf_greedy_tokens_from_export(trained):
    from conftest import assert_greedy_match, hf_greedy
    from minfer import LLM, SamplingParams

    out, _ = trained
    llm = LLM(str(out), num_kv_blocks=32)
    for prompt in ["def fib", "class Stack", "import os\n"]:
        ids = llm.get_tokenizer().encode(prompt)
        got = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
        ref, ref_logits = hf_greedy(out, ids, 12)
        assert_greedy_match(got[0].outputs[0].token_ids, ref, ref_logits)


def test_device_names_are_checked():
    assert resolve_device("cpu") == torch.device("cpu")
    for bad in ("tpu", "mps", "cuda:x"):
        with pytest.raises(ValueError, match="'auto', 'cpu', 'cuda' or 'cuda:N'"):
            resolve_device(bad)
    with pytest.raises(ValueError, match="CUDA GPU"):
        resolve_device(f"cuda:{torch.cuda.device_count()}")  # one past the last GPU (any machine)
