"""The replicas' stats snapshots as one engine's, plus each replica's own (``/stats``, ``/metrics``).

Counts and counters add up (the keys ``ADDED_UP`` names or ``ADDED_UP_PREFIXES`` starts: sequences, blocks, tokens,
preemptions, drafts; the grammar compile histogram bucket by bucket); everything else describes one replica's engine,
the same in all, and is taken from the first (the model's dtype, the KV format, the block size and bytes, the windows,
the tensor-parallel size, each rank's weight bytes); the ratios are recomputed from the sums (KV usage is the blocks
used over the blocks of all replicas; the prefix-cache hit rate, the hits over the lookups of all). ``replicas`` keeps
each replica's snapshot with its ``engine`` index, whether it is ``alive``, and the requests the balancer has
``routed`` to it: ``metrics.py`` labels vLLM's gauges with them, as vLLM labels each data-parallel engine's series
``engine="i"``.
"""
from __future__ import annotations

from typing import Any, Sequence

ADDED_UP = frozenset({"kv_blocks_used", "kv_group_blocks", "generation_tokens_per_s"})
ADDED_UP_PREFIXES = ("num_", "prefix_cache_", "spec_decode_num_")
RATIOS = frozenset({"kv_cache_usage", "prefix_cache_hit_rate"})  # recomputed from the sums


def merge_stats(snapshots: Sequence[dict[str, Any]], alive: Sequence[bool], routed: Sequence[int]) -> dict[str, Any]:
    """One engine's stats from the live replicas' snapshots (all of them, the dead included, when none lives)."""
    live = [s for s, up in zip(snapshots, alive) if up] or list(snapshots)
    merged: dict[str, Any] = {}
    for key, first in live[0].items():
        values = [s.get(key, first) for s in live]
        if key == "grammar_compile_seconds":
            merged[key] = _histogram(values)
        elif key == "lora_requests_info":
            merged[key] = _lora_info(values)
        elif key in RATIOS or not (key in ADDED_UP or key.startswith(ADDED_UP_PREFIXES)):
            merged[key] = first
        elif isinstance(first, list):
            merged[key] = [sum(column) for column in zip(*values)]
        else:
            merged[key] = sum(values)
    _recompute_ratios(merged)
    merged["data_parallel_size"] = len(snapshots)
    merged["replicas"] = [dict(s, engine=i, alive=up, routed=n)
                          for i, (s, up, n) in enumerate(zip(snapshots, alive, routed))]
    return merged


def _recompute_ratios(s: dict[str, Any]) -> None:
    if "num_kv_blocks" in s:
        s["kv_cache_usage"] = s.get("kv_blocks_used", 0) / max(s["num_kv_blocks"], 1)
    if "prefix_cache_queried_tokens" in s:
        queried = s["prefix_cache_queried_tokens"]
        s["prefix_cache_hit_rate"] = s.get("prefix_cache_hit_tokens", 0) / queried if queried else 0.0
    if "spec_decode_num_drafts" in s:
        drafts, tokens, accepted = (s["spec_decode_num_drafts"], s["spec_decode_num_draft_tokens"],
                                    s["spec_decode_num_accepted_tokens"])
        s["spec_decode_acceptance_rate"] = accepted / tokens if tokens else 0.0
        s["spec_decode_acceptance_rate_per_pos"] = [n / drafts if drafts else 0.0
                                                    for n in s["spec_decode_num_accepted_tokens_per_pos"]]
        s["spec_decode_mean_acceptance_length"] = 1 + accepted / drafts if drafts else 1.0


def _histogram(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """Histograms with the same bounds, added bucket by bucket."""
    first = snapshots[0]
    buckets = [(bound, sum(s["buckets"][k][1] for s in snapshots)) for k, (bound, _) in enumerate(first["buckets"])]
    return {"buckets": buckets, "sum": sum(s["sum"] for s in snapshots), "count": sum(s["count"] for s in snapshots)}


def _lora_info(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's ``lora_requests_info``: the adapters running or waiting in any replica."""
    return {"running_lora_adapters": sorted({a for i in infos for a in i["running_lora_adapters"]}),
            "waiting_lora_adapters": sorted({a for i in infos for a in i["waiting_lora_adapters"]}),
            "max_lora": infos[0]["max_lora"]}
