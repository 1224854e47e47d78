"""Sampler: turns the logits of the sampling rows into next tokens, on the device, batched.

Randomness comes from a counter-based hash of (the sample's seed, its output index, the token
id) rather than from a shared generator, so a seeded request draws the same numbers whatever else
is in the batch, after a preemption too, and no per-request generator objects are needed. With
uniform noise u, ``argmax(logits/T - log(-log u))`` is an exact draw from softmax(logits/T)
(the Gumbel-max trick).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from minfer.engine.sequence import Sequence

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche finaliser on int64 tensors (or uint64 arrays) holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def row_hash(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Per-row 32-bit hash of (seed, output index): the row part of the noise. Takes int64 tensors or
    uint64 numpy arrays alike; the sampler hashes on the host, where 256 rows cost a few microseconds
    against a dozen tiny kernels on the device."""
    return _mix32((_mix32(seeds & _M32) ^ (seeds >> 32)) ^ ((counters * 0x9E3779B1) & _M32))


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u[r, v] in (0, 1), a pure function of (seeds[r], counters[r], v)."""
    return noise_from_row_hash(row_hash(seeds, counters), vocab_size)


def noise_from_row_hash(row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """:func:`uniform_noise` from the rows' hashes (int64 ``[R]``)."""
    col = _mix32((torch.arange(vocab_size, device=row.device) * 0x27D4EB2F + 0x165667B1) & _M32)
    bits = _mix32(row[:, None] ^ col[None, :]) >> 8  # 24 random bits
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None  # per row: chosen token and the top-k, or None


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
        tensors = [t for t in (self.token_ids, self.chosen, self.top_vals, self.top_ids) if t is not None]
        if not self.token_ids.is_cuda:
            self._host = tensors
            return
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, dev in zip(self._host, tensors):
            host.copy_(dev, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def result(self) -> SamplerOutput:
        if not self._host:
            self.start_copy()
        if self._event is not None:
            self._event.synchronize()
        ids = self._host[0].tolist()
        if self.chosen is None:
            return SamplerOutput(ids, None)
        chosen, top_vals, top_ids = (t.tolist() for t in self._host[1:])
        logprobs: list[dict[int, float] | None] = []
        for r, w in enumerate(self.want_logprobs):
            if w is None:
                logprobs.append(None)
                continue
            entry = {ids[r]: chosen[r]}
            entry.update((i, v) for i, v in zip(top_ids[r][:w], top_vals[r][:w]) if i not in entry)
            logprobs.append(entry)
        return SamplerOutput(ids, logprobs)


@dataclass(slots=True)
class _BatchFacts:
    """What a batch's rows sample with, fixed while the same sequences sample in the same order (the
    steady state of decoding): built once, reused step after step. ``seqs`` keeps the sequences
    alive, so no other object can take one of the ids in ``key``."""

    key: tuple[int, ...]  # id() of each row's sequence
    seqs: list[Sequence]
    want_logprobs: list[int | None]
    any_logprobs: bool
    any_penalties: bool
    any_min_tokens: bool
    any_filters: bool  # top-k, top-p or min-p
    greedy: list[bool]
    inv_temps: torch.Tensor  # [R] float32 1 / temperature on the device (1.0 on greedy rows)
    seeds: np.ndarray  # [R] uint64 on the host


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._facts: _BatchFacts | None = None

    def _batch_facts(self, seqs: list[Sequence]) -> _BatchFacts:
        """The cached facts of this batch, or new ones: scanning every row's parameters each step cost
        about as much as the rest of the sampler's host work at 256 rows."""
        key = tuple(map(id, seqs))
        facts = self._facts
        if facts is not None and facts.key == key:
            return facts
        params = [s.params for s in seqs]
        want_logprobs = [p.logprobs for p in params]
        greedy = [p.greedy for p in params]
        inv_temps = self._tensor([1.0 if g else 1.0 / p.temperature for g, p in zip(greedy, params)], torch.float32)
        facts = self._facts = _BatchFacts(
            key, list(seqs), want_logprobs, any(k is not None for k in want_logprobs),
            any(p.has_penalties for p in params), any(p.min_tokens > 0 for p in params),
            any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params), greedy, inv_temps,
            np.array([s.sample_seed for s in seqs], dtype=np.uint64))
        return facts

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> DeviceSample:
        """logits: [len(seqs), vocab] of the rows that sample this step (float32, or the model dtype).
        Nothing here waits for the device: per-row parameters go up through pinned memory, the draws
        stay down."""
        facts = self._batch_facts(seqs)
        if logits.dtype != torch.float32 and (not logits.is_cuda or facts.any_logprobs or facts.any_penalties
                                              or facts.any_min_tokens or facts.any_filters):
            logits = logits.float()  # else the argmax kernels read the model dtype and convert exactly
        want_logprobs = facts.want_logprobs
        raw_logprobs = logits.log_softmax(-1) if facts.any_logprobs else None
        if facts.any_penalties:
            logits = self._apply_penalties(logits, seqs)
        if facts.any_min_tokens and any(s.num_output_tokens < s.params.min_tokens for s in seqs):
            logits = self._block_early_stops(logits, seqs)
        greedy = facts.greedy
        if all(greedy):
            token_ids = self._greedy(logits)
        elif not any(greedy):
            token_ids = self._sample(logits, seqs, facts)
        else:
            token_ids = torch.where(self._tensor(greedy, torch.bool), self._greedy(logits),
                                    self._sample(logits, seqs, facts))
        sample = DeviceSample(token_ids, want_logprobs)
        if raw_logprobs is not None:
            k = max(w or 0 for w in want_logprobs)
            sample.chosen = raw_logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
            sample.top_vals, sample.top_ids = raw_logprobs.topk(k, dim=-1) if k else (
                raw_logprobs[:, :0], raw_logprobs[:, :0].long())
        return sample

    @staticmethod
    def _greedy(logits: torch.Tensor) -> torch.Tensor:
        """Argmax per row; on CUDA one chunked kernel (torch's argmax runs a 128k-vocabulary row on one
        block: 28 us of a batch-1 decode step on an H200)."""
        if logits.is_cuda:
            from minfer.kernels.sampling import greedy_argmax

            return greedy_argmax(logits)
        return logits.argmax(-1)

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A list on the device, through pinned memory on CUDA; filled through numpy, which converts a
        list of Python numbers about twice as fast as ``torch.tensor`` does."""
        host = torch.empty(len(values), dtype=dtype, pin_memory=self.device.type == "cuda")
        host.numpy()[:] = values
        return host.to(self.device, non_blocking=True)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], facts: _BatchFacts) -> torch.Tensor:
        params = [s.params for s in seqs] if facts.any_filters else []
        inv_temps = facts.inv_temps
        counters = np.array([len(s.token_ids) - len(s.prompt_token_ids) for s in seqs], dtype=np.uint64)
        hashes = self._tensor(row_hash(facts.seeds, counters), torch.int64)
        if facts.any_filters:  # filters see logits / T
            logits = logits * inv_temps[:, None]
            inv_temps = torch.ones_like(inv_temps)
            if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
                logits = self._top_k_top_p(logits, params)
            if any(p.min_p > 0 for p in params):
                probs = logits.softmax(-1)
                min_p = self._tensor([p.min_p for p in params], torch.float32)
                cutoff = probs.max(-1, keepdim=True).values * min_p[:, None]
                logits = logits.masked_fill(probs < cutoff, float("-inf"))
        if logits.is_cuda:  # one fused pass over the logits (the same draws up to rounding)
            from minfer.kernels.sampling import gumbel_argmax

            return gumbel_argmax(logits.contiguous(), hashes, inv_temps)
        gumbel = -torch.log(-torch.log(noise_from_row_hash(hashes, logits.shape[-1])))
        return (logits * inv_temps[:, None] + gumbel).argmax(-1)

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
        mass_before = probs.cumsum(-1) - probs  # the most likely token always stays
        drop |= mass_before >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """repetition_penalty over prompt + output tokens (HF/vLLM); presence and frequency
        penalties over output tokens only (OpenAI)."""
        rows, vocab = logits.shape
        out_counts = torch.zeros(rows, vocab, device=logits.device)
        seen = torch.zeros(rows, vocab, dtype=torch.bool, device=logits.device)
        for r, s in enumerate(seqs):  # one row per penalised sequence, not per token
            if not s.params.has_penalties:
                continue
            out = torch.tensor(s.output_token_ids, dtype=torch.int64, device=logits.device)
            out_counts[r].index_add_(0, out, torch.ones(len(out), device=logits.device))
            seen[r, torch.tensor(s.token_ids, dtype=torch.int64, device=logits.device)] = True
        params = [s.params for s in seqs]
        rep = self._tensor([p.repetition_penalty for p in params], torch.float32)[:, None]
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        freq = self._tensor([p.frequency_penalty for p in params], torch.float32)[:, None]
        pres = self._tensor([p.presence_penalty for p in params], torch.float32)[:, None]
        return logits - freq * out_counts - pres * (out_counts > 0).float()

    def _block_early_stops(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Before min_tokens, EOS and stop_token_ids cannot be sampled."""
        logits = logits.clone()
        for r, s in enumerate(seqs):
            if s.num_output_tokens < s.params.min_tokens:
                ids = set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else set(s.eos_token_ids))
                ids = [i for i in ids if i < logits.shape[-1]]
                if ids:
                    logits[r, ids] = float("-inf")
        return logits

    @staticmethod
    def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                        want: list[int | None]) -> list[dict[int, float] | None]:
        """Logprob of ``token_ids`` per row plus each row's top ``want[r]``, on the host now."""
        sample = DeviceSample(token_ids, want, logprobs.gather(-1, token_ids[:, None]).squeeze(-1))
        k = max(w or 0 for w in want)
        sample.top_vals, sample.top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        return sample.result().logprobs
