"""The state cache of models with recurrent layers (Qwen3.5's Gated DeltaNet): a fixed-size state per running
sequence and layer, beside the paged KV cache of their attention layers.

A model lists those layers (``state_layers()``); each says what one sequence's state is
(``state_shapes()``: name -> (shape, dtype)) and receives ``[slots, *shape]`` tensors under those names. A
sequence's slot is its input-batch row (``InputBatch``: held from its first scheduling until it finishes or is
preempted), so slots need no allocator of their own; one slot more than ``max_num_seqs`` takes the padding rows
of a CUDA-graph replay. The cache is allocated before the memory profile, so a GPU's KV budget is what is left
after it.

What the engine gives up for such models, and why:
- **Prefix caching** is off (logged at start-up): a prefix's KV blocks can be shared, but the recurrent state
  after that prefix is not stored anywhere, so a hit could not resume the linear layers. (Storing states at
  block boundaries, as SGLang's radix cache does for Mamba, is the way to bring it back.)
- **Preemption recomputes**: a preempted sequence's row (and so its state) is given back; it starts again
  from its first token with a fresh state (``has_state`` is false for a sequence with nothing computed).
- **The ``n`` samples of a request** each compute the prompt: a fork shares KV blocks, but the state after the
  prompt's second-to-last token (where a fork resumes) exists in no slot.
"""
from __future__ import annotations

import math

import torch
from torch import nn


def state_layers(model: nn.Module) -> list[nn.Module]:
    """The model's layers with a per-sequence state (none for attention-only models)."""
    return model.state_layers() if hasattr(model, "state_layers") else []


def slot_bytes(layers: list[nn.Module]) -> int:
    """One sequence's state bytes over all ``layers``."""
    return sum(math.prod(shape) * dtype.itemsize for layer in layers for shape, dtype in layer.state_shapes().values())


def allocate_state_cache(layers: list[nn.Module], num_slots: int, device: torch.device) -> None:
    """Give each layer its ``[num_slots, *shape]`` state tensors, zeroed."""
    for layer in layers:
        for name, (shape, dtype) in layer.state_shapes().items():
            setattr(layer, name, torch.zeros(num_slots, *shape, dtype=dtype, device=device))
