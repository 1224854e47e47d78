"""Where a workload-A run's wall time goes, step by step: prefill-carrying steps vs pure decodes by batch size.

The physical bound of BENCHMARKS.md counts bytes and FLOPs; a run also pays per step (kernel
launches, host Python, weights read once per step however few sequences remain). This wraps
``engine.step()``, records each step's wall time and what its launched batch held (sequences, prompt
tokens), and prints a table of buckets: count, seconds, ms per step, output tokens, share of the wall.
With async scheduling a step's time is charged to the batch it launched (it also completes the
previous one), which is what bounds the loop.

    python3 benchmarks/step_timeline.py --shape qwen3-0.6b [--no-async] [--out timeline.md]
    python3 benchmarks/step_timeline.py --model minfer/assets/builtin-model --num-prompts 4 --max-model-len 256  # CPU
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from minfer import LLM, SamplingParams
from minfer.benchmark.shapes import write_random_checkpoint
from minfer.benchmark.workload import workload_a

BUCKETS = [(200, 10**9), (100, 199), (32, 99), (8, 31), (1, 7)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--model", default=None, help="a checkpoint folder instead of a random-weight --shape")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096,
                    help="workload A needs 2,011; smaller clips each request")
    ap.add_argument("--no-async", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = args.model or str(write_random_checkpoint(args.shape, Path("/tmp/minfer-shapes") / args.shape,
                                                      device="cuda"))
    llm = LLM(model, skip_tokenizer_init=True, max_model_len=args.max_model_len, async_scheduling=not args.no_async)
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    prompts, params = workload_a(args.num_prompts)
    half = args.max_model_len // 2  # no-op at 4096
    prompts = [{"prompt_token_ids": [t % vocab for t in p["prompt_token_ids"][:half]]} for p in prompts]
    for sp in params:
        sp.max_tokens = min(sp.max_tokens, half)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up

    launched: list[tuple[int, int]] = []  # (sequences, prompt tokens) of each launched batch
    launch = engine._launch

    def recording_launch(batch):
        launched.append((len(batch.seqs), batch.num_tokens - batch.num_decodes))
        return launch(batch)

    engine._launch = recording_launch
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    steps: list[tuple[float, tuple[int, int] | None]] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        before = len(launched)
        t0 = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t0, launched[-1] if len(launched) > before else None))
    wall = time.perf_counter() - start

    rows = {"steps with prompt tokens": [0, 0.0, 0]}
    rows.update({f"decode only, {lo}-{hi if hi < 10**9 else 'max'} seqs": [0, 0.0, 0] for lo, hi in BUCKETS})
    rows["completion only (nothing launched)"] = [0, 0.0, 0]
    for dt, batch in steps:
        if batch is None:
            key = "completion only (nothing launched)"
        elif batch[1] > 0:
            key = "steps with prompt tokens"
        else:
            lo, hi = next(b for b in BUCKETS if b[0] <= batch[0] <= b[1])
            key = f"decode only, {lo}-{hi if hi < 10**9 else 'max'} seqs"
        r = rows[key]
        r[0] += 1
        r[1] += dt
        r[2] += batch[0] if batch and batch[1] == 0 else 0
    lines = [f"{args.model or args.shape}, async {not args.no_async}: {len(steps)} steps in {wall:.2f} s",
             "| steps | count | seconds | ms/step | decode tokens | share of wall |", "|---|---|---|---|---|---|"]
    for key, (n, secs, toks) in rows.items():
        if n:
            lines.append(f"| {key} | {n} | {secs:.2f} | {1e3 * secs / n:.2f} | {toks:,} | {secs / wall:.1%} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
