"""``minfer bench``: offline throughput, batch-1 decode and the HF comparison (``minfer.benchmark.offline``)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from minfer.benchmark.workload import BENCH_MAX_MODEL_LEN
from minfer.engine_args import add_engine_args, engine_config, engine_kwargs


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("bench", help="offline throughput (workload A of BENCHMARKS.md by default)")
    p.add_argument("--shape", default=None, help="qwen3-0.6b | llama-3.2-1b | llama-3.1-8b | llama-3.1-70b | "
                   "qwen3-30b-a3b | mixtral-8x7b (random weights, normal x 0.02 with norm weights 1, written under "
                   "--checkpoint-dir; on a GPU when there is one; with --load-format dummy only config.json is "
                   "written, to <shape>-dummy, and the engine draws the same kind of weights on the device)")
    p.add_argument("--shape-layers", type=int, default=None,
                   help="with --shape: only this many decoder layers (a scaled-down stand-in, e.g. the 70B's layers "
                        "on fewer GPUs; written to <shape>-<N>l)")
    p.add_argument("--checkpoint-dir", default="/tmp/minfer-shapes")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None,
                   help="with --input-len (default 128) or --batch1 (default 512: 128 tokens at batch 1 last "
                        "~0.1 s on an H200, and such runs spread by up to 15%%; 512 repeat within 0.3%%)")
    p.add_argument("--batch1", action="store_true", help="decode speed of one request vs weights/bandwidth (of all "
                   "--tensor-parallel-size GPUs)")
    p.add_argument("--compare-hf", action="store_true",
                   help="also run HF transformers' generate_batch on a subset, in the same process")
    p.add_argument("--hf-num-prompts", type=int, default=64)
    p.add_argument("--hf-output-len", type=int, default=256)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="write a PNG bar chart here")
    p.add_argument("--quiet", action="store_true")
    add_engine_args(p)  # the prompts are token ids: the tokenizer is always skipped
    p.set_defaults(func=cmd_bench)
    return p


def output_len(args: argparse.Namespace) -> int:
    """--output-len, else 512 tokens at batch 1 (a stable figure) and 128 for a fixed-length workload."""
    if args.output_len is not None:
        return args.output_len
    return 512 if args.batch1 else 128


def needed_model_len(args: argparse.Namespace, model: str) -> int:
    """The context the run needs, within the model's: workload A's and batch 1's 4096 (the figures of the
    README are measured so), a fixed workload's prompt + output."""
    import json

    from minfer.model.loader import resolve_model_path

    need = BENCH_MAX_MODEL_LEN if args.input_len is None else args.input_len + output_len(args)
    config = json.loads((resolve_model_path(model) / "config.json").read_text())
    return min(need, int(config.get("max_position_embeddings", need)))


def cmd_bench(args: argparse.Namespace) -> int:
    from minfer.benchmark import offline
    from minfer.benchmark.shapes import shape_checkpoint

    engine_config(args)  # a bad flag fails before a shape's checkpoint is written
    model, shape = args.model, args.shape
    if args.shape_layers is not None and not shape:
        raise ValueError("--shape-layers needs --shape")
    if shape:
        model = str(shape_checkpoint(shape, Path(args.checkpoint_dir), args.load_format, args.shape_layers))
        shape = shape if args.shape_layers is None else f"{shape} ({args.shape_layers} layers)"
    if model is None:
        raise ValueError("bench needs --model or --shape")
    kwargs = engine_kwargs(args)
    kwargs["max_model_len"] = kwargs["max_model_len"] or needed_model_len(args, model)
    result = offline.bench(model, shape, kwargs, num_prompts=args.num_prompts, input_len=args.input_len,
                           output_len=output_len(args), batch1=args.batch1, compare_hf=args.compare_hf,
                           hf_num_prompts=args.hf_num_prompts, hf_output_len=args.hf_output_len,
                           progress=not args.quiet)
    offline.write_outputs(result, args.output_json, args.plot)
    return 0
