"""The engine's LoRA adapters (``enable_lora``): their slot table, the model's wrapped projections, each step's
token-to-slot map.

Each step ``activate``s its sequences' adapters in the slot table (``minfer.lora.LoRASlots``: loads from the host
cache into free or least recently used slots, never one the step uses; the copies queue on the stream after the
work already launched, so a slot an in-flight step still reads is rewritten only once it is done) and gives each
token its slot. An eager forward reads a fresh grouping (``set_eager``); a CUDA graph was captured reading static
buffers, refilled before each replay (``stage``, called by ``DecodeGraphs``). The scheduler keeps a step to at most
``max_loras`` adapters (``Scheduler``'s admission), so activation never runs out of slots.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from minfer.config import EngineConfig, ModelConfig
from minfer.distributed import SINGLE, Command, StepChannel, TensorParallel
from minfer.engine.sequence import Sequence
from minfer.kernels.lora.lora_meta import LoraMeta, build_lora_meta
from minfer.lora.layout import BaseLinears
from minfer.lora.request import LoRARequest
from minfer.lora.slots import LoRASlots
from minfer.model.layers.lora import LoRAState, attach_lora
from minfer.ops import Ops


class LoRAManager:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model: Any, dtype: torch.dtype,
                 device: torch.device, ops: Ops, max_rows: int, tp: TensorParallel = SINGLE,
                 channel: StepChannel | None = None) -> None:
        """Allocate ``max_loras`` slots (before the memory profile, which then counts them) and wrap ``model``'s
        projections; ``max_rows``: the most rows a captured graph runs. Under tensor parallelism each rank's slots
        hold its share of every adapter (split as the base layers are; a row-parallel layer's partial product
        takes its share of A and the whole B before the sum over ranks); rank 0 chooses the slots and sends each
        write down ``channel`` (``Command.LORA``), and the token slots go with each step."""
        self.max_loras = config.max_loras
        self.channel = channel
        self.slots = LoRASlots(BaseLinears.from_model_config(model_config), config.max_loras, config.max_lora_rank,
                               dtype, device, config.max_cpu_loras, tp)
        self.state = LoRAState(ops)
        attach_lora(model, self.slots.stacks, self.state)
        self.device = device
        self.static = build_lora_meta(torch.full((max_rows,), -1, dtype=torch.int32, device=device), config.max_loras)

    # ---- adapters ---------------------------------------------------------------------------
    def add(self, request: LoRARequest) -> bool:
        """Load and check ``request``'s adapter into the host cache (vLLM's ``add_lora``); False when it is there
        already. A bad adapter raises ``LoRAAdapterError`` naming the problem and leaves nothing loaded."""
        return self.slots.add(request)

    def remove(self, lora_int_id: int) -> bool:
        return self.slots.remove(lora_int_id)

    def list(self) -> dict[int, LoRARequest]:
        return self.slots.list_adapters()

    # ---- steps ------------------------------------------------------------------------------
    def step_slots(self, seqs: list[Sequence]) -> np.ndarray:
        """Each sequence's slot (-1: the base model), its adapter made resident (and on every rank)."""
        slots = np.asarray(self.slots.activate([s.lora_request for s in seqs]), dtype=np.int64)
        for slot, request in self.slots.take_placed():
            if self.channel is not None:
                self.channel.send(Command.LORA, [np.array([slot, request.lora_int_id]), _encode(request.lora_name),
                                                 _encode(request.lora_path)])
        return slots

    def follow(self, arrays: list[np.ndarray]) -> None:
        """A tensor-parallel worker's part of rank 0's slot write (``Command.LORA``)."""
        (slot, lora_id), name, path = arrays[0].tolist(), _decode(arrays[1]), _decode(arrays[2])
        self.slots.place(LoRARequest(name, lora_id, path), slot)

    def set_eager(self, token_slots: np.ndarray | None, upload: Any) -> None:
        """An eager forward's grouping (None when no token has an adapter: the projections skip the kernels)."""
        if token_slots is None or not (token_slots >= 0).any():
            self.state.meta = None
            return
        self.state.meta = build_lora_meta(upload(torch.int64, token_slots)[0], self.max_loras)

    def use_static(self, rows: int) -> None:
        """What a graph of ``rows`` rows captures: the static buffers' first ``rows`` entries."""
        s = self.static
        self.state.meta = LoraMeta(s.token_slots[:rows], s.sorted_tokens[:rows], s.slot_counts)

    def stage(self, row_slots: np.ndarray | None, n: int, rows: int) -> None:
        """Refill the static buffers for a replay of ``rows`` rows whose first ``n`` carry ``row_slots``."""
        slots = torch.full((rows,), -1, dtype=torch.int32)
        if row_slots is not None:
            slots[:n] = torch.from_numpy(row_slots.astype(np.int32))
        s = self.static
        build_lora_meta(slots.to(self.device, non_blocking=True), self.max_loras,
                        out=LoraMeta(s.token_slots[:rows], s.sorted_tokens[:rows], s.slot_counts))


def _encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.int64)


def _decode(words: np.ndarray) -> str:
    return words.astype(np.uint8).tobytes().decode()


class EngineLoRA:
    """``LLMEngine``'s LoRA calls (vLLM's names), on the runner's manager (None: ``enable_lora`` is off)."""

    runner: Any
    scheduler: Any
    _compiling: dict[str, Any]

    def _lora(self) -> LoRAManager:
        if self.runner.lora is None:
            raise ValueError("lora_request needs LLM(..., enable_lora=True) (the server: --enable-lora)")
        return self.runner.lora

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter ahead of its requests; False when it is loaded already."""
        return self._lora().add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; refused while a request of it is queued, compiling its grammar or running (a later
        step would load it again from its folder): finish or abort those first."""
        compiling = (s for _, seqs in self._compiling.values() for s in seqs)
        if any(s.lora_id == lora_int_id for s in (*self.scheduler.running, *self.scheduler.waiting, *compiling)):
            raise ValueError(f"LoRA adapter {lora_int_id} has requests in flight: finish or abort them first")
        return self._lora().remove(lora_int_id)

    def list_loras(self) -> dict[int, LoRARequest]:
        return self._lora().list()

    def _lora_stats(self) -> dict[str, Any]:
        """vLLM's ``lora_requests_info``: the adapters of the running and the waiting sequences, and max_lora. Waiting
        as vLLM counts it (``engine_stats``' ``num_requests_waiting``): queued, unforked samples, grammars compiling."""
        if self.runner.lora is None:
            return {}
        names = lambda seqs: sorted({s.lora_request.lora_name for s in seqs if s.lora_request})  # noqa: E731
        sched = self.scheduler
        waiting = [*sched.waiting, *(s for seqs in sched.unforked.values() for s in seqs),
                   *(s for _, seqs in self._compiling.values() for s in seqs)]
        return {"lora_requests_info": {"running_lora_adapters": names(sched.running),
                                       "waiting_lora_adapters": names(waiting),
                                       "max_lora": self.runner.lora.max_loras}}
