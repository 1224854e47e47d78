"""The ``minfer`` command: generate | bench | train | eval-ppl."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path



def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="local HF folder or hub id (default: the built-in model)")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    g.add_argument("--device", default="auto", help="auto | cuda | cpu")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--attention-backend", default="auto", help="auto | torch | triton")
    g.add_argument("--kv-cache-dtype", default="auto")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                kv_cache_memory_bytes=args.kv_cache_memory_bytes, num_kv_blocks=args.num_kv_blocks,
                enable_prefix_caching=not args.no_prefix_caching, enforce_eager=args.enforce_eager,
                attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype)


def cmd_generate(args: argparse.Namespace) -> int:
    from minfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop or None)
    llm = LLM(args.model, **_engine_kwargs(args))
    outs = llm.generate(args.prompts, params, use_tqdm=False)
    for prompt, out in zip(args.prompts, outs):
        print(prompt + out.outputs[0].text)
        if len(outs) > 1:
            print("-" * 40)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from minfer import LLM, SamplingParams
    from minfer.benchmark.shapes import write_random_checkpoint
    from minfer.benchmark.workload import WORKLOAD_A_BOUND, WORKLOAD_A_SUM_BOUND, fixed_workload, workload_a

    model = args.model
    if args.shape:
        model = str(write_random_checkpoint(args.shape, Path(args.checkpoint_dir) / args.shape))
    if model is None:
        raise SystemExit("bench needs --model or --shape")
    kwargs = _engine_kwargs(args)
    kwargs["max_model_len"] = kwargs["max_model_len"] or 4096
    llm = LLM(model, skip_tokenizer_init=True, **kwargs)
    if args.input_len:
        prompts, params = fixed_workload(args.num_prompts, args.input_len, args.output_len)
        workload = f"fixed {args.num_prompts} x {args.input_len} in / {args.output_len} out"
    else:
        prompts, params = workload_a(args.num_prompts)
        workload = "A"
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.quiet)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outs)
    stats = llm.get_stats()
    result = {
        "model": args.shape or model, "workload": workload, "requests": len(outs),
        "prompt_tokens": in_tokens, "output_tokens": out_tokens, "seconds": round(elapsed, 3),
        "output_tok_s": round(out_tokens / elapsed, 1), "total_tok_s": round((in_tokens + out_tokens) / elapsed, 1),
        "num_preemptions": stats["num_preemptions"], "num_kv_blocks": stats["num_kv_blocks"],
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "engine": {k: v for k, v in kwargs.items() if v is not None},
    }
    if workload == "A" and args.shape in WORKLOAD_A_BOUND and args.num_prompts == 256:
        result["share_of_bound"] = round(result["output_tok_s"] / WORKLOAD_A_BOUND[args.shape], 4)
        result["share_of_sum_bound"] = round(result["output_tok_s"] / WORKLOAD_A_SUM_BOUND[args.shape], 4)
    print(json.dumps(result, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0


def cmd_eval_ppl(args: argparse.Namespace) -> int:
    from minfer import LLM
    from minfer.eval_ppl import evaluate_perplexity

    files = [Path(f) for f in args.files]
    llm = LLM(args.model, **_engine_kwargs(args))
    result = evaluate_perplexity(llm, files, args.window)
    print(json.dumps({"model": args.model or "built-in", "files": len(files), "window": args.window,
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
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    _add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="offline throughput (workload A of BENCHMARKS.md by default)")
    bench.add_argument("--shape", default=None, help="qwen3-0.6b | llama-3.2-1b | llama-3.1-8b (random weights)")
    bench.add_argument("--checkpoint-dir", default="/tmp/minfer-shapes")
    bench.add_argument("--num-prompts", type=int, default=256)
    bench.add_argument("--input-len", type=int, default=None)
    bench.add_argument("--output-len", type=int, default=128)
    bench.add_argument("--output-json", default=None)
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, TypeError) as exc:
        print(f"minfer {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

