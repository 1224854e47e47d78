"""The ``minfer`` command: generate | bench | train | eval-ppl."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path



def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="local HF folder or hub id (default: the built-in model)")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    g.add_argument("--device", default="auto", help="auto | cuda | cpu")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=16384)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--no-async-scheduling", action="store_true",
                   help="complete each step before scheduling the next (no host/GPU overlap)")
    g.add_argument("--attention-backend", default="auto", help="auto | torch | triton")
    g.add_argument("--kv-cache-dtype", default="auto")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                kv_cache_memory_bytes=args.kv_cache_memory_bytes, num_kv_blocks=args.num_kv_blocks,
                enable_prefix_caching=not args.no_prefix_caching, enforce_eager=args.enforce_eager,
                async_scheduling=not args.no_async_scheduling, attention_backend=args.attention_backend,
                kv_cache_dtype=args.kv_cache_dtype)


def cmd_generate(args: argparse.Namespace) -> int:
    from minfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, stop=args.stop or None)
    llm = LLM(args.model, **_engine_kwargs(args))
    outs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, out in zip(args.prompts, outs):
        print(prompt + out.outputs[0].text)
        if len(outs) > 1:
            print("-" * 40)
    return 0


def _bench_output_len(args: argparse.Namespace) -> int:
    """--output-len, else 512 tokens at batch 1 (a stable figure) and 128 for a fixed-length workload."""
    if args.output_len is not None:
        return args.output_len
    return 512 if args.batch1 else 128


def cmd_bench(args: argparse.Namespace) -> int:
    from minfer.benchmark.offline import bench, write_outputs
    from minfer.benchmark.shapes import write_random_checkpoint

    model = args.model
    if args.shape:
        model = str(write_random_checkpoint(args.shape, Path(args.checkpoint_dir) / args.shape))
    if model is None:
        raise ValueError("bench needs --model or --shape")
    kwargs = _engine_kwargs(args)
    kwargs["max_model_len"] = kwargs["max_model_len"] or 4096
    result = bench(model, args.shape, kwargs, num_prompts=args.num_prompts, input_len=args.input_len,
                   output_len=_bench_output_len(args), batch1=args.batch1, compare_hf=args.compare_hf,
                   hf_num_prompts=args.hf_num_prompts, hf_output_len=args.hf_output_len, progress=not args.quiet)
    write_outputs(result, args.output_json, args.plot)
    return 0


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from minfer import LLM
    from minfer.eval_ppl import evaluate_perplexity

    files = [Path(f) for f in args.files]
    llm = LLM(args.model, **_engine_kwargs(args))
    result = evaluate_perplexity(llm, files, args.window)
    print(json.dumps({"model": args.model or "built-in", "files": len(files), "window": result.window,
                      "perplexity": round(result.perplexity, 4), "nll_per_token": round(result.nll_per_token, 6),
                      "tokens_scored": result.num_tokens_scored, "windows": result.num_windows,
                      "kv_cache_dtype": args.kv_cache_dtype}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minfer", description="A compact, fast LLM inference engine.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details (KV cache size, ...)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="offline throughput (workload A of BENCHMARKS.md by default)")
    bench.add_argument("--shape", default=None, help="qwen3-0.6b | llama-3.2-1b | llama-3.1-8b (random weights)")
    bench.add_argument("--checkpoint-dir", default="/tmp/minfer-shapes")
    bench.add_argument("--num-prompts", type=int, default=256)
    bench.add_argument("--input-len", type=int, default=None)
    bench.add_argument("--output-len", type=int, default=None,
                       help="with --input-len (default 128) or --batch1 (default 512: 128 tokens at batch 1 last "
                            "~0.1 s on an H200, and such runs spread by up to 15%%; 512 repeat within 0.3%%)")
    bench.add_argument("--batch1", action="store_true", help="decode speed of one request vs weights/bandwidth")
    bench.add_argument("--compare-hf", action="store_true",
                       help="also run HF transformers' generate_batch on a subset, in the same process")
    bench.add_argument("--hf-num-prompts", type=int, default=64)
    bench.add_argument("--hf-output-len", type=int, default=256)
    bench.add_argument("--output-json", default=None)
    bench.add_argument("--plot", default=None, help="write a PNG bar chart here")
    bench.add_argument("--quiet", action="store_true")
    _add_engine_args(bench)
    bench.set_defaults(func=cmd_bench)

    ppl = sub.add_parser("eval-ppl", help="token-level perplexity of a model over text files")
    ppl.add_argument("files", nargs="+")
    ppl.add_argument("--window", type=int, default=None, help="tokens per scored window (default: max_model_len - 1)")
    _add_engine_args(ppl)
    ppl.set_defaults(func=cmd_eval_ppl)

    try:
        from minfer.train.command import add_train_parser
    except ImportError:
        pass
    else:
        add_train_parser(sub)
    try:  # the server's dependencies are the optional `server` extra
        from minfer.server.cli import add_bench_serve_parser, add_serve_parser
    except ImportError:
        pass
    else:
        add_serve_parser(sub)
        add_bench_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"minfer {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

