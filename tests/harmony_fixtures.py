"""gpt-oss's chat format (harmony) in tests, with nothing downloaded: the real chat template
(``templates/gpt-oss.jinja``), a tiny tokenizer whose harmony markers are special tokens as in o200k_harmony, a
tiny checkpoint that speaks through it (``<|return|>`` and ``<|call|>`` its EOS tokens, as in gpt-oss's
generation_config), and a sampler that plays a scripted output, so that a server or ``LLM.chat`` test generates
real special tokens (a grammar cannot: it only allows a special token as EOS)."""
from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

TEMPLATE_PATH = Path(__file__).parent / "templates" / "gpt-oss.jinja"
TEMPLATE_SHA256 = "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146"  # llama.cpp's file, after our header
MARKERS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
           "<|message|>", "<|call|>"]  # o200k_harmony's special tokens that gpt-oss's chats use
_CORPUS_EXTRA = ["analysis final commentary assistant functions.get_weather json to= {\"city\": \"Paris\"}",
                 "The weather in Paris is sunny. We should call the tool. Two and two make four."]


def _root_conftest() -> Any:
    """tests/conftest.py by path (the bare name ``conftest`` may be bound to another folder's)."""
    spec = importlib.util.spec_from_file_location("_minfer_tests_root_conftest", Path(__file__).parent / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def gpt_oss_template() -> str:
    """The fixture's text (its header comment renders nothing); the template below the header is checked against
    llama.cpp's bytes."""
    raw = TEMPLATE_PATH.read_bytes()
    body = raw[raw.index(b"#}\n") + 3:]
    assert hashlib.sha256(body).hexdigest() == TEMPLATE_SHA256, "tests/templates/gpt-oss.jinja was changed"
    return raw.decode("utf-8")


def make_harmony_tokenizer(out: Path) -> dict[str, int]:
    """A byte-level BPE tokenizer of under 320 ids with the harmony markers as special tokens and gpt-oss's chat
    template, saved as an HF fast tokenizer in ``out``; returns the markers' ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_root_conftest()._CORPUS + _CORPUS_EXTRA, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|return|>",
                                   pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": MARKERS})
    fast.chat_template = gpt_oss_template()
    fast.save_pretrained(str(out))
    return {m: fast.convert_tokens_to_ids(m) for m in MARKERS}


def harmony_checkpoint(out: Path) -> Path:
    """The tiny random Llama 3 checkpoint of tests/conftest.py with the harmony tokenizer, its EOS tokens
    ``<|return|>`` and ``<|call|>`` (generation_config.json)."""
    _root_conftest().make_checkpoint(out, "llama3", max_positions=2048)  # room for the template's long system prompt
    ids = make_harmony_tokenizer(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids["<|return|>"], ids["<|call|>"]]}))
    return out


class ScriptedSampler:
    """Plays ``script`` (token ids) as every sequence's output: each row's logits are masked to its next scripted
    token (by the row's output count; the last one repeats) before the engine's own sampler draws, so stops, EOS
    and detokenizing run as usual. Set it on an engine's runner (``engine.runner.sampler``)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.script: list[int] = []

    def __call__(self, logits: torch.Tensor, meta: Any, bitmask: torch.Tensor | None = None) -> Any:
        forced = torch.full_like(logits, -1e4)
        for row, count in enumerate(meta.output_counts.tolist()):
            forced[row, self.script[min(count, len(self.script) - 1)]] = 0.0
        return self.real(forced, meta, bitmask)
