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

from minfer.engine.input_batch import SamplingMetadata
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


class Sampler:
    """Draws the next token of each sampling row. ``ops`` supplies the argmax passes (one fused Triton
    pass over the logits on the GPU, torch's reference on the CPU); everything else is torch."""

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
                                              or facts.any_min_tokens or facts.any_filters):
            logits = logits.float()  # else the argmax kernels read the model dtype and convert exactly
        want_logprobs = facts.want_logprobs
        raw_logprobs = logits.log_softmax(-1) if facts.any_logprobs else None
        if bitmask is not None:
            logits = apply_token_bitmask(logits, bitmask)
        if facts.any_penalties:
            logits = self._apply_penalties(logits, meta)
        if facts.any_min_tokens and any(c < p.min_tokens and p.structured_outputs is None
                                        for c, p in zip(meta.output_counts.tolist(), facts.params)):
            logits = self._block_early_stops(logits, meta)
        greedy = facts.greedy
        if all(greedy):
            token_ids = self.ops.greedy_argmax(logits)
        elif not any(greedy):
            token_ids = self._sample(logits, meta)
        else:
            token_ids = torch.where(self._tensor(greedy, torch.bool), self.ops.greedy_argmax(logits),
                                    self._sample(logits, meta))
        sample = DeviceSample(token_ids, want_logprobs)
        if raw_logprobs is not None:
            k = max(w or 0 for w in want_logprobs)
            sample.chosen = raw_logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
            sample.top_vals, sample.top_ids = raw_logprobs.topk(k, dim=-1) if k else (
                raw_logprobs[:, :0], raw_logprobs[:, :0].long())
        return sample

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A list on the device, through pinned memory on CUDA; filled through numpy, which converts a
        list of Python numbers about twice as fast as ``torch.tensor`` does."""
        host = torch.empty(len(values), dtype=dtype, pin_memory=self.device.type == "cuda")
        host.numpy()[:] = values
        return host.to(self.device, non_blocking=True)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        facts = meta.rows
        params = facts.params
        inv_temps = facts.inv_temps
        hashes = self._tensor(row_hash(facts.seeds, meta.output_counts.astype(np.uint64)), torch.int64)
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
        return self.ops.gumbel_argmax(logits.contiguous(), hashes, inv_temps)

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
        sample = DeviceSample(token_ids, want, logprobs.gather(-1, token_ids[:, None]).squeeze(-1))
        k = max(w or 0 for w in want)
        sample.top_vals, sample.top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
        return sample.result().logprobs


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token the bitmask (device, int32 [R, W]) disallows set to -inf."""
    rows, vocab = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(rows, -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))
