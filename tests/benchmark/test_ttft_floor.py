"""The TTFT floor of a closed-loop serving burst (minfer/benchmark/ttft_floor.py)."""
from __future__ import annotations

import pytest

from minfer.benchmark.bounds import BF16_FLOP_S, DecodeCost
from minfer.benchmark.ttft_floor import floor_summary, prefill_seconds, serve_prompt_lens, ttft_floors
from minfer.model.registry import model_config
from minfer.benchmark.shapes import shape_config


def test_burst_floors_are_cumulative_shortest_first_and_later_ones_alone():
    cost = DecodeCost(tp=1, weight_bytes=0.0, layer_params=1e9, head_params=0.0, kv_bytes_per_token=0.0,
                      attn_flops_per_pair=0.0)
    tok = 2e9 / BF16_FLOP_S  # seconds per prompt token
    floors = ttft_floors(cost, [300, 100, 200, 50], burst=3)
    assert floors == pytest.approx([100 * tok, 300 * tok, 600 * tok, 50 * tok])
    assert prefill_seconds(cost, 100) == pytest.approx(100 * tok)


def test_serve_lengths_follow_bench_serve_and_the_8b_burst_floor():
    lens = serve_prompt_lens(256)
    assert len(lens) == 512 and min(lens) >= 100 and max(lens) <= 1024
    assert serve_prompt_lens(4) == serve_prompt_lens(8)[:16]  # at least 16 requests, workload A's draws in order
    s = floor_summary(DecodeCost.for_model(model_config(shape_config("llama-3.1-8b"))), 256)
    assert s["burst_tokens"] == sum(lens[:256])
    # the burst alone takes ~2.5 s of prefill at 793 TFLOP/s: a p99 TTFT of 2.0 s is below the floor
    assert 2.3 < s["burst_s"] < 2.8 and s["p99_ms"] > 2000 and s["p50_ms"] < s["p90_ms"] < s["p99_ms"]
