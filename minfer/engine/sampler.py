"""Sampler: turns the logits of the sampling rows into next tokens, on the device, batched.

Randomness comes from a counter-based hash of (the sample's seed, its output index, the token
id) rather than from a shared generator, so a seeded request draws the same numbers whatever else
is in the batch, after a preemption too, and no per-request generator objects are needed. With
uniform noise u, ``argmax(logits/T - log(-log u))`` is an exact draw from softmax(logits/T)
(the Gumbel-max trick). Speculative steps go through the same processing: ``verify`` judges drafted tokens
(the rejection step itself is ``rejection_sampler``'s) and ``draft`` draws a draft model's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from minfer.engine.input_batch import SamplingMetadata
from minfer.engine.rejection_sampler import ACCEPT_SALT, DRAFT_SALT, SpecLayout, emit, judge_drafts, salted
from minfer.ops import Ops
from minfer.ops.torch_sampling import mix32, noise_from_row_hash

_M32 = 0xFFFFFFFF


def row_hash(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Per-row 32-bit hash of (seed, output index): the row part of the noise. Takes int64 tensors or
    uint64 numpy arrays alike; the sampler hashes on the host, where 256 rows cost a few microseconds
    against a dozen tiny kernels on the device."""
    return mix32((mix32(seeds & _M32) ^ (seeds >> 32)) ^ ((counters * 0x9E3779B1) & _M32))


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u[r, v] in (0, 1), a pure function of (seeds[r], counters[r], v)."""
    return noise_from_row_hash(row_hash(seeds, counters), vocab_size)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None  # per row: chosen token and the top-k, or None


def _queue_copy(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Device tensors' copies into pinned host memory, queued behind the kernels that make them, and the event
    that marks them done (None off CUDA, where the tensors are the host's already)."""
    if not tensors[0].is_cuda:
        return tensors, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, d in zip(host, tensors):
        h.copy_(d, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def _entry(token: int, chosen: float, top_ids: list[int], top_vals: list[float], want: int) -> dict[int, float]:
    """A logprobs entry: the drawn token's and the top ``want`` (the drawn one first, not repeated)."""
    entry = {token: chosen}
    entry.update((i, v) for i, v in zip(top_ids[:want], top_vals[:want]) if i not in entry)
    return entry


def top_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, want: list[int | None]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the device: each row's logprob of ``token_ids`` and its top ``max(want)`` (values, ids)."""
    k = max(w or 0 for w in want)
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    return logprobs.gather(-1, token_ids[:, None]).squeeze(-1), top_vals, top_ids


@dataclass(slots=True)
class DeviceSample:
    """A step's draws while they are still on the device.

    ``start_copy`` queues their copy into pinned host memory behind the step's kernels and records
    an event; ``result`` waits for that event only, so the host can prepare and launch the next
    step in between (async scheduling). ``token_ids`` stays on the device for the next step's inputs.
    """

    token_ids: torch.Tensor  # [R] int64
    want_logprobs: list[int | None]
    chosen: torch.Tensor | None = None  # [R] logprob of each drawn token
    top_vals: torch.Tensor | None = None  # [R, k]
    top_ids: torch.Tensor | None = None
    _host: list[torch.Tensor] = field(default_factory=list)
    _event: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        self._host, self._event = _queue_copy(
            [t for t in (self.token_ids, self.chosen, self.top_vals, self.top_ids) if t is not None])

    def result(self) -> SamplerOutput:
        if not self._host:
            self.start_copy()
        if self._event is not None:
            self._event.synchronize()
        ids = self._host[0].tolist()
        if self.chosen is None:
            return SamplerOutput(ids, None)
        chosen, top_vals, top_ids = (t.tolist() for t in self._host[1:])
        return SamplerOutput(ids, [None if w is None else _entry(ids[r], chosen[r], top_ids[r], top_vals[r], w)
                                   for r, w in enumerate(self.want_logprobs)])


@dataclass(slots=True)
class SpecSample:
    """A verification's emitted tokens while on the device: ``DeviceSample``'s counterpart for speculative steps
    (``start_copy`` queues the pinned copy and records an event, ``result`` waits for it alone).

    ``result()`` gives, per sequence, its emitted tokens (its accepted drafts and the token after them, 1 to
    k_s + 1 ids) and their logprob entries (None when the request asked for none). The logprob tensors are per
    expanded row: row ``first_row[s] + j`` drew sequence s's j-th token."""

    token_ids: torch.Tensor  # [S, K + 1] int64, padded with -1
    num_tokens: torch.Tensor  # [S] int64: emitted tokens per sequence
    first_row: np.ndarray  # [S] each sequence's first row of the logits (host)
    want_logprobs: list[int | None]  # per row
    chosen: torch.Tensor | None = None  # [N] logprob of the token each row emitted (rows past it: of token 0)
    top_vals: torch.Tensor | None = None  # [N, k]
    top_ids: torch.Tensor | None = None
    _host: list[torch.Tensor] = field(default_factory=list)
    _event: torch.cuda.Event | None = None

    def start_copy(self) -> None:
        self._host, self._event = _queue_copy([t for t in (self.token_ids, self.num_tokens, self.chosen,
                                                           self.top_vals, self.top_ids) if t is not None])

    def result(self) -> list[tuple[list[int], list[dict[int, float]] | None]]:
        if not self._host:
            self.start_copy()
        if self._event is not None:
            self._event.synchronize()
        tokens = [row[:n] for row, n in zip(self._host[0].tolist(), self._host[1].tolist())]
        if self.chosen is None:
            return [(t, None) for t in tokens]
        chosen, top_vals, top_ids = (t.tolist() for t in self._host[2:])
        out: list[tuple[list[int], list[dict[int, float]] | None]] = []
        for t, first in zip(tokens, self.first_row.tolist()):
            w = self.want_logprobs[first]
            out.append((t, None if w is None else [_entry(tok, chosen[r], top_ids[r], top_vals[r], w)
                                                   for r, tok in enumerate(t, first)]))
        return out


class Sampler:
    """Draws the next token of each sampling row, verifies speculative drafts (``verify``) and draws a draft
    model's tokens (``draft``), all through the same logit processing. ``ops`` supplies the argmax passes (one
    fused Triton pass over the logits on the GPU, torch's reference on the CPU); everything else is torch."""

    def __init__(self, device: torch.device, ops: Ops) -> None:
        self.device = device
        self.ops = ops

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, bitmask: torch.Tensor | None = None
                 ) -> DeviceSample:
        """logits: [R, vocab] of the rows that sample this step (float32, or the model dtype).
        ``bitmask``: structured outputs' allowed tokens per row (``grammar.BitmaskFiller``, on the device),
        applied after the raw logprobs (which stay the model's) and before penalties and draws.
        Nothing here waits for the device: per-row parameters go up through pinned memory, the draws
        stay down."""
        facts = meta.rows
        if logits.dtype != torch.float32 and (not logits.is_cuda or facts.any_logprobs or facts.any_penalties
                                              or facts.any_min_tokens or facts.any_filters or facts.bias is not None):
            logits = logits.float()  # else the argmax kernels read the model dtype and convert exactly
        logits, raw_logprobs = self._process(logits, meta, bitmask)
        greedy = facts.greedy
        if all(greedy):
            token_ids = self.ops.greedy_argmax(logits)
        else:
            hashes = self._tensor(row_hash(facts.seeds, meta.output_counts.astype(np.uint64)), torch.int64)
            filtered, inv_temps = self._filter(logits, meta)
            token_ids = self.ops.gumbel_argmax(filtered, hashes, inv_temps)
            if any(greedy):
                token_ids = torch.where(self._tensor(greedy, torch.bool), self.ops.greedy_argmax(logits), token_ids)
        sample = DeviceSample(token_ids, facts.want_logprobs)
        if raw_logprobs is not None:
            sample.chosen, sample.top_vals, sample.top_ids = top_logprobs(raw_logprobs, token_ids, facts.want_logprobs)
        return sample

    @torch.no_grad()
    def verify(self, logits: torch.Tensor, meta: SamplingMetadata, spec_lens: np.ndarray, draft_ids: torch.Tensor,
               draft_probs: torch.Tensor | None = None, bitmask: torch.Tensor | None = None) -> SpecSample:
        """Verify drafted tokens: sequence s with ``spec_lens[s]`` = k drafts owns k + 1 consecutive rows of
        ``logits`` ([N, vocab]) and of ``meta`` (row j: the target after drafts 1..j, its output count j further
        on); ``draft_ids`` ([sum k] int64, on the device) are the drafts in that order, ``draft_probs`` ([sum k,
        vocab] float32) the distributions the draft drew them from (None: n-gram drafts, a point mass each);
        ``bitmask`` one row per logits row.

        Each row is processed exactly as the plain sampler processes it. A greedy row's target token is the plain
        argmax, and a draft is kept while it equals it, so greedy output equals decoding without speculation.
        Random rows follow ``rejection_sampler``: accepted with probability min(1, p/q) (their own noise stream),
        the first rejection redrawn from the residual, a bonus token from the last row (the plain sampler's
        draw at that row)."""
        facts = meta.rows
        logits, raw_logprobs = self._process(logits.float(), meta, bitmask)
        layout = SpecLayout.build(spec_lens)
        hashes = row_hash(facts.seeds, meta.output_counts.astype(np.uint64))
        n, d = len(layout.row_slots), len(layout.draft_rows)
        packed = self._tensor(np.concatenate([  # one upload: the hashes (32-bit values) and the layout's indices
            hashes.astype(np.int64), salted(hashes[layout.draft_rows], ACCEPT_SALT).astype(np.int64),
            layout.draft_rows, layout.draft_slots, layout.first_row, layout.row_slots]), torch.int64)
        hashes, accept_hashes, draft_rows, draft_slots, first_row, row_slots = packed.split(
            [n, d, d, d, len(layout.first_row), n])
        greedy = facts.greedy
        argmax = self.ops.greedy_argmax(logits) if any(greedy) else None
        if argmax is not None:
            greedy_accepted = draft_ids == argmax.index_select(0, draft_rows)
        if all(greedy):
            final_tokens, accepted = argmax, greedy_accepted
        else:
            filtered, inv_temps = self._filter(logits, meta)
            accepted, final, final_inv_temps = judge_drafts(
                filtered, inv_temps, draft_rows, draft_ids, draft_probs, accept_hashes)
            final_tokens = self.ops.gumbel_argmax(final, hashes, final_inv_temps)
            if argmax is not None:
                is_greedy = self._tensor(greedy, torch.bool)
                final_tokens = torch.where(is_greedy, argmax, final_tokens)
                accepted = torch.where(is_greedy.index_select(0, draft_rows), greedy_accepted, accepted)
        tokens, num_tokens = emit(layout, first_row, draft_slots, draft_ids, accepted, final_tokens)
        sample = SpecSample(tokens, num_tokens, layout.first_row, facts.want_logprobs)
        if raw_logprobs is not None:
            emitted = tokens.view(-1).index_select(0, row_slots).clamp_min(0)
            sample.chosen, sample.top_vals, sample.top_ids = top_logprobs(raw_logprobs, emitted, facts.want_logprobs)
        return sample

    @torch.no_grad()
    def draft(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A draft model's draw of one drafted position per row (``logits`` [S, vocab]): (token ids [S] int64,
        the distributions q they were drawn from [S, vocab] float32, or None when every row is greedy).

        Greedy rows take the argmax (their q a point mass on it). Random rows draw from q = the plain sampler's
        temperature and top-k / top-p / min-p over the draft's logits (no penalties, bitmask or bias: the verifier
        corrects any difference from the target, they would only cost acceptance), from the draft noise stream."""
        facts = meta.rows
        greedy = facts.greedy
        if all(greedy):
            return self.ops.greedy_argmax(logits), None
        logits = logits.float()
        filtered, inv_temps = self._filter(logits, meta)
        hashes = salted(row_hash(facts.seeds, meta.output_counts.astype(np.uint64)), DRAFT_SALT)
        token_ids = self.ops.gumbel_argmax(filtered, self._tensor(hashes, torch.int64), inv_temps)
        probs = (filtered * inv_temps[:, None]).softmax(-1)
        if any(greedy):
            is_greedy = self._tensor(greedy, torch.bool)
            token_ids = torch.where(is_greedy, self.ops.greedy_argmax(logits), token_ids)
            probs = probs.masked_fill_(is_greedy[:, None], 0.0).scatter_add_(
                1, token_ids[:, None], is_greedy[:, None].float())
        return token_ids, probs

    def _tensor(self, values: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """A list on the device, through pinned memory on CUDA; filled through numpy, which converts a
        list of Python numbers about twice as fast as ``torch.tensor`` does."""
        host = torch.empty(len(values), dtype=dtype, pin_memory=self.device.type == "cuda")
        host.numpy()[:] = values
        return host.to(self.device, non_blocking=True)

    def _process(self, logits: torch.Tensor, meta: SamplingMetadata, bitmask: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What every draw of the target reads: (logits after the bitmask, allowed_token_ids and logit_bias,
        penalties and min_tokens, the raw log_softmax when a row wants logprobs, else None)."""
        facts = meta.rows
        raw_logprobs = logits.log_softmax(-1) if facts.any_logprobs else None
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask)
        if facts.bias is not None:
            logits = facts.bias.apply(logits)
        if facts.any_penalties:
            logits = self._apply_penalties(logits, meta)
        if facts.any_min_tokens and any(c < p.min_tokens and p.structured_outputs is None
                                        for c, p in zip(meta.output_counts.tolist(), facts.params)):
            logits = self._block_early_stops(logits, meta)
        return logits, raw_logprobs

    def _filter(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, 1 / T) such that softmax(logits / T) is each random row's distribution: top-k, top-p and
        min-p see logits / T, so where a row filters, the scaling is done here and 1 / T becomes 1."""
        facts = meta.rows
        params = facts.params
        inv_temps = facts.inv_temps
        if facts.any_filters:
            logits = logits * inv_temps[:, None]
            inv_temps = torch.ones_like(inv_temps)
            if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
                logits = self._top_k_top_p(logits, params)
            if any(p.min_p > 0 for p in params):
                probs = logits.softmax(-1)
                min_p = self._tensor([p.min_p for p in params], torch.float32)
                cutoff = probs.max(-1, keepdim=True).values * min_p[:, None]
                logits = logits.masked_fill(probs < cutoff, float("-inf"))
        return logits.contiguous(), inv_temps

    def _top_k_top_p(self, logits: torch.Tensor, params: list) -> torch.Tensor:
        """Keep the k most likely tokens and the smallest set whose probability reaches top_p."""
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        # any k past the vocabulary keeps it all (and an arbitrarily large Python int must not reach int64)
        top_k = self._tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], torch.int64)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        drop = rank >= top_k[:, None]
        top_p = self._tensor([p.top_p for p in params], torch.float32)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        drop |= mass_before >= top_p[:, None]
        # The most likely token always stays: a top_p that rounds to 0 in float32 (below ~1.4e-45) would
        # drop it too (0 >= 0), and an all -inf row would draw token 0.
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

    def _apply_penalties(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """repetition_penalty over prompt + output tokens (HF/vLLM); presence and frequency
        penalties over output tokens only (OpenAI)."""
        rows, vocab = logits.shape
        facts, dev = meta.rows, logits.device
        out_counts = torch.zeros(rows, vocab, device=dev)
        seen = torch.zeros(rows, vocab, dtype=torch.bool, device=dev)
        for r, (p, tokens) in enumerate(zip(facts.params, meta.token_ids)):  # one row per sequence, not per token
            if not p.has_penalties:
                continue
            out = torch.tensor(tokens[int(facts.prompt_lens[r]):], dtype=torch.int64, device=dev)
            out_counts[r].index_add_(0, out, torch.ones(len(out), device=dev))
            seen[r, torch.tensor(tokens, dtype=torch.int64, device=dev)] = True
        rep = self._tensor([p.repetition_penalty for p in facts.params], torch.float32)[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        freq = self._tensor([p.frequency_penalty for p in facts.params], torch.float32)[:, None]
        pres = self._tensor([p.presence_penalty for p in facts.params], torch.float32)[:, None]
        return logits - freq * out_counts - pres * (out_counts > 0).float()

    def _block_early_stops(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Before min_tokens, EOS and stop_token_ids cannot be sampled (on unconstrained rows: a grammar
        decides when its output ends)."""
        logits = logits.clone()
        facts = meta.rows
        for r, (p, count) in enumerate(zip(facts.params, meta.output_counts.tolist())):
            if count < p.min_tokens and p.structured_outputs is None:
                ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(facts.eos_token_ids[r]))
                ids = [i for i in ids if i < logits.shape[-1]]
                if ids:
                    logits[r, ids] = float("-inf")
        return logits

    @staticmethod
    def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                        want: list[int | None]) -> list[dict[int, float] | None]:
        """Logprob of ``token_ids`` per row plus each row's top ``want[r]``, on the host now."""
        sample = DeviceSample(token_ids, want)
        sample.chosen, sample.top_vals, sample.top_ids = top_logprobs(logprobs, token_ids, want)
        return sample.result().logprobs


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token the bitmask (device, int32 [R, W]) disallows set to -inf."""
    rows, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(rows, -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))
