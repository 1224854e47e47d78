"""InputBatch: the model runner's per-sequence rows, kept from step to step.

A running sequence keeps one row while it runs: the runner's int32 copy of its block table, its
sampling parameters and seed, and its row in the last launched step's sampled ids (the source of a
pending token). Rows are filled when a sequence is first scheduled and freed when the scheduler
reports it finished or preempted, so a step's inputs and its ``SamplingMetadata`` are gathers over
these arrays instead of walks over Python objects: flattening every block table from Python ints
each step cost about 1 ms at 256 sequences of 1k tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minfer.engine.logit_bias import LogitBias
from minfer.engine.sequence import Sequence
from minfer.sampling_params import SamplingParams


@dataclass(slots=True)
class RowFacts:
    """What a set of sampling rows samples with, fixed while the same rows sample in the same order
    (the steady state of decoding), so it is built once and reused step after step."""

    params: list[SamplingParams]
    seeds: np.ndarray  # [R] uint64
    prompt_lens: np.ndarray  # [R] int64
    eos_token_ids: list[frozenset[int]]
    want_logprobs: list[int | None]
    greedy: list[bool]
    inv_temps: torch.Tensor  # [R] float32 on the device: 1 / temperature (1.0 on greedy rows)
    any_logprobs: bool
    any_penalties: bool
    any_min_tokens: bool  # an unconstrained row with min_tokens (a grammar decides when its output ends)
    any_filters: bool  # top-k, top-p or min-p
    bias: LogitBias | None  # the rows' logit_bias and allowed_token_ids; None when no row has either

    @classmethod
    def build(cls, params: list[SamplingParams], seeds: np.ndarray, prompt_lens: np.ndarray,
              eos_token_ids: list[frozenset[int]], device: torch.device) -> "RowFacts":
        greedy = [p.greedy for p in params]
        want_logprobs = [p.logprobs for p in params]
        inv = np.array([1.0 if g else 1.0 / p.temperature for g, p in zip(greedy, params)], dtype=np.float32)
        bias = LogitBias.build(params, lambda a: to_device(a, device)) if any(p.has_bias for p in params) else None
        return cls(params, seeds, prompt_lens, eos_token_ids, want_logprobs, greedy, to_device(inv, device),
                   any(k is not None for k in want_logprobs), any(p.has_penalties for p in params),
                   any(p.min_tokens > 0 and p.structured_outputs is None for p in params),
                   any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params), bias)


@dataclass(slots=True)
class SamplingMetadata:
    """A step's sampling rows (row r of the logits) as the sampler reads them."""

    rows: RowFacts
    output_counts: np.ndarray  # [R] int64: output tokens before this draw (the noise's counter)
    token_ids: list[list[int]] | None = None  # every known token of each row; only when penalties apply

    @classmethod
    def from_params(cls, params: list[SamplingParams], seeds: list[int], output_counts: list[int],
                    device: torch.device, token_ids: list[list[int]] | None = None,
                    prompt_lens: list[int] | None = None,
                    eos_token_ids: list[frozenset[int]] | None = None) -> "SamplingMetadata":
        """Metadata for rows given directly (tests, tools): no input batch needed."""
        n = len(params)
        facts = RowFacts.build(params, np.array(seeds, dtype=np.uint64),
                               np.array(prompt_lens if prompt_lens is not None else [0] * n, dtype=np.int64),
                               eos_token_ids or [frozenset()] * n, device)
        return cls(facts, np.array(output_counts, dtype=np.int64), token_ids)


def to_device(values: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device, through pinned memory on CUDA (an asynchronous copy)."""
    host = torch.from_numpy(values)
    if device.type != "cuda":
        return host
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)


class InputBatch:
    def __init__(self, max_rows: int, max_blocks_per_seq: int, device: torch.device, num_groups: int = 1) -> None:
        """``num_groups``: the KV groups, each with its own block table per sequence."""
        self.device = device
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self.block_tables = np.zeros((num_groups, max_rows, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros((num_groups, max_rows), dtype=np.int64)
        # the block-table list each (group, row) copies
        self._table_of: list[list[list[int] | None]] = [[None] * max_rows for _ in range(num_groups)]
        self.sample_row = np.full(max_rows, -1, dtype=np.int64)  # row in the last launched step's sampled ids
        self.seeds = np.zeros(max_rows, dtype=np.uint64)
        self.prompt_lens = np.zeros(max_rows, dtype=np.int64)
        self.params: list[SamplingParams | None] = [None] * max_rows
        self.eos_token_ids: list[frozenset[int]] = [frozenset()] * max_rows
        self._facts_key: bytes | None = None
        self._facts: RowFacts | None = None

    def free(self, seq_ids: list[int]) -> None:
        """Give back the rows of sequences that finished or were preempted."""
        for seq_id in seq_ids:
            row = self.row_of.pop(seq_id, None)
            if row is not None:
                self._free_rows.append(row)
                self.params[row] = None
                for tables in self._table_of:
                    tables[row] = None
                self._facts_key = None  # a row may now be refilled by another sequence

    def rows(self, seqs: list[Sequence]) -> np.ndarray:
        """Each sequence's row (filled on first sight), with its block-table copies brought up to date.

        A block table only grows by ``append`` (any other change puts a new list in its place), so a
        row whose list is the same object needs only the appended entries."""
        rows = np.empty(len(seqs), dtype=np.int64)
        row_of = self.row_of
        groups = list(zip(self._table_of, self.num_blocks, self.block_tables))
        for i, s in enumerate(seqs):  # plain attributes: this loop runs for every sequence every step
            row = row_of.get(s.seq_id)
            if row is None:
                row = self._add(s)
            for table, (table_of, num_blocks, tables) in zip(s.block_tables, groups):
                n = num_blocks[row]
                if table_of[row] is not table:
                    tables[row, :len(table)] = table
                    table_of[row], num_blocks[row] = table, len(table)
                elif n != len(table):
                    tables[row, n:len(table)] = table[n:]
                    num_blocks[row] = len(table)
            rows[i] = row
        return rows

    def _add(self, seq: Sequence) -> int:
        if not self._free_rows:
            raise RuntimeError(f"the input batch has no free row for sequence {seq.seq_id} "
                               f"({len(self.row_of)} rows in use)")
        row = self._free_rows.pop()
        self.row_of[seq.seq_id] = row
        for tables in self._table_of:
            tables[row] = None
        self.num_blocks[:, row] = 0
        self.sample_row[row] = -1
        self.seeds[row] = seq.seed
        self.prompt_lens[row] = len(seq.prompt_token_ids)
        self.params[row] = seq.params
        self.eos_token_ids[row] = seq.eos_token_ids
        return row

    def sampling_metadata(self, rows: np.ndarray, output_counts: np.ndarray,
                          seqs: list[Sequence]) -> SamplingMetadata:
        """Metadata of the sampling rows ``rows`` (in logits order); ``seqs`` supply token histories
        when penalties apply. The per-row facts are rebuilt only when the rows or their order change."""
        key = rows.tobytes()
        facts = self._facts
        if facts is None or key != self._facts_key:
            facts = self._facts = RowFacts.build([self.params[r] for r in rows.tolist()], self.seeds[rows],
                                                 self.prompt_lens[rows],
                                                 [self.eos_token_ids[r] for r in rows.tolist()], self.device)
            self._facts_key = key
        token_ids = [s.token_ids[:s.num_known_tokens] for s in seqs] if facts.any_penalties else None
        return SamplingMetadata(facts, output_counts, token_ids)
