"""Choose the built-in model: train candidate shapes side by side, keep the best on held-out text.

Every candidate fits the 16 MiB budget of ``minfer/assets/builtin-model`` in bfloat16 with its
tokenizer. All run at once on one GPU (a model this small leaves an H200 mostly idle), each
with the same ``--max-time``, so the comparison is at equal wall-clock budget. They are ranked
by held-out **bits per byte**: per-token loss is not comparable across vocabularies (a 4k
vocabulary cuts text into more, easier tokens), nats per byte of source are.

    python benchmarks/train_sweep.py --out runs/sweep --max-time 400     # GPU, stdlib corpus
    python benchmarks/train_sweep.py --tiny --out /tmp/sweep CORPUS_DIR  # CPU smoke test

Writes OUT/<candidate>/ (each a full ``minfer train`` folder), OUT/tokenizers/v<V>/,
OUT/best/ (the winner's HF files) and OUT/table.md + OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minfer.train.corpus import load_corpus, texts  # noqa: E402
from minfer.train.export import HF_FILES  # noqa: E402
from minfer.train.tokenizer import save_tokenizer, train_tokenizer  # noqa: E402


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    dropout: float = 0.1
    lr: float = 2e-3


# About 8.0M parameters each (a tied 8k x 256 embedding alone is 2.1M), 15.5-15.8 MiB with
# the tokenizer: depth against width, 8k against 4k vocabulary, dropout against none.
CANDIDATES = (
    Candidate("d256-l8", 8192, 256, 8, 4, 2, 704),
    Candidate("d256-l8-nodrop", 8192, 256, 8, 4, 2, 704, dropout=0.0),
    Candidate("d320-l5", 8192, 320, 5, 5, 1, 864),
    Candidate("d192-l16", 8192, 192, 16, 3, 1, 512),
    Candidate("v4k-d256-l9", 4096, 256, 9, 4, 2, 768),
    Candidate("v4k-d192-l18", 4096, 192, 18, 3, 1, 512),
)
TINY = (  # CPU smoke test of the whole pipeline
    Candidate("tiny-a", 320, 32, 2, 4, 2, 64, lr=1e-2),
    Candidate("tiny-b", 300, 32, 1, 2, 1, 64, dropout=0.0, lr=1e-2),
)


def train_tokenizers(corpus_paths: list[str], vocabs: set[int], out: Path,
                     seq_len: int) -> dict[int, Path]:
    corpus = load_corpus(corpus_paths or None)
    print(f"corpus: {corpus.describe()}", flush=True)
    found = {}
    for vocab in sorted(vocabs):
        t0 = time.perf_counter()
        folder = out / "tokenizers" / f"v{vocab}"
        save_tokenizer(train_tokenizer(texts(corpus.train), vocab), folder, seq_len)
        print(f"tokenizer v{vocab}: {time.perf_counter() - t0:.1f}s", flush=True)
        found[vocab] = folder
    return found


def launch(c: Candidate, args: argparse.Namespace, tokenizer: Path) -> subprocess.Popen:
    folder = args.out / c.name
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "minfer.train.command", *args.corpus, "--out", str(folder),
           "--tokenizer", str(tokenizer), "--hidden-size", str(c.hidden),
           "--layers", str(c.layers), "--heads", str(c.heads), "--kv-heads", str(c.kv_heads),
           "--intermediate-size", str(c.ffn), "--dropout", str(c.dropout), "--lr", str(c.lr),
           "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--eval-every", str(args.eval_every), "--max-time", str(args.max_time),
           "--device", args.device, "--seed", str(args.seed), "--dtype", "bfloat16"]
    print(" ".join(cmd), flush=True)
    log = open(folder / "train.log", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def table(rows: list[dict]) -> str:
    head = ("| candidate | vocab | hidden x layers | heads/kv | ffn | dropout | params | MiB "
            "| val loss (nats/token) | val ppl | bits/byte | tokens/s | tokens seen | epochs "
            "| best step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "val_loss" not in r:
            lines.append(f"| {r['name']} | failed (see {r['name']}/train.log) |")
            continue
        lines.append(
            f"| {r['name']} | {r['vocab_size']} | {r['hidden_size']} x {r['layers']} "
            f"| {r['heads']}/{r['kv_heads']} | {r['intermediate_size']} | {r['dropout']} "
            f"| {r['params'] / 1e6:.2f}M | {r['checkpoint_mib']:.2f} | {r['val_loss']:.4f} "
            f"| {r['val_ppl']:.2f} | {r['val_bits_per_byte']:.4f} | {r['tokens_per_s']:,} "
            f"| {r['tokens_seen'] / 1e6:.1f}M | {r['epochs']} | {r['best_step']}/{r['steps']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("corpus", nargs="*", help="corpus paths (default: this interpreter's stdlib)")
    p.add_argument("--out", type=Path, default=Path("runs/sweep"))
    p.add_argument("--max-time", type=float, default=400.0, help="seconds per candidate")
    p.add_argument("--only", nargs="*", default=None, help="candidate names to run")
    p.add_argument("--tiny", action="store_true", help="tiny CPU candidates (smoke test)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=1_000_000, help="cap; --max-time ends runs")
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.tiny:
        args.seq_len, args.batch_size, args.warmup, args.eval_every = 32, 8, 5, 20
    cands = [c for c in (TINY if args.tiny else CANDIDATES)
             if args.only is None or c.name in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    toks = train_tokenizers(args.corpus, {c.vocab for c in cands}, args.out, args.seq_len)
    procs = {c.name: launch(c, args, toks[c.vocab]) for c in cands}
    rows = []
    for c in cands:
        code = procs[c.name].wait()
        metrics_file = args.out / c.name / "train" / "metrics.json"
        row = {"name": c.name, "returncode": code}
        if code == 0 and metrics_file.is_file():
            row.update(json.loads(metrics_file.read_text()))
        rows.append(row)
        print(f"{c.name}: exit {code} {row.get('val_bits_per_byte', '')}", flush=True)
    done = sorted((r for r in rows if "val_bits_per_byte" in r),
                  key=lambda r: r["val_bits_per_byte"])
    rows = done + [r for r in rows if "val_bits_per_byte" not in r]
    (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    (args.out / "table.md").write_text(table(rows))
    print(table(rows), flush=True)
    if not done:
        print("no candidate finished", file=sys.stderr)
        return 1
    best = args.out / "best"
    best.mkdir(exist_ok=True)
    for f in HF_FILES:
        shutil.copy2(args.out / done[0]["name"] / f, best / f)
    print(f"best: {done[0]['name']} -> {best}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
