"""``minfer generate`` (text for prompts) and ``minfer eval-ppl`` (perplexity over files): one ``LLM`` each."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from minfer.engine_args import add_engine_args, engine_kwargs


def add_generate_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("generate", help="generate text for one or more prompts")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    add_engine_args(p)  # its --seed makes sampled outputs repeatable
    p.set_defaults(func=cmd_generate)
    return p


def add_eval_ppl_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("eval-ppl", help="token-level perplexity of a model over text files")
    p.add_argument("files", nargs="+")
    p.add_argument("--window", type=int, default=None, help="tokens per scored window (default: max_model_len - 1)")
    add_engine_args(p)
    p.set_defaults(func=cmd_eval_ppl)
    return p


def cmd_generate(args: argparse.Namespace) -> int:
    from minfer.llm import LLM
    from minfer.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            stop=args.stop or None)
    llm = LLM(args.model, **engine_kwargs(args))
    outs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, out in zip(args.prompts, outs):
        print(prompt + out.outputs[0].text)
        if len(outs) > 1:
            print("-" * 40)
    return 0


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from minfer.eval_ppl import evaluate_perplexity
    from minfer.llm import LLM

    files = [Path(f) for f in args.files]
    llm = LLM(args.model, **engine_kwargs(args))
    result = evaluate_perplexity(llm, files, args.window)
    print(json.dumps({"model": args.model or "built-in", "files": len(files), "window": result.window,
                      "perplexity": round(result.perplexity, 4), "nll_per_token": round(result.nll_per_token, 6),
                      "tokens_scored": result.num_tokens_scored, "windows": result.num_windows,
                      "kv_cache_dtype": args.kv_cache_dtype}, indent=2))
    return 0
