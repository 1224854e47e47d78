"""CUDA-graph replay of pure-decode steps.

A decode step of a small model is dozens of short kernels per layer; launched one by one from
Python, the GPU idles between them (the first profile of workload A showed it busy 20% of the
time). Here the model's forward over ``b`` single-token sequences is captured once per batch
bucket ``b`` and replayed with new inputs staged into static buffers (one packed upload, one
scatter kernel: ``kernels/stage_inputs.py``). A real batch of ``n`` sequences runs in the smallest
bucket ``b >= n``; the ``b - n`` padding rows write their K/V to slot -1 (which the store kernel
skips) and attend over one token, so they never touch a live sequence's cache. All buckets share
one memory pool. Only the Triton ops are captured (the torch ops size their work from host integers),
through the runner's step forward: the batch-1 bucket takes their fused one-token forward. Under
tensor parallelism every rank captures the same buckets, the collectives inside them.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from minfer.kernels.stage_inputs import pack_decode_inputs, packed_words, stage_decode_inputs
from minfer.ops import AttentionMetadata, ModelForward

logger = logging.getLogger("minfer")


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 (and max_batch itself)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch + 1, 8))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_batch: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, forward: ModelForward | None = None, num_groups: int = 1,
                 state_slots: int = 0, lora: Any = None) -> None:
        """``num_groups``: the KV groups, each with its own slot mapping and block tables. ``state_slots``: the
        state cache's slots when the model has recurrent layers (the last one takes the padding rows). ``lora``:
        the engine's ``LoRAManager``, whose static token-to-slot buffers the graphs read (refilled each replay)."""
        self.model = model
        self.lora = lora
        self.forward = model if forward is None else forward  # the runner's: Ops.model_forward(model)
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.block_size = block_size
        b, dev = self.max_batch, device
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((num_groups, b), -1, dtype=torch.int64, device=dev)
        self.context_lens = torch.ones(b, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(num_groups, b, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.spare_slot = state_slots - 1
        if state_slots:  # each row's state slot and whether it has a state (a one-token prompt has none)
            self.state_slots = torch.full((b,), self.spare_slot, dtype=torch.int32, device=dev)
            self.has_state = torch.ones(b, dtype=torch.bool, device=dev)
            self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        # The LM head runs in the graph too (eagerly it was three more launches per step, on the host's
        # critical path at small batches), into one logits buffer that every bucket shares.
        # (the whole vocabulary's: under tensor parallelism the graph holds the logits gather)
        self.logits = torch.empty(b, model.config.vocab_size, dtype=model.lm_head.weight.dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # With LoRA on, each bucket is captured twice: with the adapters' launches (reading the static slots) and,
        # for the steps in which no row has an adapter, without them (their kernels would only exit at once).
        self.plain: dict[int, torch.cuda.CUDAGraph] = {}
        self.plain_outputs: dict[int, torch.Tensor] = {}

    def _meta(self, b: int) -> AttentionMetadata:
        state = {} if self.spare_slot < 0 else dict(state_slots=self.state_slots[:b], has_state=self.has_state[:b],
                                                    query_start_loc=self.query_start_loc[:b + 1])
        return AttentionMetadata(
            slot_mapping=[s[:b] for s in self.slot_mapping], block_tables=[t[:b] for t in self.block_tables],
            context_lens=self.context_lens[:b], num_decodes=b, block_size=self.block_size, **state)

    @torch.no_grad()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first so the pool is sized by the first."""
        # The staging kernel compiles now, not in the first decode step.
        packed = torch.zeros(packed_words(1, 1, len(self.block_tables)), dtype=torch.int64,
                             device=self.input_ids.device)
        stage_decode_inputs(packed, 1, 1, None, self.input_ids, self.positions, self.slot_mapping, self.context_lens,
                            self.block_tables)
        pool = None
        for b in reversed(self.sizes):
            meta = self._meta(b)
            for adapters in (True, False) if self.lora is not None else (False,):
                if self.lora is not None:
                    self._use_lora(b, adapters)
                self._forward(b, meta)  # compile kernels, settle allocations
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(b, meta)
                pool = graph.pool()
                graphs, outputs = (self.graphs, self.outputs) if adapters or self.lora is None else \
                    (self.plain, self.plain_outputs)
                graphs[b], outputs[b] = graph, out
        torch.cuda.synchronize()
        if self.lora is not None:
            self.lora.state.meta = None  # eager forwards set their own
        logger.info("captured %d decode CUDA graphs (batch %d..%d)", len(self.graphs), self.sizes[0], self.max_batch)

    def _forward(self, b: int, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.forward(self.input_ids[:b], self.positions[:b], meta)
        self.model.compute_logits(hidden, float32=False, out=self.logits[:b])
        return hidden

    def can_run(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.max_batch and max_blocks <= self.block_tables.shape[2]

    def run(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, src_rows: np.ndarray,
            ctx_lens: np.ndarray, tables: np.ndarray, prev_tokens: torch.Tensor | None,
            state_rows: np.ndarray | None = None, lora_slots: np.ndarray | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the smallest bucket that holds this decode batch of ``n`` sequences (host arrays; a row
        with ``src_rows[i] >= 0`` takes its input id from ``prev_tokens[src_rows[i]]``, on the device).
        The inputs go up packed in one copy and one kernel scatters them into the graph's buffers
        (``kernels/stage_inputs.py``). Returns hidden states [n, H] and model-dtype logits [n, vocab],
        views of the graph's buffers valid until the next replay (work queued before it, like the draws,
        reads them in time)."""
        groups, n, width = tables.shape
        b = next(s for s in self.sizes if s >= n)
        host = torch.empty(packed_words(n, width, groups), dtype=torch.int64, pin_memory=self.input_ids.is_cuda)
        pack_decode_inputs(host.numpy(), ids, positions, slots, src_rows, ctx_lens, tables)
        packed = host.to(self.input_ids.device, non_blocking=True)
        stage_decode_inputs(packed, n, width, prev_tokens, self.input_ids[:b], self.positions[:b],
                            self.slot_mapping[:, :b], self.context_lens[:b], self.block_tables[:, :b])
        if self.spare_slot >= 0:  # recurrent layers: the rows' state slots (``state_rows``), padding to the spare
            self._stage_state(n, b, state_rows, ctx_lens)
        adapters = lora_slots is not None and bool((lora_slots >= 0).any())
        if adapters:  # each row's LoRA slot (``lora_slots``), the padding rows' none
            self.lora.stage(lora_slots, n, b)
        graphs, outputs = (self.plain, self.plain_outputs) if self.lora is not None and not adapters else \
            (self.graphs, self.outputs)
        if b in graphs:
            graphs[b].replay()
            hidden = outputs[b]
        else:  # uncaptured: the same buffers, eagerly
            if self.lora is not None:
                self._use_lora(b, adapters)
            hidden = self._forward(b, self._meta(b))
        return hidden[:n], self.logits[:n]

    def _use_lora(self, b: int, adapters: bool) -> None:
        """The adapters' static slots for a forward of ``b`` rows, or none (the projections skip their kernels)."""
        if adapters:
            self.lora.use_static(b)
        else:
            self.lora.state.meta = None

    def _stage_state(self, n: int, b: int, rows: np.ndarray, ctx_lens: np.ndarray) -> None:
        """The state slots and has-state flags of a replay's ``n`` rows (one more small upload), the padding
        rows' slot the spare one (their writes land there, read by no sequence)."""
        host = torch.empty(2 * n, dtype=torch.int32, pin_memory=self.input_ids.is_cuda)
        host[:n] = torch.from_numpy(rows.astype(np.int32))
        host[n:] = torch.from_numpy((ctx_lens > 1).astype(np.int32))  # a decode's one token: it has a state
        dev = host.to(self.input_ids.device, non_blocking=True)
        self.state_slots[:n].copy_(dev[:n])
        self.state_slots[n:b].fill_(self.spare_slot)
        self.has_state[:n].copy_(dev[n:] != 0)
