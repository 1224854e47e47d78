"""``LLMEngine.get_stats``: the weights', the cache's and the scheduler's counters, read without touching them.

Apart from the engine so that its file keeps to the step; what the server's /stats, /metrics and the benchmarks
read comes from here.
"""
from __future__ import annotations

from typing import Any

from minfer.engine.grammar import compile_histogram


def engine_stats(engine: Any) -> dict[str, Any]:
    """Weights, cache and scheduler counters (``weight_bytes`` and ``num_kv_blocks``: per rank, each holding its KV
    heads of every block, under tensor parallelism). ``kv_cache_dtype`` is the stored format ('int8', 'fp8_e4m3',
    'fp8_e5m2', or the model dtype for 'auto'); ``kv_block_bytes`` one block's K and V across all layers (of its
    group, for a hybrid cache), scales included. ``kv_group_windows`` and ``kv_group_blocks``: each KV group's
    attention window (0: full) and the blocks it holds now. ``num_requests_waiting``: the sequences not yet running
    as vLLM counts waiting requests (each of n samples is one there): queued, held back until sample 0 has computed
    the prompt they fork from, or waiting for their grammar to compile; ``num_waiting`` is the scheduler's queue."""
    bm, sched, runner = engine.block_manager, engine.scheduler, engine.runner
    model = runner.model
    return {
        "tensor_parallel_size": engine.config.tensor_parallel_size,
        "weight_dtype": model.quant.name if model.quant is not None else str(runner.dtype).removeprefix("torch."),
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),  # this rank's
        "kv_cache_dtype": runner.kv_spec.format_name,
        "kv_block_bytes": runner.block_bytes,
        "num_kv_blocks": bm.num_blocks,
        "num_free_kv_blocks": bm.num_free_blocks,
        "num_cached_kv_blocks": sum(len(c) for c in bm.cached),
        "kv_group_windows": list(bm.windows),
        "kv_group_blocks": list(bm.group_blocks),
        "num_running": len(sched.running),
        "num_waiting": len(sched.waiting),
        "num_requests_waiting": len(sched.waiting) + sum(map(len, sched.unforked.values()))
        + sum(len(seqs) for _, seqs in engine._compiling.values()),
        "block_size": bm.block_size,
        "enable_prefix_caching": bm.enable_prefix_caching,
        "num_preemptions": sched.num_preemptions,
        "prefix_cache_hit_tokens": bm.hit_tokens,
        "prefix_cache_queried_tokens": bm.queried_tokens,
        "num_constrained_running": sum(s.grammar is not None for s in sched.running) if engine._constrained else 0,
        "num_grammars_compiling": len(engine._compiling),
        "grammar_compile_seconds": engine._grammars.stats() if engine._grammars is not None else compile_histogram(),
        **(engine.speculator.stats() if engine.speculator is not None else {}), **engine._lora_stats(),
    }
