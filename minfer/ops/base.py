"""The ops interface: every computation of the model that has more than one implementation.

The engine picks one implementation once (``minfer.ops.select_ops``) and hands it to the model, whose
layers call these names and never ask which backend runs them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch
from torch import nn

from minfer.ops.metadata import AttentionMetadata, PagedKVCache, RopeInputs

# (input_ids [T], positions [T], metadata) -> final hidden states [T, hidden] (before the final norm)
ModelForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class Ops(ABC):
    """Named ops of one backend. ``name`` is 'torch' or 'triton'; ``cuda_graphs`` says whether a
    forward on these ops can be captured in a CUDA graph (no host-sized work, no host syncs)."""

    name: str
    cuda_graphs: bool

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension of ``x`` (2-D or 3-D)."""

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)``. ``residual`` may be updated in place: callers
        use only the returned one."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU on a fused ``[T, 2I]`` gate|up product → ``[T, I]``."""

    @abstractmethod
    def rope_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: RopeInputs,
                      cache: PagedKVCache, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Per-head q/k norms (when ``rope`` has their weights), rotary, then k and v into the cache at
        ``slot_mapping`` (< 0 skips). q, k, v ``[T, H, D]`` may be views of the fused qkv output;
        returns q ready for attention (possibly ``q`` itself, rotated in place)."""

    @abstractmethod
    def paged_attention(self, q: torch.Tensor, cache: PagedKVCache, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor:
        """Attention of ``q`` ``[T, Hq, D]`` over the paged cache: the decodes' rows against their whole
        context, then each prompt chunk causally against its cached context and itself."""

    @abstractmethod
    def greedy_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits.argmax(-1)`` (first maximum) of ``[rows, vocab]`` logits, int64 ``[rows]``."""

    @abstractmethod
    def gumbel_argmax(self, logits: torch.Tensor, row_hash: torch.Tensor,
                      inv_temperature: torch.Tensor) -> torch.Tensor:
        """One draw per row from softmax(logits / T) as ``argmax(logits / T + g)``, Gumbel noise g from
        the rows' hashes (int64 ``[rows]``, values in [0, 2^32)); ``inv_temperature`` float32 ``[rows]``."""

    def fp8_linear(self, x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   input_scale: torch.Tensor | None, bias: torch.Tensor | None, block: bool) -> torch.Tensor:
        """``x @ dequantize(weight)ᵀ (+ bias)`` for an e4m3 ``weight`` [N, K] with float32 scales per row
        ([N]) or per row and 128-column block ([N, ceil(K/128)]); ``input_scale``: a static per-tensor
        activation scale, where the checkpoint has one. This reference rounds the activations to e4m3 as
        the fast path does (per token, per 128-column group for blocks, or by ``input_scale``), then
        multiplies the dequantized operands in float32 (compressed-tensors' own forward does the same)."""
        w = weight.float()
        w = w * (weight_scale.repeat_interleave(128, dim=1)[:, :w.shape[1]] if block else weight_scale[:, None])
        xs = x.float()
        if input_scale is not None:
            scale = input_scale.float()
        elif block:
            groups = xs.split(128, dim=-1)
            scale = torch.cat([g.abs().amax(-1, keepdim=True).expand_as(g) for g in groups], -1) / 448.0
        else:
            scale = xs.abs().amax(-1, keepdim=True) / 448.0
        scale = scale.clamp(min=1e-12)
        xs = (xs / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale
        return torch.nn.functional.linear(xs, w, None if bias is None else bias.float()).to(x.dtype)

    def model_forward(self, model: nn.Module) -> ModelForward:
        """The forward the runner runs steps through (and CUDA graphs capture): the model itself,
        unless these ops have a faster forward for some steps (the Triton ops' one-token forward)."""
        return model
