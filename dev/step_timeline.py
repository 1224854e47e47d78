"""Where a workload-A run's wall time goes, step by step: prefill-carrying steps vs pure decodes by batch size.

The physical bound of BENCHMARKS.md counts bytes and FLOPs; a run also pays per step (kernel
launches, host Python, weights read once per step however few sequences remain). This wraps
``engine.step()``, records each step's wall time and what its launched batch held (sequences, prompt
tokens), and prints a table of buckets: count, seconds, ms per step, output tokens, share of the wall.
With async scheduling a step's time is charged to the batch it launched (it also completes the
previous one), which is what bounds the loop.

On a GPU, CUDA events around each launch also split the device's timeline: "GPU span" is the time
from the step's first queued work to its last (kernels plus any wait for the host's next launch
inside an eager step), "GPU idle before" the time the device sat waiting for the step to be
launched at all: host-bound steps show up there. "host launch" is the host's time inside the
launch (building inputs and queueing kernels; it never waits for the device).

    python3 dev/step_timeline.py --shape qwen3-0.6b [--no-async] [--out timeline.md]
    python3 dev/step_timeline.py --shape llama-3.1-8b --load-format dummy --quantization fp8 --kv-cache-dtype int8
    python3 dev/step_timeline.py --model minfer/assets/builtin-model --num-prompts 4 --max-model-len 256  # CPU
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from minfer import LLM, SamplingParams
from minfer.benchmark.shapes import shape_checkpoint
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
    ap.add_argument("--quantization", default=None, help="as minfer bench's (fp8: online per-channel FP8 weights)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: random weights drawn on the GPU while loading (no checkpoint written: 8B shapes)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = args.model or str(shape_checkpoint(args.shape, Path("/tmp/minfer-shapes"), args.load_format))
    llm = LLM(model, skip_tokenizer_init=True, max_model_len=args.max_model_len, async_scheduling=not args.no_async,
              load_format=args.load_format, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    prompts, params = workload_a(args.num_prompts)
    half = args.max_model_len // 2  # no-op at 4096
    prompts = [{"prompt_token_ids": [t % vocab for t in p["prompt_token_ids"][:half]]} for p in prompts]
    for sp in params:
        sp.max_tokens = min(sp.max_tokens, half)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up

    launched: list[tuple[int, int]] = []  # (sequences, prompt tokens) of each launched batch
    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # around each launch, on the GPU
    launch = engine._launch
    cuda = torch.cuda.is_available()

    host_launch: list[float] = []  # host seconds inside each launch

    def recording_launch(batch, *args):
        launched.append((len(batch.seqs), batch.num_tokens - batch.num_decodes))
        t0 = time.perf_counter()
        if not cuda:
            out = launch(batch, *args)
            host_launch.append(time.perf_counter() - t0)
            return out
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        out = launch(batch, *args)
        after.record()
        host_launch.append(time.perf_counter() - t0)
        events.append((before, after))
        return out

    engine._launch = recording_launch
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    steps: list[tuple[float, tuple[int, int] | None, int]] = []  # wall, batch, index into events
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        before = len(launched)
        t0 = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t0, launched[-1] if len(launched) > before else None, len(launched) - 1))
    wall = time.perf_counter() - start
    if cuda:
        torch.cuda.synchronize()
    span = [b.elapsed_time(a) / 1e3 for b, a in events]
    idle = [0.0] + [events[i - 1][1].elapsed_time(events[i][0]) / 1e3 for i in range(1, len(events))]

    rows = {"steps with prompt tokens": [0, 0.0, 0, 0.0, 0.0, 0.0]}
    rows.update({f"decode only, {lo}-{hi if hi < 10**9 else 'max'} seqs": [0, 0.0, 0, 0.0, 0.0, 0.0]
                 for lo, hi in BUCKETS})
    rows["completion only (nothing launched)"] = [0, 0.0, 0, 0.0, 0.0, 0.0]
    for dt, batch, ev in steps:
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
        if batch is not None:
            r[5] += host_launch[ev]
        if batch is not None and cuda:
            r[3] += span[ev]
            r[4] += idle[ev]
    lines = [f"{args.model or args.shape}, async {not args.no_async}: {len(steps)} steps in {wall:.2f} s"
             + (f"; GPU idle between steps {sum(idle):.2f} s" if cuda else ""),
             "| steps | count | seconds | ms/step | decode tokens | share of wall | host launch s | GPU span s "
             "| GPU idle before s |", "|---|---|---|---|---|---|---|---|---|"]
    for key, (n, secs, toks, sp, idl, hl) in rows.items():
        if n:
            lines.append(f"| {key} | {n} | {secs:.2f} | {1e3 * secs / n:.2f} | {toks:,} | {secs / wall:.1%} "
                         f"| {hl:.2f} | {sp:.2f} | {idl:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
