"""Speculator: whether a step speculates, its drafts, and how many of them the target accepted.

A speculative step (``Scheduler.schedule(num_spec=k)``) reserves up to k more tokens for each decoding sequence;
``propose`` drafts them (n-gram lookup on the host, or a draft model's forwards) and the step gives back the
reservations it has no drafts for (``SchedulerOutput.settle_drafts``). The target scores the last known token and
the drafts in one forward and the sampler verifies them (``Sampler.verify``).

The rules that switch it off: a step that would run ``disable_by_batch_size`` sequences or more runs without
drafts, and as an ordinary async step; a sequence that drafted nothing (no n-gram match) or whose drafts were all
rejected, two steps in a row, drafts nothing for the next 4, 8, .. 64 steps (doubling while it keeps missing; one
accepted draft resets it), and a step in which every running sequence waits so runs as an ordinary async step too:
where drafts never hit, every speculative step would pay for scoring them and for its lost overlap. Drafting needs
each sequence's latest token on the host, so a speculative step completes before the next is scheduled (no
host/GPU overlap): that costs little where speculation pays (small batches, bound by reading the weights) and much
where it does not (large batches, where a step's weight reads already serve many tokens and the verify tokens'
compute is not free).
"""
from __future__ import annotations

from typing import Any

from minfer.engine.scheduler import SchedulerOutput
from minfer.engine.sequence import Sequence
from minfer.engine.spec.draft_probs import DraftProbs
from minfer.engine.spec.ngram import ngram_draft
from minfer.spec_config import SpeculativeConfig


BACKOFF_AFTER = 2  # steps in a row without an accepted draft before a sequence pauses drafting
MAX_BACKOFF_STEPS = 64


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Any = None) -> None:
        """``drafter``: the draft model (``DraftModel``) or EAGLE-3 head (``Eagle3Drafter``); None for n-gram."""
        self.config = config
        self.drafter = drafter
        self.num_drafts = 0  # verified steps of sequences that drafted at least one token
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens  # drafts accepted at position i
        self.steps = 0  # speculative steps proposed so far: the clock of the back-off
        self.misses: dict[int, int] = {}  # seq_id -> verifications in a row that rejected every draft
        self.resume_at: dict[int, int] = {}  # seq_id -> the step from which it drafts again

    @property
    def num_speculative_tokens(self) -> int:
        return self.config.num_speculative_tokens

    def active(self, running: list[Sequence]) -> bool:
        """Whether the next step speculates: fewer than ``disable_by_batch_size`` sequences run, and one of them is
        not backing off."""
        limit = self.config.disable_by_batch_size
        if limit and len(running) >= limit:
            return False
        resume_at = self.resume_at
        return not resume_at or any(resume_at.get(s.seq_id, 0) <= self.steps for s in running)

    def forget(self, seq_ids: list[int]) -> None:
        """Sequences finished or preempted (their blocks, and a draft model's KV in them, are gone)."""
        if not seq_ids:
            return
        for seq_id in seq_ids:
            self.misses.pop(seq_id, None)
            self.resume_at.pop(seq_id, None)
        if self.drafter is not None:
            self.drafter.forget(seq_ids)

    def propose(self, batch: SchedulerOutput) -> DraftProbs | None:
        """Draft for every sequence the step reserved tokens for, then settle the step; returns the draft
        distributions of a draft model that samples (None for n-gram drafts)."""
        self.steps += 1
        reserved = [s for s in batch.seqs if s.num_computed_tokens + s.num_scheduled_tokens > len(s.token_ids)
                    and self.resume_at.get(s.seq_id, 0) <= self.steps]
        probs = None
        room = [s.num_computed_tokens + s.num_scheduled_tokens - len(s.token_ids) for s in reserved]
        if self.drafter is not None:  # even with no one to draft for: an EAGLE-3 head is fed every such step
            probs = self.drafter.propose(reserved, room, batch.seqs)
        else:
            cfg = self.config
            for seq, k in zip(reserved, room):
                seq.spec_token_ids = ngram_draft(seq.token_ids, k, cfg.prompt_lookup_min, cfg.prompt_lookup_max)
        for seq in reserved:
            if not seq.spec_token_ids:  # nothing to draft (no n-gram match): a miss, as all-rejected drafts are
                self._miss(seq.seq_id)
        batch.settle_drafts()
        return probs

    def record(self, seq_id: int, drafted: int, emitted: int) -> None:
        """A sequence verified ``drafted`` tokens and emitted ``emitted`` (the accepted ones, then one more)."""
        if not drafted:
            return
        accepted = min(emitted - 1, drafted)
        if accepted:
            self.misses.pop(seq_id, None)
            self.resume_at.pop(seq_id, None)
        else:
            self._miss(seq_id)
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def _miss(self, seq_id: int) -> None:
        misses = self.misses[seq_id] = self.misses.get(seq_id, 0) + 1
        if misses >= BACKOFF_AFTER:
            self.resume_at[seq_id] = self.steps + min(2 ** misses, MAX_BACKOFF_STEPS)

    def stats(self) -> dict[str, Any]:
        """vLLM's ``spec_decode_*`` counters, and the acceptance rate overall and per drafted position."""
        drafts = self.num_drafts
        return {
            "spec_decode_method": self.config.method,
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens
            if self.num_draft_tokens else 0.0,
            "spec_decode_acceptance_rate_per_pos": [n / drafts if drafts else 0.0 for n in self.accepted_per_pos],
            # tokens a sequence gains per verified step: 1 + the accepted drafts
            "spec_decode_mean_acceptance_length": 1 + self.num_accepted_tokens / drafts if drafts else 1.0,
        }
