"""The physical floor of a closed-loop serving run's TTFT percentiles (``minfer bench-serve --concurrency N``).

At N clients the first N requests arrive at once: the k-th first token of that burst cannot come before the k
shortest prompts are prefilled, whatever the scheduler does. Each later request arrives alone and needs at least
its own prefill. A prompt's prefill is compute-bound: its tokens through the decoder layers' products, its causal
attention, and the LM head on one row, at the H200's measured bf16 rate (``bounds.BF16_FLOP_S``). Each actual
TTFT dominates one floor (the burst's sorted ones the sorted cumulative sums), so every percentile of the run is
at least the same percentile of the floors. Launch, sampling and HTTP time are left out: a floor, not a forecast.

    python -m minfer.benchmark.ttft_floor --shape llama-3.1-8b --concurrency 64,256
"""
from __future__ import annotations

import argparse
from itertools import accumulate

from minfer.benchmark.bounds import BF16_FLOP_S, DecodeCost
from minfer.benchmark.serve_report import percentile
from minfer.benchmark.workload import workload_a


def prefill_seconds(cost: DecodeCost, prompt: int, flop_s: float = BF16_FLOP_S) -> float:
    """One prompt's prefill FLOPs over the GPU's rates (``bounds.throughput_bounds``' terms, one sampled row)."""
    layer_flops = 2 * cost.layer_params * prompt
    other = 2 * cost.head_params + cost.attn_flops_per_pair * prompt * (prompt + 1) / 2
    return layer_flops / (cost.matmul_flop_s * flop_s / BF16_FLOP_S) + other / flop_s


def ttft_floors(cost: DecodeCost, prompt_lens: list[int], burst: int, flop_s: float = BF16_FLOP_S) -> list[float]:
    """Seconds: the first ``burst`` requests' floors (the cumulative prefill of the shortest first, sorted), then
    each later request's own prefill."""
    first = sorted(prefill_seconds(cost, p, flop_s) for p in prompt_lens[:burst])
    return list(accumulate(first)) + [prefill_seconds(cost, p, flop_s) for p in prompt_lens[burst:]]


def serve_prompt_lens(concurrency: int, max_model_len: int = 4096) -> list[int]:
    """The prompt lengths of a ``bench-serve --concurrency N`` level of workload A, in sending order
    (``serve.build_requests``: 2N requests, at least 16, lengths scaled below a max_model_len of 2,048)."""
    prompts, _ = workload_a(max(16, 2 * concurrency), max_model_len)
    return [len(p["prompt_token_ids"]) for p in prompts]


def floor_summary(cost: DecodeCost, concurrency: int, max_model_len: int = 4096) -> dict[str, float]:
    """The floors' p50/p90/p99 (ms, numpy's interpolation as bench-serve's), and the whole burst's prefill."""
    lens = serve_prompt_lens(concurrency, max_model_len)
    floors = ttft_floors(cost, lens, concurrency)
    out = {f"p{q}_ms": round(percentile(floors, q) * 1000, 1) for q in (50, 90, 99)}
    out["burst_tokens"] = sum(lens[:concurrency])
    out["burst_s"] = round(max(floors[:concurrency]), 3)
    return out


def main(argv: list[str] | None = None) -> None:
    from minfer.benchmark.shapes import shape_config
    from minfer.model.registry import model_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args(argv)
    cost = DecodeCost.for_model(model_config(shape_config(args.shape)))
    print(f"TTFT floor, {args.shape} on one H200 (prefill FLOPs at {BF16_FLOP_S / 1e12:.0f} TFLOP/s; "
          f"{2 * cost.layer_params / 1e9:.2f} GFLOP per prompt token in the layers):")
    print("| clients | requests | burst prompt tokens | burst prefill s | floor TTFT p50 ms | p90 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|")
    for level in (int(v) for v in args.concurrency.split(",")):
        s = floor_summary(cost, level, args.max_model_len)
        print(f"| {level} | {max(16, 2 * level)} | {s['burst_tokens']:,} | {s['burst_s']:.2f} | {s['p50_ms']:,.0f} "
              f"| {s['p90_ms']:,.0f} | {s['p99_ms']:,.0f} |")


if __name__ == "__main__":
    main()
