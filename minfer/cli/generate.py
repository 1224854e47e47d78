"""``minfer generate`` (text for prompts) and ``minfer eval-ppl`` (perplexity over files): one ``LLM`` each."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from minfer.engine_args import EngineArgs, engine_kwargs


_SAMPLING_FLAGS = {  # flag -> (type, help); unset flags take the model's generation_config.json, then vLLM's defaults
    "temperature": (float, "0 is greedy (default: the model's, else 1.0)"),
    "top_p": (float, "keep the smallest set of tokens whose probability reaches this (default: the model's, else 1)"),
    "top_k": (int, "keep the k most likely tokens; 0 keeps all (default: the model's, else 0)"),
    "min_p": (float, "drop tokens below this share of the most likely one's probability (default: the model's, else 0)"),
    "repetition_penalty": (float, "> 1 discourages repeating prompt and output tokens (default: the model's, else 1)"),
}


def add_generate_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate text for one or more prompts",
                              description="Generate text for each prompt; with one prompt the text streams as it is "
                                          "produced. Sampling flags left out take the model's generation_config.json "
                                          "(the command says which it used).")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate per prompt (default: 128)")
    for name, (kind, help_text) in _SAMPLING_FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help=help_text)
    p.add_argument("--stop", action="append", type=unescape,
                   help="stop string (repeatable); backslash escapes \\n, \\t and \\\\ are read as such")
    EngineArgs.add_cli_args(p)  # its --seed makes sampled outputs repeatable
    p.set_defaults(func=cmd_generate)
    return p


def unescape(text: str) -> str:
    """``\\n``, ``\\t``, ``\\r`` and ``\\\\`` in a command-line stop string as the characters a shell cannot
    pass easily (``--stop "\\n\\n"`` stops at a blank line); other characters, non-ASCII too, stay as they are."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "ntr\\":
            out.append({"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def add_eval_ppl_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval-ppl", help="token-level perplexity of a model over text files")
    p.add_argument("files", nargs="+", help="text files, or folders (every file below them)")
    p.add_argument("--window", type=int, default=None, help="tokens per scored window (default: max_model_len - 1)")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=cmd_eval_ppl)
    return p


def cmd_generate(args: argparse.Namespace) -> int:
    from minfer.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))  # whole text every step: one prompt streams
    params, source = sampling_params(engine.processor.sampling_defaults, args)
    print(f"minfer generate: sampling with {source}", file=sys.stderr)
    for i, prompt in enumerate(args.prompts):
        engine.add_request(str(i), prompt, params)
    stream = len(args.prompts) == 1
    holdback = max((len(s) for s in params.stop_strings), default=1) - 1
    finals: dict[str, str] = {}
    shown = 0
    if stream:
        sys.stdout.write(args.prompts[0])
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            if out.finished:
                finals[out.request_id] = text
            if stream:  # text that may be the start of a stop string waits until the end (it would be cut)
                end = len(text) if out.finished else max(shown, len(text) - holdback)
                sys.stdout.write(text[shown:end])
                sys.stdout.flush()
                shown = end
    if stream:
        sys.stdout.write("\n")
        return 0
    for i, prompt in enumerate(args.prompts):
        print(prompt + finals[str(i)])
        print("-" * 40)
    return 0


def sampling_params(defaults: dict[str, Any], args: argparse.Namespace) -> tuple[Any, str]:
    """The request's SamplingParams: the flags given, over the model's defaults; and a line saying which."""
    from minfer.sampling_params import SamplingParams

    given = {name: getattr(args, name) for name in _SAMPLING_FLAGS if getattr(args, name) is not None}
    chosen = {**{k: v for k, v in defaults.items() if k in _SAMPLING_FLAGS}, **given}
    params = SamplingParams(max_tokens=args.max_tokens, stop=args.stop or None, **chosen)
    shown = ", ".join(f"{k}={getattr(params, k)}" for k in _SAMPLING_FLAGS)
    origin = ("the model's generation_config.json" + (" and the flags given" if given else "")) if defaults \
        else "the flags given and SamplingParams' defaults"
    return params, f"{shown} ({origin})"


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from minfer.eval_ppl import evaluate_perplexity, text_files
    from minfer.llm import LLM

    files = text_files(args.files)  # before the model loads: a wrong path fails at once
    llm = LLM(args.model, **engine_kwargs(args))
    result = evaluate_perplexity(llm, files, args.window, progress=True)
    print(json.dumps({"model": args.model or "built-in", "files": len(files), "window": result.window,
                      "perplexity": round(result.perplexity, 4), "nll_per_token": round(result.nll_per_token, 6),
                      "tokens_scored": result.num_tokens_scored, "windows": result.num_windows,
                      "kv_cache_dtype": args.kv_cache_dtype}, indent=2))
    return 0
