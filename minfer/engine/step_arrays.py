"""A step's inputs on the host (``StepArrays``), as the model runner builds them with numpy and sends them to
tensor-parallel followers, and made-up steps for start-up work (the memory profile, kernel warm-up)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


_NONE = np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class StepArrays:
    """A step's inputs on the host, built with numpy over per-sequence arrays."""

    ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [G, T] int64: each KV group's cache slot of each token
    tables: np.ndarray  # [G, S, max_blocks] int32: each KV group's block tables
    ctx_lens: np.ndarray  # [S] int32
    q_lens: np.ndarray  # [S] int64
    cu: np.ndarray  # [S + 1] int64
    logit_rows: np.ndarray  # rows whose sequence samples this step
    num_decodes: int
    fill_dst: np.ndarray  # token indices whose id is still on the device (a pending token) ...
    fill_src: np.ndarray  # ... and their rows in the previous step's sampled ids
    batch_rows: np.ndarray | None = None  # each sequence's input-batch row
    num_tokens: np.ndarray | None = None  # each sequence's tokens, pending ones included
    samples: np.ndarray | None = None  # [S] bool: the sequence reaches its last token and samples
    spec_lens: np.ndarray | None = None  # [S] int64: drafted tokens each sequence verifies (a speculative step)
    verify: bool = False  # a speculative step without prompt chunks: it runs as one-token rows (``as_decode_rows``)
    lora_slots: np.ndarray | None = None  # [T] each token's LoRA adapter slot (-1: none); None without LoRA

    def message(self, prompt_logprob_rows: np.ndarray) -> list[np.ndarray]:
        """The arrays a follower needs to run the same forward (``StepChannel``), with the hidden-state
        row ranges whose logits prompt logprobs read (``[k, 2]``)."""
        return [self.ids, self.positions, self.slots, self.tables, self.ctx_lens, self.q_lens, self.cu,
                self.logit_rows, self.fill_dst, self.fill_src, np.array([self.num_decodes, self.verify]),
                prompt_logprob_rows, self.batch_rows, _NONE if self.lora_slots is None else self.lora_slots]

    @classmethod
    def from_message(cls, arrays: list[np.ndarray]) -> tuple["StepArrays", np.ndarray]:
        """(The step, the prompt-logprob row ranges); the batch rows are the state slots of recurrent layers."""
        ids, positions, slots, tables, ctx_lens, q_lens, cu, logit_rows, fill_dst, fill_src, nd, plp, rows, lora = arrays
        return cls(ids, positions, slots, tables.astype(np.int32), ctx_lens.astype(np.int32), q_lens, cu,
                   logit_rows, int(nd[0]), fill_dst, fill_src, rows, verify=bool(nd[1]),
                   lora_slots=lora if len(lora) else None), plp


def token_layout(q_lens: np.ndarray, starts: np.ndarray, tables: np.ndarray, block_size: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where a step's tokens go, from each sequence's ``q_lens`` tokens from position ``starts``: (``cu`` [S + 1],
    each token's position [T], its cache slot in each KV group [G, T] through ``tables`` [G, S, width])."""
    cu = np.zeros(len(q_lens) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    seq_of_token = np.repeat(np.arange(len(q_lens)), q_lens)
    positions = np.arange(int(cu[-1])) - cu[seq_of_token] + starts[seq_of_token]
    slots = tables[:, seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return cu, positions, slots


def as_decode_rows(a: StepArrays) -> StepArrays:
    """A verify step with every token a one-token row of its own: the token at position p attends over positions
    [0, p] through its sequence's block table, which is causal attention over the drafts, since the step stores
    every token's K/V before any row attends. So the decode path (its CUDA graphs, the bucket of the step's token
    count) scores all the drafts in one replay, where the prefill path would run eagerly; each row reads its
    sequence's context again, which costs little beside the weights at the batch sizes that speculate."""
    seq_of_token = np.repeat(np.arange(len(a.q_lens)), a.q_lens)
    n = len(a.ids)
    return StepArrays(a.ids, a.positions, a.slots, np.ascontiguousarray(a.tables[:, seq_of_token]),
                      (a.positions + 1).astype(np.int32), np.ones(n, dtype=np.int64), np.arange(n + 1),
                      a.logit_rows, n, a.fill_dst, a.fill_src,
                      a.batch_rows[seq_of_token] if a.batch_rows is not None else None, lora_slots=a.lora_slots)


def synthetic_step(q_lens: list[int], ctx_lens: list[int], tables: np.ndarray, groups: int = 1) -> StepArrays:
    """Step arrays of made-up sequences (token 0 everywhere, each token's slot = its position, the same
    ``tables`` [S, width] in each of ``groups`` KV groups), for the start-up memory profile and kernel warm-up;
    decodes (q_len 1) must come first."""
    q = np.array(q_lens, dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(q)])
    n, none = int(cu[-1]), np.zeros(0, dtype=np.int64)
    positions = np.concatenate([np.arange(c - l, c) for l, c in zip(q_lens, ctx_lens)])
    return StepArrays(np.zeros(n, dtype=np.int64), positions, np.tile(positions, (groups, 1)),
                      np.tile(tables, (groups, 1, 1)),
                      np.array(ctx_lens, dtype=np.int32), q, cu, cu[1:] - 1, int((q == 1).sum()), none, none)
