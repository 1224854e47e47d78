"""LoRASlots: the device-side adapter table the LoRA kernels read, and the host cache behind it.

Each base layer (layer index, fused layer) owns one pair of stacks, allocated once at start-up (zeros):

    a_stack [max_loras, n_shards, max_rank, in_features]     A, rows past the adapter's rank zero
    b_stack [max_loras, sum(shard_sizes), max_rank]          scaling * B, columns past the rank zero

with this rank's tensor-parallel share of in/out features (the layout ``minfer/kernels/lora/lora_meta.py``
reads). Shards follow the fused layer's output order ('qkv': q, k, v; 'gate_up': gate, up; 'o'; 'down'); B's
rows stack the shards as the fused base weight stacks them, shard s from row ``sum(shard_sizes[:s])``, not
padded to the widest shard (k and v are a fraction of q's width under grouped-query attention). Zero padding
of the rank is what lets one kernel serve adapters of any rank up to max_rank and any set of targets: a module
an adapter leaves out, or a rank it does not use, multiplies by zeros.

Slot residency is an LRU: activating a batch pins its adapters; a missing one takes a free slot or evicts
the least recently used adapter the batch does not use. Behind the slots sits a CPU cache of loaded adapters
(LRU, ``max_cpu_loras`` >= ``max_loras``) so a swapped-out adapter comes back without reading its folder. An
adapter dropped from the CPU cache leaves its slot too: every resident adapter has its host copy.

The copies into a slot are queued on the current stream, behind whatever step last read that slot, so a
batch may evict the adapter of a step still running on the device.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minfer.distributed import SINGLE, TensorParallel
from minfer.lora.adapter import LoRAAdapter, load_adapter, shard_weights
from minfer.lora.layout import FUSED_LAYERS, SHARD_OF, BaseLinears
from minfer.lora.request import LoRARequest

NO_SLOT = -1  # a row without an adapter


class LoRASlotsError(RuntimeError):
    """A batch the slot table cannot hold: more adapters than ``max_loras`` (every slot pinned)."""


@dataclass(frozen=True, slots=True)
class LoRAStack:
    """One fused base layer's adapter slots. ``shard_sizes``: each shard's output rows on this rank, in
    the fused output's order (its rows of ``b_stack`` and its columns of the layer's output)."""

    a_stack: torch.Tensor
    b_stack: torch.Tensor
    shard_sizes: tuple[int, ...]


class LoRASlots:
    """``max_loras`` device slots of adapters of rank up to ``max_lora_rank`` over the base ``base``.

    ``stacks[(layer, fused)]`` are the tensors the kernels read; a row's adapter is its slot index
    (``activate``'s answer), NO_SLOT for none. Works on any device, the CPU included."""

    def __init__(self, base: BaseLinears, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", max_cpu_loras: int | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(max_cpu_loras, bool) or not isinstance(max_cpu_loras, int) or max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras must be an int >= max_loras ({max_loras}): every adapter in a slot "
                             f"keeps its host copy; got {max_cpu_loras!r}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        self.base, self.tp = base, tp
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.stacks: dict[tuple[int, str], LoRAStack] = {}
        for layer, fused in base.fused_layers():
            features = [base.local_features(m, tp) for m in FUSED_LAYERS[fused]]
            n_in, sizes = features[0][0], tuple(out for _, out in features)
            self.stacks[(layer, fused)] = LoRAStack(
                torch.zeros(max_loras, len(sizes), max_lora_rank, n_in, dtype=dtype, device=device),
                torch.zeros(max_loras, sum(sizes), max_lora_rank, dtype=dtype, device=device),
                sizes)
        self._owner: list[int | None] = [None] * max_loras  # slot -> adapter id
        self._resident: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self._cpu: OrderedDict[int, tuple[LoRARequest, LoRAAdapter]] = OrderedDict()  # least recent first
        self._running: frozenset[int] = frozenset()  # the last activated batch's adapters
        # the slots ``activate`` wrote since the last ``take_placed`` (tensor-parallel followers write them too)
        self._placed: list[tuple[int, LoRARequest]] = []

    def slot_of(self, lora_int_id: int) -> int | None:
        """The slot holding adapter ``lora_int_id``, or None when it is not resident."""
        return self._resident.get(lora_int_id)

    def list_adapters(self) -> dict[int, LoRARequest]:
        """The adapters loaded on the host (the CPU cache), least recently used first."""
        return {i: request for i, (request, _) in self._cpu.items()}

    def add(self, request: LoRARequest) -> bool:
        """Load ``request``'s adapter into the CPU cache without a slot (vLLM's ``add_lora``); False when it
        is there already. The running batch's adapters are never the ones evicted for it."""
        self._check_same(request)
        return self._ensure_cpu(request, self._running)

    def activate(self, requests: Sequence[LoRARequest | None]) -> list[int]:
        """Make every adapter of a batch resident and give each row its slot (NO_SLOT for None). The batch's
        adapters are pinned while it is placed: a load evicts only adapters outside it. A batch of more than
        ``max_loras`` adapters is refused before anything changes; a folder that fails to load raises its
        ``LoRAAdapterError`` before any slot is written (the batch's adapters read before it stay cached)."""
        batch: dict[int, LoRARequest] = {}
        for request in requests:
            if request is not None:
                self._check_same(request, batch.get(request.lora_int_id))
                batch.setdefault(request.lora_int_id, request)
        if len(batch) > self.max_loras:
            raise LoRASlotsError(f"a batch uses {len(batch)} LoRA adapters, more than max_loras={self.max_loras}: "
                                 f"all slots are pinned by it")
        keep = frozenset(batch)
        for request in batch.values():
            self._ensure_cpu(request, keep)
        for lora_id in batch:
            if lora_id not in self._resident:
                slot = self._take_slot(keep)
                self._write(slot, self._cpu[lora_id][1])
                self._placed.append((slot, self._cpu[lora_id][0]))
                self._owner[slot], self._resident[lora_id] = lora_id, slot
            self._resident.move_to_end(lora_id)
        self._running = keep
        return [NO_SLOT if r is None else self._resident[r.lora_int_id] for r in requests]

    def take_placed(self) -> list[tuple[int, LoRARequest]]:
        """The (slot, adapter) writes of ``activate`` since the last call."""
        placed, self._placed = self._placed, []
        return placed

    def place(self, request: LoRARequest, slot: int) -> None:
        """A tensor-parallel follower's copy of rank 0's write: ``request``'s adapter (this rank's share) into
        ``slot``, read from its folder (rank 0's choice of slots and host cache stands; this rank keeps neither)."""
        self._write(slot, load_adapter(request.lora_path, self.base, self.max_lora_rank))

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter: its host copy and its slot (zeroed). False when it was not loaded."""
        if lora_int_id not in self._cpu:
            return False
        self._drop(lora_int_id)
        self._running = self._running - {lora_int_id}
        return True

    def _check_same(self, request: LoRARequest, other: LoRARequest | None = None) -> None:
        """One id, one adapter: a second folder under a known id is a caller's mistake, not a reload."""
        known = other or (self._cpu[request.lora_int_id][0] if request.lora_int_id in self._cpu else None)
        if known is not None and known.lora_path != request.lora_path:
            raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter {known.lora_name!r} from "
                             f"{known.lora_path!r}; got {request.lora_name!r} from {request.lora_path!r}")

    def _ensure_cpu(self, request: LoRARequest, keep: frozenset[int]) -> bool:
        """The adapter in the CPU cache (most recent), read from its folder on a miss; evictions only after a
        successful read, so a refused adapter evicts nothing."""
        lora_id = request.lora_int_id
        if lora_id in self._cpu:
            self._cpu.move_to_end(lora_id)
            return False
        if len(self._cpu) >= self.max_cpu_loras and all(i in keep for i in self._cpu):
            raise LoRASlotsError(f"the CPU LoRA cache (max_cpu_loras={self.max_cpu_loras}) holds only adapters "
                                 f"the running batch uses; cannot load {request.lora_name!r}")
        adapter = load_adapter(request.lora_path, self.base, self.max_lora_rank)
        while len(self._cpu) >= self.max_cpu_loras:
            self._drop(next(i for i in self._cpu if i not in keep))
        self._cpu[lora_id] = (request, adapter)
        return True

    def _take_slot(self, keep: frozenset[int]) -> int:
        """A free slot, else the least recently used resident adapter's outside ``keep``."""
        if None in self._owner:
            return self._owner.index(None)
        victim = next((i for i in self._resident if i not in keep), None)
        if victim is None:
            raise LoRASlotsError(f"all {self.max_loras} LoRA slots are pinned by the running batch")
        slot = self._resident.pop(victim)
        self._owner[slot] = None
        return slot

    def _drop(self, lora_id: int) -> None:
        """Out of the CPU cache and out of its slot, which is zeroed so a stale index adds nothing."""
        del self._cpu[lora_id]
        slot = self._resident.pop(lora_id, None)
        if slot is not None:
            self._owner[slot] = None
            self._zero(slot)

    def _zero(self, slot: int) -> None:
        for stack in self.stacks.values():
            stack.a_stack[slot].zero_()
            stack.b_stack[slot].zero_()

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy an adapter into ``slot``: this rank's share of A, and of B times its scale (rounded once, to
        the slots' dtype, after the product in float32); all else in the slot zero."""
        self._zero(slot)
        for (layer, module), weights in adapter.modules.items():
            fused, shard = SHARD_OF[module]
            weights = shard_weights(weights, module, self.base, self.tp)
            stack = self.stacks[(layer, fused)]
            rank, first = weights.rank, sum(stack.shard_sizes[:shard])
            stack.a_stack[slot, shard, :rank].copy_(weights.lora_a)
            stack.b_stack[slot, first:first + stack.shard_sizes[shard], :rank].copy_(
                weights.lora_b.float() * weights.scaling)
