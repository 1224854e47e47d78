"""How many blocks the paged KV cache gets: the one place where the engine's memory settings
(``num_kv_blocks``, ``kv_cache_memory_bytes``, ``gpu_memory_utilization``, the host's memory on a CPU)
become a block count, given one block's bytes (``KVCacheSpec.block_bytes``, from the model's attention
layers) and, on a GPU, the peak memory of a profiling forward the model runner ran.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from minfer.config import EngineConfig, cdiv
from minfer.engine.kv_cache import host_available_bytes
from minfer.engine.step_arrays import StepArrays, synthetic_step

CPU_KV_MEMORY_SHARE = 0.5  # of the host's available memory, at most, for a CPU KV cache
SAMPLER_BYTES_PER_LOGIT = 4 * 8  # float32 logits, noise and sort temporaries per row and vocabulary entry


def profile_lengths(budget: int, max_model_len: int) -> list[int]:
    """Sequence lengths of the start-up memory profile: a step carries up to the whole token budget, as
    chunks of several prompts when the budget exceeds max_model_len, so the profile runs that many
    tokens as sequences of at most max_model_len (one sequence of min(budget, max_model_len) tokens
    under-counted activations by 2x at the old 8192 / 4096)."""
    return [min(max_model_len, budget - start) for start in range(0, budget, max_model_len)]


def profile_context_lens(lens: list[int], staging_tokens: int, max_model_len: int) -> list[int]:
    """Context lengths of the profile's chunks ``lens``: their own, but where 8-bit prefill stages up to
    ``staging_tokens`` tokens' pages (``Ops.staging_tokens``), the last chunk continues a prompt with as much of
    that reach as is left (at most max_model_len): the rest of a long prompt stages its whole context into a
    16-bit scratch, which the profiled peak must hold."""
    return lens[:-1] + [max(lens[-1], min(max_model_len, staging_tokens - sum(lens[:-1])))]


def profile_step(budget: int, max_model_len: int, staging_tokens: int, block_size: int,
                 groups: int) -> tuple[StepArrays, int]:
    """The start-up profile's made-up step (``profile_lengths``, ``profile_context_lens``) and the blocks of its
    temporary cache: as many as the step's own tokens fill. The block tables and slots wrap around them, so a
    context staged past them reads them again (the profile measures memory, not values) and the temporary cache
    stays the budget's size however far max_model_len reaches."""
    lens = profile_lengths(budget, max_model_len)
    ctx = profile_context_lens(lens, staging_tokens, max_model_len)
    blocks, width = cdiv(lens[0], block_size) * len(lens), cdiv(max(ctx), block_size)
    tables = (np.arange(len(lens) * width, dtype=np.int32) % blocks).reshape(len(lens), width)
    step = synthetic_step(lens, ctx, tables, groups)
    step.slots %= blocks * block_size
    return step, blocks


def count_kv_blocks(config: EngineConfig, block_bytes: int, max_model_len: int, device: torch.device,
                    vocab_size: int, profile_peak: Callable[[], int]) -> int:
    """The blocks this rank can hold. ``profile_peak``: runs the profiling forward and returns the peak
    bytes allocated beside the weights' and the temporary cache's (called on a GPU only)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif device.type == "cuda":
        budget = gpu_kv_budget(config, device, profile_peak(), vocab_size)
    else:
        budget = cpu_kv_budget(config, block_bytes, max_model_len)
    blocks = budget // block_bytes
    if blocks < 1:
        raise ValueError(f"the KV cache budget ({budget / 2**20:.1f} MiB) holds no block of "
                         f"{block_bytes / 2**20:.2f} MiB; raise gpu_memory_utilization or kv_cache_memory_bytes")
    return int(blocks)


def gpu_kv_budget(config: EngineConfig, device: torch.device, peak: int, vocab_size: int) -> int:
    """``gpu_memory_utilization`` of the GPU, less the profiled peak, what other processes hold and the
    sampler's temporaries at ``max_num_seqs`` rows."""
    free, total = torch.cuda.mem_get_info(device)
    others = total - free - torch.cuda.memory_reserved(device)
    sampler = config.max_num_seqs * vocab_size * SAMPLER_BYTES_PER_LOGIT
    return int(total * config.gpu_memory_utilization - peak - others - sampler)


def cpu_kv_budget(config: EngineConfig, block_bytes: int, max_model_len: int) -> int:
    """On the CPU: room for what the run can hold at once (max_num_seqs sequences of max_model_len
    tokens), capped by a share of the memory the host has. The pages are touched only as they
    fill (``kv_cache.lazy_zeros``), so a large cap costs nothing until it is used."""
    per_seq = cdiv(max_model_len, config.block_size) * block_bytes
    cap = int(host_available_bytes() * CPU_KV_MEMORY_SHARE)
    return min(config.max_num_seqs * per_seq, max(cap, per_seq))
