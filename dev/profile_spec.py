"""Where a speculative batch-1 step's host time goes: cProfile over steady decode with drafting forced on.

Runs one greedy request (256-token prompt, random weights) three ways, none / n-gram / an EAGLE-3 head, the
back-off off so every step drafts, and prints each run's ms per step and the functions with the most own time.
Usage (GPU): PYTHONPATH=.:dev:benchmarks python3 dev/profile_spec.py --shape llama-3.1-8b [--top 18]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch

import minfer.engine.spec.speculator as speculator
from bench_spec import eagle_head
from minfer import LLM, SamplingParams
from minfer.benchmark.shapes import shape_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    speculator.BACKOFF_AFTER = 10**9
    model = str(shape_checkpoint(args.shape, Path("/tmp/minfer-shapes"), "dummy"))
    run = [(i * 7919) % 20000 + 100 for i in range(64)]
    prompt = {"prompt_token_ids": run * 4}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for name, spec in [("none", None),
                       ("ngram", {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}),
                       ("eagle3", {"method": "eagle3", "model": eagle_head(model), "num_speculative_tokens": 3})]:
        llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=2048, speculative_config=spec)
        llm.generate([prompt], params, use_tqdm=False)
        engine = llm.llm_engine
        engine.add_request("p", prompt, params)
        engine.step()  # the prompt
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        steps, start = 0, time.perf_counter()
        prof.enable()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        prof.disable()
        elapsed = time.perf_counter() - start
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
        body = "\n".join(line[:150] for line in out.getvalue().splitlines()[7:])
        print(f"== {name}: {steps} steps, {1000 * elapsed / steps:.2f} ms a step (profiled)\n{body}", flush=True)
        llm.shutdown()
        del llm, engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
