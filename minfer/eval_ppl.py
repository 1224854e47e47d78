"""Token-level perplexity of a model over text files, computed by the engine (prompt logprobs).

Each file is tokenized whole and cut into non-overlapping windows that fit the model length;
every token of a window but its first is scored given the tokens before it in that window.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

from minfer.llm import LLM
from minfer.sampling_params import SamplingParams

logger = logging.getLogger("minfer")


@dataclass(slots=True)
class PerplexityResult:
    perplexity: float
    nll_per_token: float
    num_tokens_scored: int
    num_windows: int
    window: int  # tokens per window


def text_files(paths: list[Path | str]) -> list[Path]:
    """The files to score: files as given, folders by every file below them (sorted). Checked before any
    model loads, so a wrong path fails at once."""
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            below = sorted(p for p in path.rglob("*") if p.is_file())
            if not below:
                raise FileNotFoundError(f"the folder {path} holds no files")
            files += below
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"no such file or folder: {path}")
    if not files:
        raise ValueError("eval-ppl needs at least one text file")
    return files


def text_windows(llm: LLM, files: list[Path], window: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    windows = []
    for path in files:
        # verbose=False: the tokenizer's "sequence longer than the model's maximum" warning does not apply
        # (the ids are cut into windows next)
        ids = tok.encode(Path(path).read_text(encoding="utf-8", errors="replace"), verbose=False)
        windows += [ids[i:i + window] for i in range(0, len(ids) - 1, window)]  # each of >= 2 tokens
    return windows


def evaluate_perplexity(llm: LLM, files: list[Path], window: int | None = None,
                        progress: bool = False) -> PerplexityResult:
    """Perplexity over ``files`` (folders: every file below) in windows of ``window`` tokens (default:
    the longest the model takes)."""
    files = text_files(files)
    max_window = llm.llm_engine.max_model_len - 1
    if window is not None and window > max_window:
        logger.warning("--window %d is longer than max_model_len - 1 = %d: scoring windows of %d tokens",
                       window, max_window, max_window)
    window = min(window or max_window, max_window)
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    windows = text_windows(llm, files, window)
    if not windows:
        raise ValueError("the files hold fewer than two tokens: nothing to score")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=progress)
    nll, count = 0.0, 0
    for w, out in zip(windows, outs):
        for pos in range(1, len(w)):
            nll -= out.prompt_logprobs[pos][w[pos]]
            count += 1
    return PerplexityResult(math.exp(nll / count), nll / count, count, len(windows), window)
