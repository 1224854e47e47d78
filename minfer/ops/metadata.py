"""The data attention's ops read: per-step metadata, the rotary inputs, the layer's paged cache.

A leaf module (torch only) so that the model, the ops and the engine all import it without a cycle.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step inputs of attention, all on the model's device.

    A step's tokens are laid out as ``num_decodes`` single-token decodes first, then the prompt
    chunks (vLLM's names). ``context_lens[s]`` counts sequence s's tokens in the cache after this
    step's store (its new tokens included). The host ints (``num_decodes``, ``max_prefill_query_len``)
    size grids and padding without a device sync. The prompt chunks' rows (after the decodes) have
    their own tensors, not slices of the whole step's: Triton specialises on 16-byte pointer
    alignment, and a slice at an odd offset compiled a new kernel variant in the middle of a run.
    They are None when the step has no chunk (CUDA-graph decodes).
    """

    # Per KV group (one for most models; a hybrid cache gives each sliding window's layers their own):
    slot_mapping: list[torch.Tensor]  # [num_tokens] int64 each
    block_tables: list[torch.Tensor]  # [num_seqs, max_blocks] int32 each
    context_lens: torch.Tensor  # [num_seqs] int32
    num_decodes: int
    block_size: int
    prefill_query_start_loc: torch.Tensor | None = None  # chunk row offsets from 0: [num_chunks + 1] int32
    prefill_block_tables: list[torch.Tensor] | None = None  # block_tables[g][num_decodes:] per group
    prefill_context_lens: torch.Tensor | None = None  # context_lens[num_decodes:]
    max_prefill_query_len: int = 0
    context_lens_host: list[int] = field(default_factory=list)
    query_lens_host: list[int] = field(default_factory=list)
    # torch ops: the decodes' cache slots and key positions, once per step for each block table and window
    _decode_slots: dict = field(default_factory=dict)


@dataclass(slots=True)
class RopeInputs:
    """What finishes q and k before attention: positions, the rotary table and, for Qwen3, the
    per-head norms (the Triton ops do all of it and the KV store in one launch)."""

    positions: torch.Tensor  # [T] int64
    cos_sin_cache: torch.Tensor  # [max_position, D] float32: [cos | sin] per position
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 1e-6


class PagedKVCache(Protocol):
    """One layer's paged cache, ``[num_blocks, block_size, Hkv, D]`` each; 8-bit caches carry a scale
    per token and KV head in ``k_scale``/``v_scale`` ``[num_blocks, Hkv, block_size]``. ``window`` (0: none),
    ``softcap`` (0: none) and ``sinks`` (None: none) say how the layer attends; ``kv_group`` which of the step's
    block tables and slot mappings address its cache (a hybrid cache gives sliding-window layers tables of their
    own). ``sinks`` ``[Hq]`` (this rank's query heads, the model dtype; gpt-oss): one learned logit per head that
    joins the softmax's denominator as a key with no value, so a head may attend to nothing."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    window: int
    softcap: float
    sinks: torch.Tensor | None
    kv_group: int


@dataclass(slots=True)
class Fp8Activation:
    """An activation already rounded to e4m3 by the kernel that produced it (add+RMSNorm, SwiGLU), on its
    way to an FP8 linear layer: ``q`` [T, K] e4m3 and float32 ``scale`` [T] (per token) or [T, ceil(K/128)]
    (per token and 128-column group, for block weights); ``dtype`` is the model dtype of the product."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
