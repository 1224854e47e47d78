"""A draft model: a smaller registered model of the target's vocabulary, drafting k tokens a step autoregressively.

Its KV cache mirrors the target's: as many blocks, addressed by the same block tables (those of the target's
full-attention KV group), so it needs no block manager of its own, and a block the target frees frees the draft's
too. Its weights load before the target's memory profile and its blocks' bytes join the target's in the block
count (``ModelRunner``'s ``draft``), so both caches fit the memory budget.

The draft holds KV for a prefix of each sequence. Drafting a step first feeds it what the sequence gained since
(its prompt the first time; then the tokens after the last drafts it got right), sampling the first draft at the
last of them, then runs k - 1 one-token steps. Those write the KV of drafts 1..k-1, which stays valid as far as
the target accepted them: the next step's prefix is worked out from the tokens the sequence has by then
(``_valid_prefix``). A preempted or finished sequence's entry is forgotten (its blocks go), so a sequence always
writes its own blocks; a prompt's blocks shared through the prefix cache or a fork are rewritten with the same
tokens at the same positions.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from minfer.config import EngineConfig, ModelConfig
from minfer.distributed import SINGLE, Command, TensorParallel
from minfer.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from minfer.engine.sequence import Sequence
from minfer.engine.spec.draft_probs import DraftProbs, collect_drafts
from minfer.engine.cuda_graphs import DecodeGraphs
from minfer.engine.step_arrays import StepArrays, as_decode_rows, token_layout
from minfer.model.loader import build_model, resolve_model_path
from minfer.model.registry import load_model_config
from minfer.ops import select_ops
from minfer.spec_config import SpeculativeConfig

logger = logging.getLogger("minfer")
_NONE = np.zeros(0, dtype=np.int64)
GRAPH_CATCH_UP = 8  # a catch-up of at most this many tokens a sequence runs as decode rows in a graph


def attach_to_target(drafter: Any, runner: Any, what: str, graph_rows: int, forward: Any) -> None:
    """A drafter's KV cache beside the target's: as many blocks, addressed through the target's full-attention
    group's block tables (``drafter.group``); its decode graphs of up to ``graph_rows`` rows when the target
    captures graphs, and its eager kernel variants compiled, both before the first request."""
    windows = runner.kv_spec.windows
    if 0 not in windows:
        raise ValueError(f"speculative_config: {what} needs a target with full-attention layers (its KV groups' "
                         f"windows are {list(windows)})")
    drafter.runner, drafter.group = runner, windows.index(0)
    allocate_kv_cache(drafter.model.attention_layers(), drafter.kv_spec, runner.num_kv_blocks, drafter.device)
    if runner.graphs is not None:
        started = time.perf_counter()
        drafter.graphs = DecodeGraphs(drafter.model, graph_rows, runner.input_batch.block_tables.shape[2],
                                      drafter.block_size, drafter.device, forward=forward)
        drafter.graphs.capture()
        logger.info("start-up: %s's graph capture took %.2f s", what, time.perf_counter() - started)
    if drafter.device.type == "cuda" and drafter.ops.name == "triton":
        runner.warm_up_kernels(drafter.model, forward)


class DraftModel:
    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, target: ModelConfig, max_model_len: int,
                 device: torch.device, tp: TensorParallel = SINGLE) -> None:
        """Load the draft's weights (before the target's memory profile: see the module docstring); under tensor
        parallelism, this rank's shard of them (the draft is split as the target is)."""
        path = resolve_model_path(spec.model, None, config.download_dir, config.load_format)
        self.model_config = mc = load_model_config(path)
        if mc.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model {spec.model!r} has vocab_size {mc.vocab_size}, the target "
                             f"{target.vocab_size}: a draft model must share the target's vocabulary")
        if mc.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config.model {spec.model!r} has max_position_embeddings "
                             f"{mc.max_position_embeddings} < max_model_len {max_model_len}: lower max_model_len")
        self.device = device
        self.dtype = config.resolved_dtype(mc)
        self.block_size = config.block_size
        self.ops = select_ops(config.attention_backend, device, config.block_size, mc.max_head_dim,
                              config.max_num_batched_tokens)
        started = time.perf_counter()
        self.model = build_model(path, mc, self.dtype, device, max_model_len, self.ops, tp, None, config.load_format)
        if getattr(self.model, "state_layers", None):
            raise ValueError(f"speculative_config.model {spec.model!r} has recurrent layers: it cannot draft")
        logger.info("start-up: load the draft model took %.2f s", time.perf_counter() - started)
        self.forward = self.ops.model_forward(self.model)
        self.kv_spec = KVCacheSpec.for_layers(self.model.attention_layers(), config.block_size, self.dtype,
                                              config.kv_cache_dtype, max_model_len, hybrid=False)
        self.runner: Any = None  # the target's ModelRunner (its input batch, uploads, metadata and sampler)
        self.graphs: DecodeGraphs | None = None
        self.group = 0  # the target's KV group whose block tables the draft reads
        self.drafted: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (its length when drafting, the drafts)

    @property
    def block_bytes(self) -> int:
        return self.kv_spec.block_bytes

    def attach(self, runner: Any) -> None:
        """Allocate the draft's cache with the target's block count and read the target's block tables."""
        attach_to_target(self, runner, "a draft model", runner.config.max_num_seqs, self.forward)

    def prepare_target(self, model: Any) -> None:
        """Nothing: a draft model reads only the tokens (an EAGLE-3 head taps the target here)."""

    def note_step(self, seqs: list[Sequence], a: StepArrays) -> None:
        """Nothing: a draft model catches up from the tokens (an EAGLE-3 head from the step's hidden states)."""

    def forget(self, seq_ids: list[int]) -> None:
        """Sequences finished or preempted: their blocks are gone, and with them the draft's KV."""
        for seq_id in seq_ids:
            self.drafted.pop(seq_id, None)

    @torch.no_grad()
    def propose(self, seqs: list[Sequence], room: list[int], batch: list[Sequence]) -> DraftProbs | None:
        """Draft ``room[i]`` tokens for ``seqs[i]`` (``Sequence.spec_token_ids``) of the step's ``batch``; returns
        the distributions the sampling rows' drafts were drawn from (None when every row is greedy)."""
        if not seqs:
            return None
        runner = self.runner
        for seq in seqs:
            seq.spec_token_ids = []
        rows = runner.input_batch.rows(seqs)  # the block-table copies, brought up to date
        lengths = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
        starts = np.array([self._valid_prefix(s) for s in seqs], dtype=np.int64)
        counts = lengths - runner.input_batch.prompt_lens[rows]  # output tokens before the first draft
        self._catch_up(seqs, rows, lengths, starts, counts)
        order = np.argsort(lengths - starts > 1, kind="stable")  # one-token catch-ups are decodes: first
        ids = np.concatenate([np.asarray(seqs[i].token_ids[starts[i]:], dtype=np.int64) for i in order])
        tokens, probs = self._step([seqs[i] for i in order], rows[order], ids, None, starts[order],
                                   lengths[order] - starts[order], counts[order])
        steps = [(order, tokens, probs)]  # each step's sequences (in its order), draws and their q
        room_arr = np.asarray(room)
        for j in range(1, max(room)):  # one-token steps: draft j + 1 from draft j
            prev_order, prev_tokens, _ = steps[-1]
            keep = np.flatnonzero(room_arr[prev_order] > j)  # who goes on, as rows of the previous step
            active = prev_order[keep]
            tokens, probs = self._step([seqs[i] for i in active], rows[active], keep, prev_tokens, lengths[active] - 1 + j,
                                       np.ones(len(active), dtype=np.int64), counts[active] + j)
            steps.append((active, tokens, probs))
        probs = collect_drafts(seqs, steps)
        for seq, length in zip(seqs, lengths.tolist()):
            self.drafted[seq.seq_id] = (length, list(seq.spec_token_ids))
        return probs

    def _catch_up(self, seqs: list[Sequence], rows: np.ndarray, lengths: np.ndarray, starts: np.ndarray,
                  counts: np.ndarray) -> None:
        """Feed the draft, in steps of at most the engine's token budget, all but the last budget's worth of what the
        sequences gained since they last drafted (a whole prompt, the first time): one forward over a long prompt
        would take memory the start-up profile never saw. ``starts`` moves forward in place; the draws of these
        steps are not used."""
        budget = self.runner.config.max_num_batched_tokens
        while (lengths - starts).sum() > budget:
            take = np.zeros(len(seqs), dtype=np.int64)
            left = budget
            for i in np.flatnonzero(lengths - starts > 1):  # each keeps its last token for the drafting step
                take[i] = min(int(lengths[i] - starts[i]) - 1, left)
                left -= int(take[i])
            idx = np.flatnonzero(take)
            idx = idx[np.argsort(take[idx] > 1, kind="stable")]  # one-token rows first
            ids = np.concatenate([np.asarray(seqs[i].token_ids[starts[i]:starts[i] + take[i]], dtype=np.int64)
                                  for i in idx])
            self._step([seqs[i] for i in idx], rows[idx], ids, None, starts[idx], take[idx], counts[idx])
            starts[idx] += take[idx]

    def _valid_prefix(self, seq: Sequence) -> int:
        """How many of ``seq``'s first tokens have valid KV in the draft's cache: its known tokens when it last
        drafted, and the drafts it wrote KV for (all but the last) as far as the target accepted them."""
        last = self.drafted.get(seq.seq_id)
        if last is None:
            return 0
        length, drafts = last
        got = seq.token_ids[length:length + len(drafts)]
        matched = 0
        while matched < len(got) and got[matched] == drafts[matched]:
            matched += 1
        return min(length + min(matched, len(drafts) - 1), len(seq.token_ids) - 1)

    def _step(self, seqs: list[Sequence], rows: np.ndarray, ids: np.ndarray, prev: torch.Tensor | None,
              starts: np.ndarray, q_lens: np.ndarray, counts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft forward over each sequence's ``q_lens`` tokens from position ``starts`` (one-token ones first),
        drawing a token at each sequence's last: (tokens [S] on the device, their distributions or None). ``prev``
        None: ``ids`` are the tokens; else each sequence's one token is ``prev[ids[i]]``, the previous draft step's
        draw, read on the device. Under tensor parallelism the workers get the same arrays (``follow``)."""
        runner, ib, g = self.runner, self.runner.input_batch, self.group
        tables = ib.block_tables[g:g + 1, rows, :int(ib.num_blocks[g, rows].max())]
        cu, positions, slots = token_layout(q_lens, starts, tables, self.block_size)
        a = StepArrays(ids if prev is None else np.zeros(len(positions), dtype=np.int64), positions, slots, tables,
                       (starts + q_lens).astype(np.int32), q_lens, cu, cu[1:] - 1, int((q_lens == 1).sum()),
                       _NONE, _NONE, rows)
        src = ids if prev is not None else _NONE
        if runner.channel is not None:
            runner.channel.send(Command.DRAFT, [*a.message(_NONE.reshape(0, 2)), src])
        logits = self._forward(a, prev, src)
        tokens, probs = runner.sampler.draft(logits, ib.sampling_metadata(rows, counts, seqs))
        runner.tp.broadcast(tokens)  # the workers' source of the next draft step's tokens
        return tokens, probs

    def _forward(self, a: StepArrays, prev: torch.Tensor | None, src: np.ndarray) -> torch.Tensor:
        """The draft's logits at each sequence's last token, on every rank alike: a graph replay for one-token rows
        and short catch-ups (as decode rows), else an eager forward."""
        runner = self.runner
        if prev is not None:
            prev = prev.index_select(0, runner._upload(torch.int64, src)[0])
        if self.graphs is not None and a.q_lens.max() <= GRAPH_CATCH_UP:
            d = as_decode_rows(a)  # short catch-ups too: see step_arrays.as_decode_rows
            if self.graphs.can_run(len(d.ids), d.tables.shape[2]):
                from_prev = np.arange(len(d.ids)) if prev is not None else np.full(len(d.ids), -1, dtype=np.int64)
                _, logits = self.graphs.run(d.ids, d.positions, d.slots, from_prev, d.ctx_lens, d.tables, prev)
                if len(a.logit_rows) != len(d.ids):
                    logits = logits[runner._upload(torch.int64, a.logit_rows)[0]]
                return logits
        positions, logit_rows, slots = runner._upload(torch.int64, a.positions, a.logit_rows, a.slots[0])
        ids = prev if prev is not None else runner._upload(torch.int64, a.ids)[0]
        hidden = self.forward(ids, positions, runner._metadata(a, [slots]))
        return self.model.compute_logits(hidden[logit_rows], float32=False)

    @torch.no_grad()
    def follow(self, arrays: list[np.ndarray], prev: torch.Tensor | None) -> torch.Tensor:
        """A tensor-parallel worker's part of a draft step (``Command.DRAFT``): the same forward and LM-head gather
        as rank 0's ``_step``; returns rank 0's draws, the source of the next draft step's tokens."""
        a, _ = StepArrays.from_message(arrays[:-1])
        src = arrays[-1]
        self._forward(a, prev if len(src) else None, src)
        return self.runner.tp.broadcast(torch.empty(len(a.logit_rows), dtype=torch.int64, device=self.device))
