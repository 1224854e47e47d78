"""The data the ops read: attention's per-step metadata, the rotary inputs, the layer's paged cache, a MoE
block's experts.

A leaf module (torch only) so that the model, the ops and the engine all import it without a cycle.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
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
    # Recurrent layers (``engine/state_cache.py``), for models that have them: each sequence's state slot and
    # whether it has a state to start from (tokens computed before this step), int32 / bool [num_seqs], and
    # every sequence's rows in the step (decodes included): [num_seqs + 1] int32
    state_slots: torch.Tensor | None = None
    has_state: torch.Tensor | None = None
    query_start_loc: torch.Tensor | None = None
    # torch ops: the decodes' cache slots and key positions, once per step for each block table and window
    _decode_slots: dict = field(default_factory=dict)
    # Triton ops on Hopper: the 8-bit caches' staging plans, once per step for each block table and window
    _stage_plans: dict = field(default_factory=dict)


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


@dataclass(frozen=True)
class MoeExperts:
    """A MoE block's stacked experts, as ``Ops.fused_moe`` reads them; the layer builds it once (it holds the
    parameters themselves, so weights loaded in place later are seen).

    ``w_gate_up`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows) and ``w_down`` ``[E, H, I]`` in
    the activations' dtype, or MXFP4: uint8 ``[E, 2I, H // 2]`` / ``[E, H, I // 2]``, two e2m1 codes a byte
    (the low nibble the even column), with uint8 e8m0 scales ``scale_gate_up`` ``[E, 2I, H // 32]`` /
    ``scale_down`` ``[E, H, I // 32]`` (one per 32 columns; None for float weights). Optional biases
    ``bias_gate_up`` ``[E, 2I]`` and ``bias_down`` ``[E, H]``. ``swiglu_limit`` 0 is the plain SwiGLU
    (``silu(gate) * up``); above 0, gpt-oss's clamped one: gate clamped above and up on both sides at the
    limit, ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``."""

    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    bias_gate_up: torch.Tensor | None = None
    bias_down: torch.Tensor | None = None
    scale_gate_up: torch.Tensor | None = None
    scale_down: torch.Tensor | None = None
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0

    def __post_init__(self) -> None:
        if (self.scale_gate_up is None) != (self.scale_down is None):
            raise ValueError("MoeExperts: scale_gate_up and scale_down are both given (MXFP4) or both None")
        if self.swiglu_limit < 0:
            raise ValueError(f"MoeExperts: swiglu_limit must be >= 0 (0: plain SwiGLU), got {self.swiglu_limit}")

    @property
    def mxfp4(self) -> bool:
        """Whether the weights are packed e2m1 codes with e8m0 scales."""
        return self.scale_gate_up is not None

    def as_kwargs(self) -> dict[str, torch.Tensor | float | None]:
        """The fields by name: the keyword arguments of the kernels' ``fused_moe`` and its reference
        (``kernels/moe``, a layer below this one, take the tensors rather than this class)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
