"""Byte-level BPE tokenizer, trained with HF ``tokenizers``, saved for ``AutoTokenizer``.

Byte-level (GPT-2 style) because source code holds any Unicode and every string must
round-trip: the 256 byte symbols are always in the vocabulary, so nothing is ever unknown and
``decode(encode(text)) == text``. The pre-tokenizer keeps runs of spaces together, which lets
BPE learn indentation as single tokens.

Special tokens come first, so their ids are fixed whatever the vocabulary size:
``<s>`` = 0 (BOS), ``</s>`` = 1 (EOS), ``<pad>`` = 2. The post-processor prepends BOS, as Llama
tokenizers do, because every training document starts with BOS; corpus encoding adds BOS and
EOS itself and calls the tokenizer with ``add_special_tokens=False``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, PAD)
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + 1  # bytes + specials + at least one merge


def check_vocab_size(vocab_size: int) -> None:
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab size {vocab_size} is too small: a byte-level BPE needs the 256 byte symbols, "
            f"{len(SPECIAL_TOKENS)} special tokens and at least one merge "
            f"(vocab size >= {MIN_VOCAB_SIZE})")


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on ``texts``; the result may be smaller than ``vocab_size``
    when the corpus runs out of pairs to merge (tiny corpora)."""
    check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, BOS_ID)])
    for token, tid in zip(SPECIAL_TOKENS, (BOS_ID, EOS_ID, PAD_ID)):
        assert tok.token_to_id(token) == tid, "special tokens must take the first ids"
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json``.

    ``PreTrainedTokenizerFast`` is named because it exists in transformers 4.x and 5.x
    alike. ``clean_up_tokenization_spaces`` must be off: it rewrites " ." into "." and would
    break the round trip on code.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load ``tokenizer.json`` from a folder (or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"no tokenizer.json at {p}")
    return Tokenizer.from_file(str(p))


def encode_documents(tok: Tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """One flat int32 token stream: BOS + text + EOS for each document, in order.

    Training windows are cut from this stream without regard to document boundaries
    (packing), so the model learns that EOS is followed by a fresh BOS and document.
    """
    if not texts:
        return torch.empty(0, dtype=torch.int32)
    encodings = tok.encode_batch(list(texts), add_special_tokens=False)
    lengths = [len(e.ids) + 2 for e in encodings]
    flat = torch.empty(sum(lengths), dtype=torch.int32)
    pos = 0
    for enc, n in zip(encodings, lengths):
        flat[pos] = BOS_ID
        flat[pos + 1:pos + n - 1] = torch.tensor(enc.ids, dtype=torch.int32)
        flat[pos + n - 1] = EOS_ID
        pos += n
    return flat
