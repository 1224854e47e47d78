"""Training corpus: text files and folders, split into training and held-out documents.

The default corpus is the running interpreter's standard library (``*.py`` under
``sysconfig.get_paths()["stdlib"]``), tests included: ``Lib/test`` is more than half of the
stdlib's Python and a small model is starved of data far sooner than of compute.
Left out: ``site-packages`` (not the stdlib, and it differs from machine to machine),
``lib2to3/tests/data`` (Python 2 sources) and files that are not valid UTF-8. Which files a folder
contributes is ``minfer.eval_ppl.text_files_under``'s rule, so ``minfer eval-ppl`` on a folder scores
the text this module would train on.

Held-out set (validation loss, ``minfer eval-ppl``): whole packages, so that the model is
scored on code it has never seen rather than on neighbouring lines of files it trained on:
the ``email``, ``json`` and ``tomllib`` packages and their test packages
(``test/test_email``, ``test/test_json``, ``test/test_tomllib``), about 4% of the corpus.
For a corpus of your own the last documents, about 5% of the text, are held out instead (a single
document is cut at a line near 95%), unless ``heldout="packages"`` asks for the same package rule
relative to each folder given (falling back to the tail when it matches nothing).
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from minfer.eval_ppl import TEXT_PATTERNS, read_text, text_files_under

HELDOUT_PREFIXES: tuple[str, ...] = (
    "email/", "json/", "tomllib/",
    "test/test_email/", "test/test_json/", "test/test_tomllib/",
)
DEFAULT_PATTERNS: tuple[str, ...] = TEXT_PATTERNS
FALLBACK_HELDOUT_FRACTION = 0.05


@dataclass(slots=True)
class Document:
    path: Path
    text: str


@dataclass(slots=True)
class Corpus:
    train: list[Document] = field(default_factory=list)
    val: list[Document] = field(default_factory=list)
    split: str = "packages"  # "packages" (the HELDOUT_PREFIXES rule) or "tail" (fallback)
    skipped: list[Path] = field(default_factory=list)  # unreadable or not UTF-8

    @property
    def train_bytes(self) -> int:
        return sum(len(d.text.encode("utf-8")) for d in self.train)

    @property
    def val_bytes(self) -> int:
        return sum(len(d.text.encode("utf-8")) for d in self.val)

    def describe(self) -> str:
        return (f"{len(self.train)} training documents ({self.train_bytes / 1e6:.2f} MB), "
                f"{len(self.val)} held-out ({self.val_bytes / 1e6:.2f} MB, split={self.split})"
                + (f", {len(self.skipped)} skipped (not UTF-8)" if self.skipped else ""))


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative: str | PurePosixPath) -> bool:
    """Whether a path, relative to its corpus root, belongs to the held-out packages."""
    rel = str(PurePosixPath(relative))
    return any(rel.startswith(p) for p in HELDOUT_PREFIXES)


def _walk(root: Path, patterns: Sequence[str]) -> list[tuple[Path, Path]]:
    """(file, root) pairs under a folder, sorted for a reproducible corpus order."""
    return [(path, root) for path in text_files_under(root, patterns)]


def collect_files(paths: Sequence[str | Path] | None = None,
                  patterns: Sequence[str] | None = None) -> list[tuple[Path, Path]]:
    """Resolve command-line paths to (file, root) pairs; ``root`` anchors the held-out rule.

    No paths means the stdlib with ``*.py``. A file named explicitly is always taken; a
    folder contributes the files matching ``patterns``.
    """
    if not paths:
        return _walk(stdlib_root(), patterns or ("*.py",))
    pats = tuple(patterns or DEFAULT_PATTERNS)
    found: list[tuple[Path, Path]] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise ValueError(f"corpus path does not exist: {p}")
        if p.is_dir():
            found.extend(_walk(p, pats))
        else:
            found.append((p, p.parent))
    return found


def heldout_files(root: str | Path | None = None,
                  patterns: Sequence[str] = ("*.py",)) -> list[Path]:
    """The held-out files of a corpus folder (default: this interpreter's stdlib), sorted.

    ``minfer eval-ppl`` scores a model on these; they are the files ``minfer train`` never
    trains on when given the same folder (or no paths at all).
    """
    base = Path(root) if root is not None else stdlib_root()
    return [f for f, r in _walk(base, patterns) if is_heldout(f.relative_to(r).as_posix())]


def _tail_split(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """Hold out the last documents (~5% of the text); cut a lone document at a line."""
    total = sum(len(d.text) for d in docs)
    target = max(1, int(total * FALLBACK_HELDOUT_FRACTION))
    if len(docs) == 1:
        doc = docs[0]
        cut = len(doc.text) - target
        newline = doc.text.rfind("\n", 0, cut)
        cut = newline + 1 if newline > 0 else cut
        return [Document(doc.path, doc.text[:cut])], [Document(doc.path, doc.text[cut:])]
    val: list[Document] = []
    size = 0
    while size < target and len(val) < len(docs) - 1:
        val.insert(0, docs[-1 - len(val)])
        size += len(val[0].text)
    return docs[:len(docs) - len(val)], val


def load_corpus(paths: Sequence[str | Path] | None = None,
                patterns: Sequence[str] | None = None, heldout: str = "auto") -> Corpus:
    """Read and split the corpus; raises ValueError for a missing path or no text at all. ``heldout``:
    "packages" (HELDOUT_PREFIXES, falling back to the tail when they match nothing), "tail", or "auto"
    (packages for the default stdlib corpus, tail for any other)."""
    files = collect_files(paths, patterns)
    corpus = Corpus()
    docs: list[tuple[Document, bool]] = []
    for path, root in files:
        text = read_text(path)
        if text is None:
            corpus.skipped.append(path)
            continue
        if text.strip():
            docs.append((Document(path, text), is_heldout(path.relative_to(root).as_posix())))
    if not docs:
        where = ", ".join(map(str, paths)) if paths else str(stdlib_root())
        raise ValueError(f"the corpus is empty: no text found in {where}")
    if heldout == "tail" or (heldout == "auto" and paths):
        docs = [(d, False) for d, _ in docs]  # the tail split below
    corpus.train = [d for d, held in docs if not held]
    corpus.val = [d for d, held in docs if held]
    if not corpus.train or not corpus.val:
        corpus.split = "tail"
        corpus.train, corpus.val = _tail_split([d for d, _ in docs])
    return corpus


def texts(docs: Iterable[Document]) -> list[str]:
    return [d.text for d in docs]
