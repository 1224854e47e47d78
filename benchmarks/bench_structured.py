"""Structured outputs' costs: the per-step token-bitmask fill on the host, its application on the device,
and the engine's constrained decoding throughput and time to first token against unconstrained requests.

``--mask-cost``: xgrammar's ``BatchGrammarMatcher.batch_fill_next_token_bitmask`` and a per-matcher loop of
``GrammarMatcher.fill_next_token_bitmask``, at batch 1, 64 and 256, over a synthetic 128,256-entry vocabulary
(Llama 3's size: 128,000 byte-level tokens and 256 special ones), for a JSON schema and for ``json_object``,
each matcher advanced first through a prefix of a valid output (cut at a different point per matcher, so the
batch mixes states: keys, strings, numbers, between fields), compiled as the engine compiles them (at most
MAX_WHITESPACE whitespace characters in a row), and the same schema compact; plus "in a string", the state with
the most allowed tokens, and ``format: email``'s domain part, the dearest state we found. The device side is the int32 bitmask's upload, its unpacking to a bool mask and a
``masked_fill`` of the [B, 128256] float32 logits (on CUDA when there is one, else on the CPU), and
xgrammar's own ``apply_token_bitmask_inplace`` beside it. A decode step's forward is the budget these costs
hide in (the fill runs on the host while the GPU runs the forward); see RESULTS.md for the step times.

``--throughput``: on ``--model`` or ``--shape`` (random weights drawn on the device, ``load_format="dummy"``;
shapes have no tokenizer, so a byte-level BPE one with the shape's vocabulary size, the synthetic vocabulary
above, is written beside the config), 64 concurrent requests of 256 output tokens (temperature 1, ignore_eos)
under a JSON schema (a page of 16 records: its shortest valid output is longer than 256 tokens, so every request
runs its 256), with the default whitespace and compact (``disable_any_whitespace``), against the same 64
requests unconstrained, alternating, in one process: output tok/s of each and the ratios. Random weights spend
much of a default-whitespace output in whitespace (its share is reported); the compact run's states (strings
filled to maxLength, integers, enums) are closer to a real model's. Then the time to first token of one request:
unconstrained, under the first schema the engine sees (tokenizer tables included), under a new schema (cold:
its compile included) and under the same schema again (cached).

    python benchmarks/bench_structured.py --mask-cost                         # < 1 min on a CPU
    python benchmarks/bench_structured.py --throughput --shape llama-3.1-8b   # the GPU machine
    python benchmarks/bench_structured.py --throughput --smoke                # built-in model, 4 x 16, CPU

Tables are printed as markdown and also written under $OUT when it is set (structured_mask.md,
structured_throughput.md and .json).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

VOCAB_SIZE = 128256  # Llama 3
NUM_SPECIAL = 256  # Llama 3's <|begin_of_text|>, <|end_of_text|>, reserved ... at the top of the vocabulary

# The schema of the mask-cost rows and the throughput run: a page of records, as an API would ask for.
RECORD = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "name": {"type": "string", "minLength": 1, "maxLength": 48},
        "email": {"type": "string", "pattern": "^[a-z0-9._]{1,24}@[a-z0-9-]{1,24}\\.(com|org|net|io)$"},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 32},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["id", "name", "email", "score", "active", "role", "tags", "address"],
    "additionalProperties": False,
}


def page_schema(num_records: int, title: str = "page") -> dict[str, Any]:
    """``num_records`` records exactly: each has eight required fields (some 40 tokens at the least), so a
    page of 16 needs more than 256 tokens whatever the model draws."""
    return {"title": title, "type": "object",
            "properties": {"page": {"type": "integer", "minimum": 1, "maximum": 1000},
                           "records": {"type": "array", "items": RECORD,
                                       "minItems": num_records, "maxItems": num_records}},
            "required": ["page", "records"], "additionalProperties": False}


# ``format: email`` compiles to xgrammar's full address grammar (quoted local parts and all): its states cost
# one to two orders of magnitude more per fill than a pattern's (the throughput schema uses a pattern).
EMAIL_SCHEMA = {"type": "object", "properties": {"email": {"type": "string", "format": "email"}},
                "required": ["email"]}

SAMPLE_RECORD = {"id": 4217, "name": "Ada Lovelace", "email": "ada@example.org", "score": 97, "active": True,
                 "role": "editor", "tags": ["math", "engines"], "address": {"city": "London", "zip": "01815"}}
SAMPLE_OBJECT = {"title": "Notes on the Analytical Engine", "year": 1843, "pages": [1, 2, 3],
                 "authors": [{"name": "Ada Lovelace", "role": "translator"}], "draft": False,
                 "summary": "It might act upon other things besides number."}


# ---------------------------------------------------------------------------------------------- vocabulary

def synthetic_vocab(size: int = VOCAB_SIZE, num_special: int = NUM_SPECIAL, seed: int = 0) -> list[bytes]:
    """A byte-level vocabulary shaped like a modern BPE one (Llama 3's mix, roughly): the 256 bytes; every
    1-3 digit number; runs of spaces, newlines and indents; punctuation clusters and JSON-ish fragments
    (``\\",``, ``{\\"``, ``\\":``), with and without a leading space; English-like words and code identifiers in
    lower case, capitalised and upper case, with and without a leading space; non-Latin words and CJK
    characters (multi-byte UTF-8) and a few bare UTF-8 fragments. Seeded, so every run builds the same one.
    The last ``num_special`` entries are empty (special tokens: they decode to nothing)."""
    rng = random.Random(seed)
    regular = size - num_special
    vocab: list[bytes] = [bytes([b]) for b in range(256)]
    seen = set(vocab)

    def add(tok: str | bytes) -> None:
        b = tok.encode() if isinstance(tok, str) else tok
        if b and b not in seen and len(vocab) < regular:
            seen.add(b)
            vocab.append(b)

    for n in range(1000):
        add(str(n))
        if n < 100:
            add(f"{n:02d}")
        if n < 10:
            add(f"{n:03d}")
    for k in range(2, 17):
        add(" " * k)
        add("\t" * min(k, 6))
        add("\n" * min(k, 4))
        add("\n" + " " * k)
        add("\n" + "\t" * min(k, 6))
    punct = list("{}[]\"':,.;()<>/\\!?-_=+*&%$#@|~`^")
    for frag in ('":', '",', '":"', '","', '{"', '"}', '["', '"]', '},', '},{', '}]', '],', '":{', '":[', '": "',
                 '", "', '": ', '\\"', '\\n', '"\n', '",\n', '{\n', '}\n', '[\n', ']\n', '...', '->', '=>', '==',
                 '!=', '<=', '>=', '://', '//', '/*', '*/', '#!', '\'s', "n't", '\'re', '()', '();', '{}', '[]'):
        add(frag)
        add(" " + frag)
    while len(vocab) < 6000:
        s = "".join(rng.choice(punct) for _ in range(rng.choice((2, 2, 3, 3, 4))))
        add(s)
        add(" " + s)
    consonants, vowels = "bcdfghjklmnprstvwxyz" * 3 + "qjxz", "aeiouy" * 3 + "ae"

    def word() -> str:
        n = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        w = "".join(rng.choice(consonants) + rng.choice(vowels) + (rng.choice(consonants) if rng.random() < 0.4 else "")
                    for _ in range(n))
        return w[: rng.randint(2, 12)]

    cyrillic, greek = "абвгдежзийклмнопрстуфхцчшщыэюя", "αβγδεζηθικλμνξοπρστυφχψω"
    accented = "abcdeéèêfghiîïjklmnoôöpqrstuùüvwxyzàâçñß"
    n_latin, n_code, n_other = int(regular * 0.70), int(regular * 0.12), int(regular * 0.12)
    while len(vocab) < 6000 + n_latin:
        w = word()
        case = rng.random()
        w = w.capitalize() if case < 0.2 else w.upper() if case < 0.25 else w
        add((" " if rng.random() < 0.55 else "") + w)
    while len(vocab) < 6000 + n_latin + n_code:
        parts = [word() for _ in range(rng.randint(1, 3))]
        style = rng.random()
        ident = ("_".join(parts) if style < 0.4 else parts[0] + "".join(p.capitalize() for p in parts[1:])
                 if style < 0.7 else "." + parts[0] if style < 0.85 else "_" + parts[0])
        add((" " if rng.random() < 0.3 else "") + ident)
    while len(vocab) < 6000 + n_latin + n_code + n_other:
        r = rng.random()
        if r < 0.35:
            s = "".join(chr(rng.randint(0x4E00, 0x9FFF)) for _ in range(rng.choice((1, 1, 1, 2))))
        elif r < 0.6:
            s = "".join(rng.choice(cyrillic) for _ in range(rng.randint(2, 8)))
        elif r < 0.7:
            s = "".join(rng.choice(greek) for _ in range(rng.randint(2, 6)))
        else:
            s = "".join(rng.choice(accented) for _ in range(rng.randint(2, 9)))
        add((" " if rng.random() < 0.5 else "") + s)
    while len(vocab) < regular:
        if rng.random() < 0.1:  # a fragment of a multi-byte character, as byte-level BPE vocabularies have
            add(chr(rng.randint(0x3040, 0xD7FF)).encode()[: rng.randint(1, 2)])
        else:
            add((" " if rng.random() < 0.5 else "") + word() + word())
    return vocab + [b""] * num_special


def tokenizer_info(vocab: list[bytes], eos: int) -> Any:
    import xgrammar

    return xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[eos])


_BYTE_TO_UNICODE: dict[int, str] = {}


def _byte_level(b: bytes) -> str:
    """GPT-2's byte-to-unicode alphabet (what ``pre_tokenizers.ByteLevel`` writes tokens in)."""
    if not _BYTE_TO_UNICODE:
        printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
            list(range(ord("®"), ord("ÿ") + 1))
        extra = 0
        for x in range(256):
            if x in printable:
                _BYTE_TO_UNICODE[x] = chr(x)
            else:
                _BYTE_TO_UNICODE[x] = chr(256 + extra)
                extra += 1
    return "".join(_BYTE_TO_UNICODE[x] for x in b)


def write_tokenizer(out: Path, vocab_size: int, bos: int, eos: int) -> Path:
    """A byte-level BPE tokenizer (HF fast) with the synthetic vocabulary of ``vocab_size`` entries: its
    top ``NUM_SPECIAL`` ids (or fewer, to hold bos/eos) are special tokens, bos and eos among them. It has no
    merges, so text encodes to bytes; the engine only decodes, and xgrammar reads its vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if (out / "tokenizer.json").is_file():
        return out
    num_special = min(NUM_SPECIAL, vocab_size - 256)
    raw = synthetic_vocab(vocab_size, num_special)
    vocab = {_byte_level(b): i for i, b in enumerate(raw[: vocab_size - num_special])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    names = {bos: "<|begin_of_text|>", eos: "<|end_of_text|>"}
    specials = [names.get(i, f"<|reserved_special_token_{i}|>") for i in range(vocab_size - num_special, vocab_size)]
    tok.add_special_tokens(specials)
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=names.get(bos, specials[0]),
                                   eos_token=names.get(eos, specials[1]))
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    return out


# ----------------------------------------------------------------------------------------------- mask cost

def _timeit(fn, reps: int) -> float:
    """Median seconds of ``reps`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _device_timeit(fn, reps: int, device: str) -> float:
    if device != "cuda":
        return _timeit(fn, reps)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=max(20, reps)) / 1e3


def _prefix_matchers(compiled: Any, document: str, batch: int, lo: int, hi: int, rng: random.Random) -> list[Any]:
    """``batch`` matchers, each advanced through ``document[:cut]`` for a cut drawn from [lo, hi)."""
    import xgrammar

    matchers = []
    for _ in range(batch):
        cut = rng.randrange(lo, hi)
        m = xgrammar.GrammarMatcher(compiled)
        if not m.accept_string(document[:cut]):
            raise RuntimeError(f"the sample document's prefix {document[:cut]!r} is not accepted")
        matchers.append(m)
    return matchers


def unpack_and_mask(logits: torch.Tensor, bitmask_host: torch.Tensor) -> torch.Tensor:
    """The device side of one constrained step, as the engine's sampler runs it: upload the int32 bitmask,
    unpack its bits (bit j of word w allows token 32 w + j) and set the disallowed logits to -inf."""
    from minfer.engine.sampler import apply_token_bitmask

    return apply_token_bitmask(logits, bitmask_host.to(logits.device, non_blocking=True))


class _Row:
    """What ``BitmaskFiller.fill`` reads of a sequence."""

    def __init__(self, matcher: Any) -> None:
        self.grammar, self.is_finished = matcher, False


def mask_cost(batches: tuple[int, ...] = (1, 64, 256), reps: int = 10) -> str:
    import xgrammar

    t0 = time.perf_counter()
    vocab = synthetic_vocab()
    info = tokenizer_info(vocab, eos=128001)
    t_vocab = time.perf_counter() - t0
    compiler = xgrammar.GrammarCompiler(info, max_threads=os.cpu_count() or 1)
    from minfer.structured_grammar import MAX_WHITESPACE

    ws = dict(any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE)  # as the engine compiles JSON
    t0 = time.perf_counter()
    schema = compiler.compile_json_schema(json.dumps(page_schema(2)), strict_mode=True, **ws)
    t_schema = time.perf_counter() - t0
    t0 = time.perf_counter()
    any_object = compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **ws)  # json_object
    t_json = time.perf_counter() - t0
    email = compiler.compile_json_schema(json.dumps(EMAIL_SCHEMA), strict_mode=True, **ws)
    compact = compiler.compile_json_schema(json.dumps(page_schema(2)), strict_mode=True, any_whitespace=False)
    page = json.dumps({"page": 3, "records": [SAMPLE_RECORD, dict(SAMPLE_RECORD, id=9, name="Charles Babbage")]})
    doc = json.dumps(SAMPLE_OBJECT)
    contact = json.dumps({"email": "ada@example.org"})

    def at(document: str, text: str) -> tuple[str, int, int]:  # one cut: just after text's first occurrence
        cut = document.index(text) + len(text)
        return document, cut, cut + 1

    cases = [  # label, compiled grammar, document, cuts [lo, hi): all but the first and last few characters
        ("schema, mixed states", schema, page, 5, len(page) - 5),
        ("schema, compact (disable_any_whitespace)", compact, page, 5, len(page) - 5),  # ", " and ": " only
        ("schema, in a string (name)", schema, *at(page, '"Ada')),  # the most allowed tokens
        ("format email, in the domain", email, *at(contact, '"ada@exam')),  # xgrammar's email rule: dear
        ("json_object, mixed states", any_object, doc, 5, len(doc) - 5),
    ]
    from minfer.engine.grammar import BitmaskFiller

    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch_matcher = xgrammar.BatchGrammarMatcher()
    filler = BitmaskFiller(VOCAB_SIZE, max(batches), torch.device(device))  # fill + upload
    rng = random.Random(0)
    rows = []
    threads = max(1, (os.cpu_count() or 2) // 2)
    for label, compiled, document, lo, hi in cases:
        for b in batches:
            matchers = _prefix_matchers(compiled, document, b, lo, hi, rng)
            bitmask = xgrammar.allocate_token_bitmask(b, VOCAB_SIZE)  # int32 [b, 4008], pinned-able host memory
            if device == "cuda":
                bitmask = bitmask.pin_memory()
            t_batch = _timeit(lambda: batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask), reps)
            t_indexed = _timeit(lambda: batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask, list(range(b))),
                                reps)

            def loop() -> None:
                for i, m in enumerate(matchers):
                    m.fill_next_token_bitmask(bitmask, i)
            t_loop = _timeit(loop, reps)
            seqs = [_Row(m) for m in matchers]
            t_engine = _timeit(lambda: filler.fill(seqs), reps)
            allowed = int(sum(bin(int(w) & 0xFFFFFFFF).count("1") for w in bitmask[0].tolist()))
            logits = torch.randn(b, VOCAB_SIZE, device=device)
            t_apply = _device_timeit(lambda: unpack_and_mask(logits, bitmask), reps, device)
            bits_dev = bitmask.to(device)
            try:
                t_xg = _device_timeit(lambda: xgrammar.apply_token_bitmask_inplace(logits, bits_dev), reps, device)
            except Exception as exc:  # noqa: BLE001 - a backend this machine lacks: say so in the table
                t_xg, _ = float("nan"), print(f"apply_token_bitmask_inplace failed: {exc}", file=sys.stderr)
            rows.append((label, b, allowed, t_batch, t_indexed, t_loop, t_engine, t_apply, t_xg))
    lines = [
        f"Token-bitmask costs, vocabulary {VOCAB_SIZE:,} (synthetic byte-level, {NUM_SPECIAL} special); host: "
        f"{os.cpu_count()} CPU cores, BatchGrammarMatcher threads 'auto' (half the cores: {threads}); device side on "
        f"{device}"
        f"{' (' + torch.cuda.get_device_name() + ')' if device == 'cuda' else ''}. Medians of {reps}.",
        f"One-time: TokenizerInfo {t_vocab * 1e3:.0f} ms (vocabulary built in Python included), schema compile "
        f"{t_schema * 1e3:.0f} ms, json_object compile {t_json * 1e3:.0f} ms.",
        "",
        "| case | batch | allowed tokens (row 0) | batch fill ms | batch fill, rows indexed ms | per-matcher loop ms | "
        "fill µs / row | engine's BitmaskFiller.fill (+ upload) ms | upload + unpack + masked_fill ms | xgrammar apply ms |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, b, allowed, t_batch, t_indexed, t_loop, t_engine, t_apply, t_xg in rows:
        lines.append(f"| {label} | {b} | {allowed:,} | {t_batch * 1e3:.3f} | {t_indexed * 1e3:.3f} | {t_loop * 1e3:.3f} | "
                     f"{t_batch / b * 1e6:.1f} | {t_engine * 1e3:.3f} | {t_apply * 1e3:.3f} | {t_xg * 1e3:.3f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- throughput

def _model_and_tokenizer(args: argparse.Namespace) -> tuple[str, str | None, str]:
    """The checkpoint folder, the tokenizer folder to pass (None: the checkpoint's own) and a label."""
    if args.smoke:
        from minfer.llm import builtin_model_path

        return str(builtin_model_path()), None, "built-in model"
    if args.shape:
        from minfer.benchmark.shapes import SHAPES, write_shape_config

        model = write_shape_config(args.shape, Path(args.checkpoint_dir) / f"{args.shape}-dummy")
        cfg = SHAPES[args.shape]
        tok = write_tokenizer(Path(args.checkpoint_dir) / f"{args.shape}-tokenizer", cfg["vocab_size"],
                              cfg["bos_token_id"], cfg["eos_token_id"])
        return str(model), str(tok), f"{args.shape} (random weights, synthetic tokenizer)"
    if not args.model:
        raise SystemExit("--throughput needs --model, --shape or --smoke")
    model = Path(args.model)
    has_tok = any((model / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))
    if has_tok or not model.is_dir():
        return str(model), None, str(model)
    cfg = json.loads((model / "config.json").read_text())
    tok = write_tokenizer(model.with_name(model.name + "-tokenizer"), cfg["vocab_size"], cfg.get("bos_token_id", 0),
                          cfg.get("eos_token_id", 1) if isinstance(cfg.get("eos_token_id", 1), int)
                          else cfg["eos_token_id"][0])
    return str(model), str(tok), f"{model} (synthetic tokenizer)"


def _run(llm: Any, prompts: list[dict], params: list[Any]) -> tuple[float, list[Any]]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, outs


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    from minfer import LLM, SamplingParams
    from minfer.structured_outputs import StructuredOutputsParams

    n, out_len, in_len = (4, 16, 32) if args.smoke else (args.num_requests, args.output_len, args.input_len)
    model, tokenizer, label = _model_and_tokenizer(args)
    kwargs: dict[str, Any] = dict(max_model_len=in_len + out_len + 64)
    if Path(model).is_dir() and not any(Path(model).glob("*.safetensors")):
        kwargs["load_format"] = "dummy"  # a config alone (a shape's): weights drawn on the device as it loads
    if tokenizer:
        kwargs["tokenizer"] = tokenizer
    if args.num_kv_blocks:
        kwargs["num_kv_blocks"] = args.num_kv_blocks
    t = time.perf_counter()
    llm = LLM(model, **kwargs)
    print(f"engine ready in {time.perf_counter() - t:.0f} s: {label}", flush=True)
    vocab = llm.llm_engine.model_config.vocab_size
    rng = random.Random(0)
    top = min(vocab - NUM_SPECIAL, 100000)  # regular tokens only
    prompts = [{"prompt_token_ids": [rng.randrange(3, top) for _ in range(in_len)]} for _ in range(n)]
    schema = page_schema(16)

    def params(structured: StructuredOutputsParams | None, i: int, max_tokens: int = out_len) -> Any:
        return SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True,
                              structured_outputs=structured)

    # warm-up: the forward's kernels and graphs, the grammar machinery (tokenizer tables) on a first schema,
    # timed as "first constrained request"; then the TTFT rows, then throughput
    _run(llm, prompts[:2], [params(None, i, 4) for i in range(2)])
    ttft: dict[str, float] = {}

    def one(name: str, structured: StructuredOutputsParams | None) -> None:
        _, outs = _run(llm, prompts[:1], [params(structured, 0, 4)])
        m = outs[0].metrics
        ttft[name] = m.first_token_time - m.arrival_time

    one("unconstrained", None)
    one("first constrained request (tokenizer tables + compile)",
        StructuredOutputsParams(json=page_schema(3, "warm-up")))
    one("cold schema (compile)", StructuredOutputsParams(json=page_schema(5, "cold")))
    one("cached schema (same schema again)", StructuredOutputsParams(json=page_schema(5, "cold")))
    one("unconstrained, again", None)
    modes = {"unconstrained": None, "json schema": StructuredOutputsParams(json=schema),
             "json schema, compact": StructuredOutputsParams(json=schema, disable_any_whitespace=True)}
    for so in modes.values():  # the throughput schemas compiled before timing
        if so is not None:
            _run(llm, prompts[:1], [params(so, 0, 2)])

    runs: dict[str, list[dict[str, float]]] = {name: [] for name in modes}
    samples: dict[str, list[str]] = {}
    whitespace: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, so in modes.items():
            wall, outs = _run(llm, prompts, [params(so, i) for i in range(n)])
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            runs[name].append({"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
                               "finished_by_grammar": sum(c.finish_reason == "stop" for o in outs for c in o.outputs)})
            if so is not None:
                texts = [o.outputs[0].text for o in outs]
                samples[name] = [t[:300] for t in texts[:2]]
                chars = sum(len(t) for t in texts)
                whitespace[name] = sum(t.count(" ") + t.count("\n") + t.count("\t") for t in texts) / max(1, chars)
    best = {k: max(r["output_tok_s"] for r in v) for k, v in runs.items()}
    stats = llm.get_stats()
    return {
        "model": label, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "num_requests": n, "input_len": in_len, "output_len": out_len, "repeats": args.repeats,
        "runs": runs, "best_output_tok_s": best,
        "ratio": {k: v / best["unconstrained"] for k, v in best.items() if k != "unconstrained"},
        "whitespace_share": whitespace, "ttft_s": ttft,
        "grammar_compile_seconds": stats.get("grammar_compile_seconds"),
        "num_preemptions": stats.get("num_preemptions"), "sample_output_head": samples,
    }


def throughput_table(r: dict[str, Any]) -> str:
    lines = [f"Structured outputs on {r['model']}, {r['device']}: {r['num_requests']} concurrent requests, "
             f"{r['input_len']} prompt tokens, {r['output_len']} output tokens each (temperature 1, ignore_eos), "
             f"best of {r['repeats']} alternating runs.", "",
             "| requests | output tok/s (best) | ratio to unconstrained (target >= 0.90) | runs: output tok/s "
             "| output tokens | whitespace share of the text |", "|---|---|---|---|---|---|"]
    for name, runs in r["runs"].items():
        ratio = f"{r['ratio'][name]:.3f}" if name in r["ratio"] else "1"
        ws = f"{100 * r['whitespace_share'][name]:.0f}%" if name in r["whitespace_share"] else ""
        lines.append(f"| {name} | {r['best_output_tok_s'][name]:,.1f} | {ratio} | "
                     f"{', '.join(format(x['output_tok_s'], ',.1f') for x in runs)} | {runs[-1]['output_tokens']:,} "
                     f"| {ws} |")
    lines += ["",
              "| one request | time to first token ms |", "|---|---|"]
    lines += [f"| {k} | {v * 1e3:,.1f} |" for k, v in r["ttft_s"].items()]
    lines += ["", f"grammar_compile_seconds: {r['grammar_compile_seconds']}; preemptions: {r['num_preemptions']}"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mask-cost", action="store_true", help="the bitmask fill and apply costs (part a)")
    p.add_argument("--throughput", action="store_true", help="engine throughput and TTFT (part b)")
    p.add_argument("--smoke", action="store_true", help="with --throughput: the built-in model, 4 x 16 tokens")
    p.add_argument("--model", default=None)
    p.add_argument("--shape", default=None, help="a BENCHMARKS.md shape, e.g. llama-3.1-8b (random weights)")
    p.add_argument("--checkpoint-dir", default="/tmp/minfer-shapes")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--reps", type=int, default=10, help="--mask-cost: timed repetitions per row")
    args = p.parse_args()
    if not (args.mask_cost or args.throughput):
        p.error("give --mask-cost and/or --throughput")
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    if args.mask_cost:
        table = mask_cost(reps=args.reps)
        print(table, flush=True)
        if out:
            (out / "structured_mask.md").write_text(table + "\n")
    if args.throughput:
        result = throughput(args)
        table = throughput_table(result)
        print(table, flush=True)
        if out:
            (out / "structured_throughput.md").write_text(table + "\n")
            (out / "structured_throughput.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
