"""The hybrid KV cache at long context on one GPU: how many 32k-token sequences fit, and the throughput of a
long-context workload, with the hybrid cache and with a full-length cache for every layer
(``--disable-hybrid-kv-cache-manager``), on a random-weight shape drawn on the device (load_format dummy).

    python3 benchmarks/hybrid_kv.py --shape gemma-3-12b --context 32768 --num-prompts 24 --output-len 256 \
        --out /tmp/minfer-out/hybrid_kv.json

For each mode: the KV blocks the memory budget gives, the blocks one ``--context``-token sequence holds at most
(every group: a sliding group its window's, the processor's own rule), so the sequences that fit; then
``--num-prompts`` requests of ``--context - --output-len`` prompt tokens and ``--output-len`` outputs: wall
time, output tok/s, the most sequences running at once, preemptions (``--num-prompts 0``: the fit alone).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minfer import LLM, SamplingParams  # noqa: E402
from minfer.benchmark.shapes import shape_checkpoint  # noqa: E402
from minfer.engine.block_manager import blocks_needed  # noqa: E402


def run_mode(path: Path, args: argparse.Namespace, hybrid: bool) -> dict:
    llm = LLM(str(path), load_format="dummy", max_model_len=args.context, skip_tokenizer_init=True,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.chunk,
              gpu_memory_utilization=args.gpu_memory_utilization, disable_hybrid_kv_cache_manager=not hybrid)
    engine = llm.llm_engine
    stats = llm.get_stats()
    per_seq = blocks_needed(args.context, engine.config.block_size, tuple(stats["kv_group_windows"]), 0)
    rng = random.Random(0)
    prompt_len = args.context - args.output_len
    params = SamplingParams(max_tokens=args.output_len, temperature=0.6, ignore_eos=True)
    for i in range(args.num_prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": [rng.randint(0, 10000) for _ in range(prompt_len)]}, params)
    start, most, tokens = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens += len(out.outputs[0].token_ids)
        most = max(most, len(engine.scheduler.running))
    wall = time.perf_counter() - start
    end = llm.get_stats()
    result = {"hybrid": hybrid, "kv_group_windows": stats["kv_group_windows"], "num_kv_blocks": stats["num_kv_blocks"],
              "kv_block_bytes": stats["kv_block_bytes"], "blocks_per_seq_at_context": per_seq,
              "seqs_fit_at_context": stats["num_kv_blocks"] // per_seq, "wall_s": round(wall, 2),
              "output_tok_s": round(tokens / wall, 1), "max_running": most, "preemptions": end["num_preemptions"]}
    llm.shutdown()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="gemma-3-12b")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--modes", default="hybrid,full")
    p.add_argument("--checkpoint-dir", default="/tmp/minfer-shapes")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    path = shape_checkpoint(args.shape, Path(args.checkpoint_dir), load_format="dummy")
    results = [run_mode(path, args, mode == "hybrid") for mode in args.modes.split(",")]
    report = {"shape": args.shape, "context": args.context, "num_prompts": args.num_prompts,
              "output_len": args.output_len, "runs": results}
    if len(results) == 2:
        report["fit_ratio"] = round(results[0]["seqs_fit_at_context"] / max(1, results[1]["seqs_fit_at_context"]), 2)
        if args.num_prompts:
            report["throughput_ratio"] = round(results[0]["output_tok_s"] / results[1]["output_tok_s"], 2)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
