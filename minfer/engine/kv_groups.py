"""The hybrid KV cache's layout: which layers share which block tables, and which cache tensors.

A model whose layers attend differently (Gemma 2/3: sliding-window layers beside full-attention ones;
Qwen2 with ``max_window_layers``) need not keep every layer's K/V for the whole context: a sliding layer
reads only its last ``window`` tokens. As vLLM's hybrid allocator does, the layers are split into KV groups
of equal size G, each group holding layers of one window. All groups draw blocks from one pool, and a
block of the pool is one page in each of G cache tensors: page ``b`` of tensor ``j`` holds, for the group
that owns block ``b``, its j-th layer's K/V. Each sequence has one block table per group, and a sliding
group gives its blocks back as its window passes them (``engine/block_manager.py``), so the pool's blocks
go to where they are needed: at 32k tokens on the gemma-3-27b shape a sequence holds ~5x fewer pages than
with a full-length cache for every layer.

G trades memory for bookkeeping: a group whose window class has fewer than G layers is padded (its missing
layers' pages are allocated and unused), and every group is one more block table per sequence per step.
``plan_groups`` takes the largest G whose cache for one decoding ``max_model_len`` sequence (a sliding group
holding its window's blocks) is within 5% of the smallest possible.
"""
from __future__ import annotations

from dataclasses import dataclass

from minfer.config import cdiv

PADDING_TOLERANCE = 1.05  # a group size may cost this much more memory than the best, for fewer groups


@dataclass(slots=True, frozen=True)
class KVGroup:
    """Layers (indices into the model's cache-owning attention layers) that share block tables; ``layers[j]``
    uses cache tensor j. ``window``: their attention window (0: full attention)."""

    window: int
    layers: tuple[int, ...]


def plan_groups(windows: list[int], block_size: int, max_model_len: int) -> tuple[KVGroup, ...]:
    """The KV groups of layers with attention ``windows`` (0: full) for sequences of up to ``max_model_len``
    tokens: one group of every layer when all windows are equal."""
    classes: dict[int, list[int]] = {}
    for i, w in enumerate(windows):
        classes.setdefault(w if w and w < max_model_len else 0, []).append(i)
    if len(classes) == 1:
        (w, layers), = classes.items()
        return (KVGroup(w, tuple(layers)),)

    def pages(window: int) -> int:  # blocks a decoding sequence holds in a group of this window
        full = cdiv(max_model_len, block_size)
        return full if not window else min(full, cdiv(window, block_size) + 1)

    def cost(g: int) -> int:
        return sum(cdiv(len(layers), g) * g * pages(w) for w, layers in classes.items())

    sizes = range(1, max(len(layers) for layers in classes.values()) + 1)
    best = min(cost(g) for g in sizes)
    size = max(g for g in sizes if cost(g) <= best * PADDING_TOLERANCE)
    groups = []
    for w, layers in sorted(classes.items()):
        groups += [KVGroup(w, tuple(layers[i:i + size])) for i in range(0, len(layers), size)]
    return tuple(groups)
