"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out.

The offline ``LLM`` and the HTTP server both drive it through ``add_request`` / ``step`` /
``abort_request``. Each request of ``n`` samples becomes ``n`` sequences.

A step is *launched* (scheduled, inputs built, kernels queued; the sequences advance and each
sampling sequence gets a ``PENDING_TOKEN``) and later *completed* (the sampled ids come back, are
filled in, stops are applied, outputs built). With async scheduling a ``step()`` call launches
step N+1 before it completes step N, so the host's scheduling and input building for N+1 overlap
the GPU's work on N, and the GPU never waits for the host. The price: a sequence that stops on
EOS or a stop string at step N has already been given one more (discarded) token of work in
N+1. Requests with penalties need every past token on the host, so while one runs, each step
completes its predecessor before it schedules (no overlap).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

from transformers import AutoTokenizer

from minfer.config import EngineConfig, ModelConfig
from minfer.engine.block_manager import BlockManager
from minfer.engine.detokenizer import IncrementalDetokenizer
from minfer.engine.model_runner import LaunchedStep, ModelRunner
from minfer.engine.scheduler import Scheduler, SchedulerOutput
from minfer.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from minfer.model.loader import resolve_model_path
from minfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minfer.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]


class PromptError(ValueError):
    """A request the engine can never serve; ``field`` names what to change: 'prompt' or 'max_tokens'."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    unforked: list[Sequence] = field(default_factory=list)  # samples 1..n-1 until sample 0's prompt is in
    reported: bool = False  # a delta output went out (it carried the prompt logprobs)
    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig, stream_text: bool = True, delta_outputs: bool = False) -> None:
        """``stream_text``: ``step`` returns partial outputs, with text detokenized every step (for
        streaming); when False it returns finished requests only, their text decoded once at the
        end (unless stop strings need it earlier).

        ``delta_outputs`` (with ``stream_text``): the partial outputs carry only what is new. A
        whole snapshot copies every output token and logprob so far, so a stream of n tokens would
        cost O(n^2); instead each completion's ``token_ids`` and ``logprobs`` hold the tokens since
        the sequence's previous output, from ``token_offset`` on, and ``prompt_logprobs`` comes only
        with the request's first output. ``text`` stays whole (sharing a str costs nothing, and stop
        strings may cut text already produced). A finished request's output is whole as always, so
        a consumer that keeps only the last output still gets everything. ``AsyncLLMEngine`` turns
        this on and joins the deltas that a reader has not read yet.
        """
        if config.model is None:
            raise ValueError("model is required (a local folder or a Hugging Face hub id)")
        self.config = config
        self.stream_text = stream_text
        self.delta_outputs = delta_outputs
        self.model_dir = resolve_model_path(config.model, config.revision, config.download_dir)
        self.model_config = ModelConfig.from_pretrained(self.model_dir)
        self.max_model_len = self._resolve_max_model_len()
        self.tokenizer = None if config.skip_tokenizer_init else AutoTokenizer.from_pretrained(
            str(resolve_model_path(config.tokenizer)) if config.tokenizer else str(self.model_dir))
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids or ([tok_eos] if tok_eos is not None else []))
        self.runner = ModelRunner(self.model_config, config, self.model_dir, self.max_model_len)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(config.seed)
        self._next_seq_id = 0
        self.async_scheduling = config.async_scheduling
        self._inflight: LaunchedStep | None = None  # launched, not yet completed
        self._penalized: set[str] = set()  # live requests with penalties (skips a per-step scan when empty)

    def _resolve_max_model_len(self) -> int:
        mc, limit = self.model_config, self.model_config.max_position_embeddings
        length = self.config.max_model_len or limit
        if length > limit:
            raise ValueError(f"max_model_len ({length}) exceeds the model's max_position_embeddings ({limit})")
        if mc.sliding_window is not None and mc.sliding_window < length:
            raise ValueError(f"this model uses sliding-window attention (window {mc.sliding_window}), which minfer "
                             f"does not implement; set max_model_len <= {mc.sliding_window} (now {length})")
        return length

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("skip_tokenizer_init=True: pass prompts as {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.tokenize(prompt["prompt"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and queue a request; errors here leave the engine untouched."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self.tokenize(prompt)
        max_total = self.check_prompt(ids, params.max_tokens)
        vocab = self.model_config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:  # top-k over the vocabulary
                raise ValueError(f"{name} must be at most the vocabulary size ({vocab}), got {k}")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, but skip_tokenizer_init=True")
        seqs = []
        for i in range(params.n):
            if params.seed is None:
                seed = self._rng.getrandbits(63)
            else:
                seed = params.seed if i == 0 else hash((params.seed, i)) & (2**63 - 1)
            seq = Sequence(self._next_seq_id, request_id, i, ids, params, seed, self.eos_token_ids, max_total)
            if self.tokenizer is not None and (params.stop_strings or self.stream_text):
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            self._next_seq_id += 1
            seqs.append(seq)
        # Samples 1..n-1 fork from sample 0 once it has computed the prompt (see _fork_samples).
        self.requests[request_id] = Request(request_id, text, ids, params, seqs,
                                            RequestMetrics(arrival_time or time.time()), seqs[1:])
        if params.has_penalties:
            self._penalized.add(request_id)
        self.scheduler.add(seqs[0])

    def check_prompt(self, ids: list[int], max_tokens: int | None) -> int:
        """Reject requests the engine can never serve (``PromptError``); return the request's longest
        total length. It reads only fixed facts (model, cache size), so the server's event loop calls
        it too, to answer 400 before queueing."""
        if not ids:
            raise PromptError("the prompt is empty: it must contain at least one token", "prompt")
        vocab = self.model_config.vocab_size
        if not all(type(t) is int for t in ids):  # the fast check; numpy integers pass the slow one
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, Integral)]
            if bad:  # a float 1.5 would silently become token 1
                raise PromptError(f"prompt token ids must be integers, got {bad[0]!r} ({type(bad[0]).__name__})",
                                  "prompt")
        if min(ids) < 0 or max(ids) >= vocab:
            raise PromptError(f"prompt token ids must be in [0, {vocab}), got min {min(ids)}, max {max(ids)}", "prompt")
        if len(ids) >= self.max_model_len:
            raise PromptError(f"the prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}: "
                              f"it must be shorter to leave room for at least one output token", "prompt")
        total = self.max_model_len if max_tokens is None else min(len(ids) + max_tokens, self.max_model_len)
        need = self.block_manager.blocks_needed(total)
        if need > self.block_manager.num_blocks:
            raise PromptError(f"this request needs up to {need} KV blocks ({total} tokens) but the whole cache has "
                              f"{self.block_manager.num_blocks}; lower max_tokens or give the cache more memory",
                              "max_tokens")
        return total

    def abort_request(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown or finished ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self._penalized.discard(request_id)
        for seq in req.seqs:
            if seq in req.unforked:  # never reached the scheduler
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
            elif not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def abort_all(self) -> list[str]:
        """Abort every request and drop the step in flight; returns the aborted ids.

        Why: after ``step`` raised, which request's state it left half-updated is unknown, but an engine
        with nothing running is consistent again: the blocks are free (prefix-cached ones keep contents
        written by steps that completed), and the next requests run as on a fresh engine. Raises if a
        sequence or block is still held afterwards: then recovery is not safe."""
        self._inflight = None
        self.block_manager.pending_copies = []
        ids = list(self.requests)
        for request_id in ids:
            self.abort_request(request_id)
        sched, bm = self.scheduler, self.block_manager
        if sched.running or sched.waiting or bm.num_free_blocks != bm.num_blocks:
            raise RuntimeError(f"aborting every request left {len(sched.running)} running, {len(sched.waiting)} "
                               f"waiting and {bm.num_blocks - bm.num_free_blocks} KV blocks held")
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch the next step and complete the previous one (async scheduling), or launch and
        complete one step; return outputs of requests that got a token (or, without
        ``stream_text``, only of those that finished)."""
        outputs: list[RequestOutput] = []
        if self._inflight is not None and self._penalized and any(
                s.params.has_penalties for s in self.scheduler.running):
            outputs += self._complete(self._inflight)  # penalties read every token: no overlap
            self._inflight = None
        batch = self.scheduler.schedule()
        launched = self._launch(batch) if batch.seqs else None
        if self._inflight is not None:
            outputs += self._complete(self._inflight)
        self._inflight = launched
        if launched is not None and not self.async_scheduling:
            outputs += self._complete(launched)
            self._inflight = None
        return outputs

    def _launch(self, batch: SchedulerOutput) -> LaunchedStep:
        """Queue the step on the device, then advance its sequences as if it had run: computed
        tokens move forward, and each sampling sequence gets a pending token."""
        if self.block_manager.pending_copies:  # copy-on-write of blocks shared by forked samples
            self.runner.copy_blocks(self.block_manager.pending_copies)
            self.block_manager.pending_copies = []
        prev = self._inflight.sample if self._inflight is not None else None
        launched = self.runner.launch(batch, prev.token_ids if prev is not None else None)
        prompt_lp, cache_full_blocks = launched.prompt_logprobs, self.block_manager.cache_full_blocks
        for seq in batch.seqs:  # plain attributes, no properties: this loop runs for every sequence
            if prompt_lp:
                seq.prompt_logprobs += prompt_lp.get(seq.seq_id, ())
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
            seq.num_computed_tokens, seq.num_scheduled_tokens = end, 0
            cache_full_blocks(seq)
            if start < len(seq.prompt_token_ids) <= end and seq.index == 0 and self.requests[seq.request_id].unforked:
                self._fork_samples(seq)  # its prompt is done
        for row, seq in enumerate(launched.sampled):
            seq.token_ids.append(PENDING_TOKEN)
            seq.num_pending += 1
            seq.sample_row = row
        return launched

    def _fork_samples(self, seq: Sequence) -> None:
        """Once sample 0 of an n-sample request has its prompt in the cache, samples 1..n-1 share its
        blocks and recompute only the last prompt token (for their own first draw)."""
        req = self.requests[seq.request_id]
        for child in req.unforked:
            self.block_manager.fork(seq, child)
            child.num_computed_tokens = seq.num_prompt_tokens - 1
            self.scheduler.add(child, front=True)
        req.unforked = []

    def _complete(self, step: LaunchedStep) -> list[RequestOutput]:
        """Wait for the step's draws, fill in the pending tokens, apply stops, build outputs.
        Sequences that finished meanwhile (aborted, or stopped by the step before) are skipped."""
        out = step.sample.result() if step.sample is not None else None
        touched: dict[str, Request] = {}
        stopped: set[str] = set()  # requests that may have finished: one of their sequences just did
        requests, cache_full_blocks, FINISHED = self.requests, self.block_manager.cache_full_blocks, \
            SequenceStatus.FINISHED
        for i, seq in enumerate(step.sampled):
            if seq.status is FINISHED:
                continue
            self._accept_token(seq, out.token_ids[i], out.logprobs[i] if out.logprobs is not None else None)
            if seq.status is not FINISHED:
                cache_full_blocks(seq)  # a block its token completed
            else:
                stopped.add(seq.request_id)
                if not isinstance(seq.stop_reason, str) and self.tokenizer is not None:
                    seq.text = self.tokenizer.decode(seq.output_token_ids,
                                                     skip_special_tokens=seq.params.skip_special_tokens)
            touched[seq.request_id] = requests[seq.request_id]
        now_done = time.time()
        outputs = []
        for req in touched.values():
            metrics = req.metrics
            if not metrics.first_scheduled_time:
                metrics.first_scheduled_time = step.batch.scheduled_at
            if not metrics.first_token_time:
                metrics.first_token_time = now_done
            finished = req.request_id in stopped and req.finished
            if finished:
                req.metrics.finished_time = now_done
                del self.requests[req.request_id]
                self._penalized.discard(req.request_id)
            if finished or self.stream_text:
                outputs.append(self._make_output(req, finished))
        return outputs

    def _accept_token(self, seq: Sequence, token: int, logprobs: dict[int, float] | None) -> None:
        """Replace the sequence's first pending token by its value; stop it if that token ends it."""
        at = len(seq.token_ids) - seq.num_pending
        seq.token_ids[at] = token
        seq.num_pending -= 1
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token]
        p = seq.params
        may_stop = at + 1 - len(seq.prompt_token_ids) >= p.min_tokens
        if may_stop and token in p.stop_token_ids:
            return self.scheduler.finish(seq, "stop", token)
        if may_stop and not p.ignore_eos and token in seq.eos_token_ids:
            return self.scheduler.finish(seq, "stop")
        if seq.detokenizer is not None:
            delta = seq.detokenizer.step(token)
            if delta and may_stop and p.stop_strings and self._check_stop_strings(seq, len(delta)):
                return
        if at + 1 >= seq.max_total_tokens:
            self.scheduler.finish(seq, "length")

    def _check_stop_strings(self, seq: Sequence, delta_len: int) -> bool:
        """Find a stop string that the new text completed (it may span tokens); cut the text there."""
        text = seq.detokenizer.text
        for stop in seq.params.stop_strings:
            at = text.find(stop, max(0, len(text) - delta_len - len(stop) + 1))
            if at >= 0:
                end = at + len(stop) if seq.params.include_stop_str_in_output else at
                seq.text = text[:end]
                self.scheduler.finish(seq, "stop", stop)
                return True
        return False

    def _make_output(self, req: Request, finished: bool) -> RequestOutput:
        """The request's output: whole, or (``delta_outputs``, unfinished request) what is new since
        each sequence's previous output. It runs for every request of every streaming step, so it
        reads plain attributes, not properties."""
        delta = self.delta_outputs and not finished
        completions = []
        for seq in req.seqs:
            num_prompt, known = len(seq.prompt_token_ids), len(seq.token_ids) - seq.num_pending
            start = seq.num_reported_tokens if delta else 0
            seq.num_reported_tokens = num_out = known - num_prompt
            if seq.status is SequenceStatus.FINISHED:
                text = seq.text
            else:
                text = seq.detokenizer.text if seq.detokenizer is not None else ""
            wants_lp = seq.params.logprobs is not None
            completions.append(CompletionOutput(
                seq.index, text, seq.token_ids[num_prompt + start:known],
                seq.cumulative_logprob if wants_lp else None, seq.output_logprobs[start:num_out] if wants_lp else None,
                seq.finish_reason, seq.stop_reason, start))
        prompt_lp = None
        if req.params.prompt_logprobs is not None and not (delta and req.reported):
            prompt_lp = list(req.seqs[0].prompt_logprobs)
        req.reported = req.reported or delta
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions, finished, req.metrics,
                             prompt_lp)

    # ---- introspection --------------------------------------------------------------------
    def get_stats(self) -> dict[str, int | str]:
        """Cache and scheduler counters. ``kv_cache_dtype`` is the stored format ('int8', 'fp8_e4m3',
        'fp8_e5m2', or the model dtype for 'auto'); ``kv_block_bytes`` one block's K and V across all
        layers, scales included."""
        bm, sched = self.block_manager, self.scheduler
        return {
            "kv_cache_dtype": self.runner.kv_spec.format_name,
            "kv_block_bytes": self.runner.block_bytes,
            "num_kv_blocks": bm.num_blocks,
            "num_free_kv_blocks": bm.num_free_blocks,
            "num_cached_kv_blocks": len(bm.cached),
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
            "num_preemptions": sched.num_preemptions,
            "prefix_cache_hit_tokens": bm.hit_tokens,
            "prefix_cache_queried_tokens": bm.queried_tokens,
        }

