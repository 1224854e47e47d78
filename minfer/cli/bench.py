"""``minfer bench``: offline throughput, batch-1 decode and the HF comparison (``minfer.benchmark.offline``).

On a machine without a GPU the run's time is estimated first, from the model's shape, the workload's lengths
and this CPU's measured rates (``offline.estimate_seconds``): a run past ``CPU_LIMIT_S`` is refused unless
``--allow-slow`` (workload A on the qwen3-0.6b shape: hours on 2 cores, where it used to start silently).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from minfer.benchmark.workload import BENCH_MAX_MODEL_LEN
from minfer.engine_args import EngineArgs, engine_kwargs

CPU_LIMIT_S = 600.0  # a CPU run estimated to take longer is refused without --allow-slow
FIXED_LEN = 128  # a fixed workload's --input-len / --output-len when only the other is given


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="offline throughput (workload A of BENCHMARKS.md by default)")
    p.add_argument("--shape", default=None, help="qwen3-0.6b | llama-3.2-1b | llama-3.1-8b | llama-3.1-70b | "
                   "qwen3-30b-a3b | mixtral-8x7b | gemma-3-12b(-it) | gemma-3-27b(-it) | phi-4 | mistral-7b-v0.1 (random "
                   "weights, normal x 0.02 with norm weights 1, written under --checkpoint-dir; on a GPU when there "
                   "is one; with --load-format dummy only config.json is written, to <shape>-dummy, and the engine "
                   "draws the same kind of weights on the device)")
    p.add_argument("--shape-layers", type=int, default=None,
                   help="with --shape: only this many decoder layers (a scaled-down stand-in, e.g. the 70B's layers "
                        "on fewer GPUs; written to <shape>-<N>l)")
    p.add_argument("--checkpoint-dir", default="/tmp/minfer-shapes")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=None,
                   help="prompt tokens: with it (or --output-len) every request has the same lengths instead of "
                        "workload A's (default with --output-len: 128)")
    p.add_argument("--output-len", type=int, default=None,
                   help="output tokens of a fixed-length workload (default 128) or of --batch1 (default 512: 128 "
                        "tokens at batch 1 last ~0.1 s on an H200, and such runs spread by up to 15%%; 512 repeat "
                        "within 0.3%%)")
    p.add_argument("--batch1", action="store_true", help="decode speed of one request vs weights/bandwidth (of all "
                   "--tensor-parallel-size GPUs)")
    p.add_argument("--compare-hf", action="store_true",
                   help="also run HF transformers' generate_batch on a subset, in the same process")
    p.add_argument("--hf-num-prompts", type=int, default=64)
    p.add_argument("--hf-output-len", type=int, default=256)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="write a PNG bar chart here")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--allow-slow", action="store_true",
                   help=f"without a GPU, run even when the estimated time is over {CPU_LIMIT_S / 60:.0f} minutes")
    # the prompts are token ids: the tokenizer is always skipped (--model: the built-in model)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=cmd_bench)
    return p


def output_len(args: argparse.Namespace) -> int:
    """--output-len, else 512 tokens at batch 1 (a stable figure) and 128 for a fixed-length workload."""
    if args.output_len is not None:
        return args.output_len
    return 512 if args.batch1 else 128


def needed_model_len(args: argparse.Namespace, config: dict[str, Any]) -> int:
    """The context the run needs, within the model's (``config``: its config.json): workload A's and batch 1's
    4096 (the figures of the README are measured so), a fixed workload's prompt + output."""
    need = BENCH_MAX_MODEL_LEN if args.input_len is None else args.input_len + output_len(args)
    return min(need, int(config.get("max_position_embeddings", need)))


def model_config_dict(args: argparse.Namespace) -> dict[str, Any]:
    """The config.json of the model the run loads, read before a shape's checkpoint is written."""
    import json

    from minfer.model.loader import resolve_model_path

    if args.shape:
        from minfer.benchmark.shapes import shape_config

        return shape_config(args.shape, layers=args.shape_layers)
    return json.loads((resolve_model_path(args.model) / "config.json").read_text())


def planned_lengths(args: argparse.Namespace, vocab_size: int, max_model_len: int) -> tuple[list[int], list[int]]:
    """The prompt and output lengths ``offline.bench`` will run, as it builds them."""
    from minfer.benchmark.workload import workload_a

    if args.batch1:
        return [args.input_len or 128], [output_len(args)]
    if args.input_len:
        return [args.input_len] * args.num_prompts, [output_len(args)] * args.num_prompts
    prompts, params = workload_a(args.num_prompts, max_model_len, vocab_size)
    return [len(p["prompt_token_ids"]) for p in prompts], [sp.max_tokens for sp in params]


def check_cpu_time(args: argparse.Namespace, config: dict[str, Any], max_model_len: int) -> None:
    """Without a GPU: say how long the run will take at least, and refuse one past CPU_LIMIT_S unless
    --allow-slow."""
    from minfer.benchmark.offline import cpu_rates, estimate_seconds
    from minfer.model.registry import model_config

    cfg = model_config(config)
    prompt_lens, output_lens = planned_lengths(args, cfg.vocab_size, max_model_len)
    flop_s, bandwidth = cpu_rates()
    seconds = estimate_seconds(cfg, prompt_lens, output_lens, flop_s, bandwidth)
    what = (f"{len(prompt_lens)} request(s), {sum(prompt_lens):,} prompt + {sum(output_lens):,} output tokens on "
            f"{args.shape or 'this model'} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size})")
    rates = f"this CPU's measured {flop_s / 1e9:.0f} GFLOP/s and {bandwidth / 1e9:.0f} GB/s, float32"
    if seconds > CPU_LIMIT_S and not args.allow_slow:
        raise ValueError(f"no GPU: {what} would take at least {_duration(seconds)} at {rates} (likely several "
                         "times longer). Run it on a GPU, make it smaller (--num-prompts 8, --input-len 64 "
                         "--output-len 32, --shape-layers 2), or pass --allow-slow to run it anyway")
    if not args.quiet:
        print(f"minfer bench: no GPU: {what}; at least {_duration(seconds)} at {rates}", file=sys.stderr)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from minfer.benchmark import offline
    from minfer.benchmark.shapes import shape_checkpoint
    from minfer.llm import builtin_model_path

    EngineArgs.from_cli_args(args)  # a bad flag fails before a shape's checkpoint is written
    if args.shape_layers is not None and not args.shape:
        raise ValueError("--shape-layers needs --shape")
    if args.output_len is not None and args.input_len is None and not args.batch1:
        args.input_len = FIXED_LEN  # --output-len alone asks for fixed lengths too (it was ignored)
    args.model = None if args.shape else args.model or str(builtin_model_path())
    config = model_config_dict(args)
    kwargs = engine_kwargs(args)
    kwargs["max_model_len"] = kwargs["max_model_len"] or needed_model_len(args, config)
    if not torch.cuda.is_available():
        check_cpu_time(args, config, kwargs["max_model_len"])
    model, shape = args.model, args.shape
    if shape:
        if not args.quiet and args.load_format != "dummy":
            print(f"minfer bench: {shape}: a random-weight checkpoint under {args.checkpoint_dir} (written once, "
                  "then reused)", file=sys.stderr)
        model = str(shape_checkpoint(shape, Path(args.checkpoint_dir), args.load_format, args.shape_layers))
        shape = shape if args.shape_layers is None else f"{shape} ({args.shape_layers} layers)"
    result = offline.bench(model, shape, kwargs, num_prompts=args.num_prompts, input_len=args.input_len,
                           output_len=output_len(args), batch1=args.batch1, compare_hf=args.compare_hf,
                           hf_num_prompts=args.hf_num_prompts, hf_output_len=args.hf_output_len,
                           progress=not args.quiet)
    offline.write_outputs(result, args.output_json, args.plot)
    return 0
