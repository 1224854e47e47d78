"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out.

The offline ``LLM`` and the HTTP server both drive it through ``add_request`` / ``step`` /
``abort_request``. Around the engine loop sit its three helpers: the ``Processor`` turns a prompt
into a checked ``EngineRequest``, the ``Scheduler`` picks each step's work, and the
``OutputProcessor`` turns sampled tokens into stops and outputs.

A step is *launched* (scheduled, inputs built, kernels queued; the sequences advance and each
sampling sequence gets a pending token) and later *completed* (the sampled ids come back and are
filled in, stops are applied, outputs built). With async scheduling a ``step()`` call launches
step N+1 before it completes step N, so the host's scheduling and input building for N+1 overlap
the GPU's work on N, and the GPU never waits for the host. The price: a sequence that stops on
EOS or a stop string at step N has already been given one more (discarded) token of work in
N+1. Requests with penalties need every past token on the host, so while one runs, each step
completes its predecessor before it schedules (no overlap).

With ``tensor_parallel_size`` > 1 this process is rank 0: ``tp_workers`` starts the other ranks
and the runner sends them each step. Any error in a step then stops the engine
(``TensorParallelError``, naming a failed rank when one died): after a partial step the ranks would
disagree about what runs next.
"""
from __future__ import annotations

import logging
import random
import time
from typing import Any
from concurrent.futures import FIRST_COMPLETED, Future, wait

from minfer.config import EngineConfig
from minfer.engine.block_manager import BlockManager
from minfer.engine.engine_stats import engine_stats
from minfer.engine.grammar import BitmaskFiller, GrammarCompiler, advance_grammar, new_matcher
from minfer.engine.kv_events import start_kv_events
from minfer.engine.model_runner import LaunchedStep, ModelRunner
from minfer.engine.step_arrays import StepArrays
from minfer.engine.output_processor import OutputProcessor
from minfer.engine.pooling import Pooler, add_pooling_request
from minfer.engine.processor import EngineRequest, Processor, PromptType
from minfer.engine.scheduler import Scheduler, SchedulerOutput
from minfer.engine.sequence import Sequence, SequenceStatus
from minfer.engine.lora_manager import EngineLoRA
from minfer.engine.spec.draft_probs import DraftProbs
from minfer.engine.spec.complete import complete_speculative
from minfer.engine.spec.factory import make_draft, make_speculator
from minfer.engine.tp_workers import start_tensor_parallel
from minfer.engine.vllm_api import VLLMEngineAPI
from minfer.model.loader import resolve_model_path
from minfer.model.registry import load_model_config
from minfer.outputs import RequestOutput, RequestOutputKind
from minfer.sampling_params import SamplingParams

logger = logging.getLogger("minfer")


class LLMEngine(EngineLoRA, VLLMEngineAPI):
    def __init__(self, config: EngineConfig, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        """``output_kind`` says what ``step`` returns (see ``OutputProcessor``): finished requests only
        (``LLM``), whole outputs every step, or only what is new (the server)."""
        if config.model is None:
            raise ValueError("model is required (a local folder or a Hugging Face hub id)")
        self.config = config
        self.model_dir = resolve_model_path(config.model, config.revision, config.download_dir, config.load_format)
        self.model_config = load_model_config(self.model_dir)
        self.pooler = Pooler(self.model_dir, self.model_config) if config.runner == "pooling" else None  # embeddings
        self.max_model_len = self._resolve_max_model_len()
        self.tokenizer = None if config.skip_tokenizer_init else _load_tokenizer(
            str(resolve_model_path(config.tokenizer)) if config.tokenizer else str(self.model_dir))
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids or ([tok_eos] if tok_eos is not None else []))
        parallel = start_tensor_parallel(config, self.model_config, self.model_dir, self.max_model_len)
        self.workers = parallel.workers
        try:
            draft = make_draft(config, self.model_config, self.max_model_len,
                               parallel.device or config.resolved_device(), parallel.tp)
            self.runner = ModelRunner(self.model_config, config, self.model_dir, self.max_model_len,
                                      parallel.tp, parallel.channel, parallel.device, draft)
        except Exception as exc:
            if self.workers is None:
                raise
            error = self.workers.explain(exc)
            self.workers.shutdown()
            raise error from exc
        defaults = self.model_config.sampling_defaults if config.generation_config == "auto" else {}
        windows = self.runner.kv_spec.windows
        self.processor = Processor(self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                                   self.runner.num_kv_blocks, config.block_size, defaults,
                                   config.structured_outputs_limits(), windows, config.max_num_batched_tokens)
        self.output_processor = OutputProcessor(self.tokenizer, output_kind)
        recurrent = bool(self.runner.state_layers)  # no prefix hits, no forks: engine/state_cache.py
        if recurrent and config.enable_prefix_caching:
            logger.info("prefix caching off: the model's recurrent layers keep no state at block boundaries")
        caching = config.enable_prefix_caching and not recurrent and (self.pooler is None or self.pooler.prefix_caching)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size, caching, windows)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   fork_samples=not recurrent, max_loras=config.max_loras if config.enable_lora else 0,
                                   policy=config.scheduling_policy)
        try:
            self.speculator = make_speculator(config, self.runner, draft)
            self.kv_events = start_kv_events(config, self.block_manager)  # prefix-cache block events, or None
        except Exception:  # a configuration refused here, on rank 0: the workers must not outlive it
            if self.workers is not None:
                self.workers.shutdown()
            raise
        self.requests: dict[str, list[Sequence]] = {}  # live requests' samples
        self._rng = random.Random(config.seed)
        self._next_seq_id = 0
        self._inflight: LaunchedStep | None = None  # launched, not yet completed
        self._penalized: set[str] = set()  # live requests with penalties (skips a per-step scan when empty)
        self._grammars: GrammarCompiler | None = None  # structured outputs: built on the first such request
        self._bitmask: BitmaskFiller | None = None
        self._compiling: dict[str, tuple[Future, list[Sequence]]] = {}  # waiting for their grammar
        # Why the requests that this step's outputs end with "abort" failed (a grammar that did not compile):
        # for a caller that reports errors (the server); refilled every step.
        self.step_errors: dict[str, Exception] = {}
        self._constrained: set[str] = set()  # live requests with structured outputs
        self._ready: tuple[SchedulerOutput, StepArrays | None] | None = None  # the next step, prepared early

    @property
    def output_kind(self) -> RequestOutputKind:
        return self.output_processor.output_kind

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        length = self.config.max_model_len or limit
        if length > limit:
            raise ValueError(f"max_model_len ({length}) exceeds the model's max_position_embeddings ({limit})")
        return length

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: Any = None) -> None:
        """Validate and queue a request (``lora_request``: a ``minfer.lora.LoRARequest`` it runs through); errors
        here leave the engine untouched."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.add_processed_request(self.processor.process(request_id, prompt, params, arrival_time, lora_request))

    def add_processed_request(self, request: EngineRequest) -> None:
        """Queue a request that a ``Processor`` (this engine's, or a copy of it elsewhere) has checked."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        params, lora = request.params, request.lora_request
        if self.pooler is not None or not isinstance(params, SamplingParams):
            return add_pooling_request(self, request)  # an embedding (or a refusal): engine/pooling.py
        if lora is not None:
            self.add_lora(lora)  # LoRA on and the adapter loads, before anything is queued
        seqs = []
        for i in range(params.n):
            if params.seed is None:
                seed = self._rng.getrandbits(63)
            else:
                seed = params.seed if i == 0 else hash((params.seed, i)) & (2**63 - 1)
            seqs.append(Sequence(self._next_seq_id, request.request_id, i, request.prompt_token_ids, params, seed,
                                 self.eos_token_ids, request.max_total_tokens,
                                 grammar_after=request.grammar_after if params.structured_outputs is not None else None,
                                 lora_request=lora, lora_id=lora.lora_int_id if lora is not None else 0))
            self._next_seq_id += 1
        self.requests[request.request_id] = seqs
        self.output_processor.add_request(request, seqs)
        if params.has_penalties:
            self._penalized.add(request.request_id)
            self._ready = None  # penalties complete each step before the next launch: nothing prepared early
        if params.structured_outputs is None:
            self.scheduler.add_request(seqs)
            return
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs need a tokenizer, but skip_tokenizer_init=True")
            self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                             self.config.structured_outputs_compile_timeout)
            spec = self.speculator.num_speculative_tokens if self.speculator is not None else 0
            self._bitmask = BitmaskFiller(self.model_config.vocab_size, self.config.max_num_seqs * (1 + spec),
                                          self.runner.device)
        self._constrained.add(request.request_id)
        self._compiling[request.request_id] = (self._grammars.submit(params.structured_outputs), seqs)

    def _abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks; unknown or finished ids are ignored (``abort_request``)."""
        seqs = self._forget(request_id)
        if seqs is None:
            return
        self._ready = None  # it may hold this request's sequences: the next step schedules afresh
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:
            self.scheduler.finish_unqueued(seqs)
            future = compiling[0]
            if all(f is not future for f, _ in self._compiling.values()):  # nobody else waits for it
                self._grammars.cancel(future)
        else:
            self.scheduler.abort_request(seqs)
        self.output_processor.abort_request(request_id)

    def _forget(self, request_id: str) -> list[Sequence] | None:
        """Drop a finished or aborted request from the engine's live sets; returns its samples (None when
        it was not live)."""
        self._penalized.discard(request_id)
        self._constrained.discard(request_id)
        return self.requests.pop(request_id, None)

    def abort_all(self) -> list[str]:
        """Abort every request and drop the step in flight; returns the aborted ids.

        Why: after ``step`` raised, which request's state it left half-updated is unknown, but an engine
        with nothing running is consistent again: the blocks are free (prefix-cached ones keep contents
        written by steps that completed), and the next requests run as on a fresh engine. Raises if a
        sequence or block is still held afterwards: then recovery is not safe."""
        self._inflight = self._ready = None
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
        complete one step; return the outputs that the output kind asks for."""
        if self.workers is None:
            outputs = self._step()
        else:
            self.workers.check()
            try:
                outputs = self._step()
            except Exception as exc:
                raise self.workers.explain(exc) from exc
        if self.kv_events is not None:
            self.kv_events.end_step()  # the step's block events go out as one batch
        return outputs

    def _step(self) -> list[RequestOutput]:
        if self.pooler is not None:
            return self.pooler.step(self)
        if self.step_errors:
            self.step_errors = {}
        outputs: list[RequestOutput] = self._admit_compiled() if self._compiling else []
        spec = self.speculator is not None and self.speculator.active(self.scheduler.running)
        if spec:
            self._ready = None  # prepared without drafts, and its pending tokens are about to be filled in
        if self._inflight is not None and (spec or self._penalized and any(
                s.params.has_penalties for s in self.scheduler.running)):
            outputs += self._complete(self._inflight)  # drafts and penalties read every token: no overlap
            self._inflight = None
        draft_probs = None
        if self._ready is not None:  # scheduled and prepared while the previous step's forward ran
            batch, arrays = self._ready
            self._ready = None
        else:
            batch, arrays = self.scheduler.schedule(self.speculator.num_speculative_tokens if spec else 0), None
            self.runner.free_rows(batch.freed_seq_ids)  # also when nothing is launched: rows must not leak
            if self.speculator is not None:
                self.speculator.forget(batch.freed_seq_ids)
            if spec and batch.seqs:
                draft_probs = self.speculator.propose(batch)
        launched = self._launch(batch, arrays, draft_probs) if batch.seqs else None
        if self._inflight is not None:
            outputs += self._complete(self._inflight)
        if launched is not None and launched.deferred is not None:  # every matcher is now up to date
            if self.config.async_scheduling and not self._penalized and not spec:
                self._prepare_next()
            self.runner.sample(launched, self._bitmask.fill(launched.sampled, batch.speculative))
        elif launched is None and self._inflight is None and self._compiling:
            wait([f for f, _ in self._compiling.values()], timeout=0.01, return_when=FIRST_COMPLETED)
        self._inflight = launched
        if launched is not None and (spec or not self.config.async_scheduling):
            outputs += self._complete(launched)
            self._inflight = None
        return outputs

    def _prepare_next(self) -> None:
        """Schedule the next step and build its inputs now, while this step's forward runs and before its
        sampling is queued (which waits for the bitmask): the next forward is then queued right behind the
        sampling, and the GPU does not wait for the host's scheduling. Only constrained steps do this."""
        batch = self.scheduler.schedule()
        self.runner.free_rows(batch.freed_seq_ids)
        if self.speculator is not None:
            self.speculator.forget(batch.freed_seq_ids)
        self._ready = (batch, self.runner.prepare(batch) if batch.seqs else None)

    def _launch(self, batch: SchedulerOutput, arrays: StepArrays | None = None,
                draft_probs: DraftProbs | None = None) -> LaunchedStep:
        """Queue the step on the device, then advance its sequences as if it had run (``arrays``: its inputs,
        when ``_prepare_next`` built them; ``draft_probs``: a draft model's distributions of its drafts)."""
        if self.block_manager.pending_copies:  # copy-on-write of blocks shared by forked samples
            self.runner.copy_blocks(self.block_manager.pending_copies)
            self.block_manager.pending_copies = []
        prev = self._inflight.sample if self._inflight is not None else None
        launched = self.runner.launch(batch, prev.token_ids if prev is not None else None,
                                      bool(self._constrained), arrays, draft_probs)
        for seq, (first, entries) in launched.prompt_logprobs.items():
            self.output_processor.add_prompt_logprobs(seq, first, entries)
        self.scheduler.on_launched(batch, launched.sampled)
        return launched

    def _complete(self, step: LaunchedStep) -> list[RequestOutput]:
        """Wait for the step's draws, fill in the pending tokens, apply stops, build outputs.
        Sequences that finished meanwhile (aborted, or stopped by the step before) are skipped."""
        touched: dict[str, None] = {}
        stopped: set[str] = set()  # requests that may have finished: one of their sequences just did
        if step.batch.speculative:
            complete_speculative(step, self.output_processor, self.scheduler, self.speculator, touched, stopped)
            return self._outputs(step, touched, stopped)
        out = step.sample.result() if step.sample is not None else None
        accept, finish = self.output_processor.accept, self.scheduler.finish
        cache_full_blocks, FINISHED = self.block_manager.cache_full_blocks, SequenceStatus.FINISHED
        for i, seq in enumerate(step.sampled):  # plain attributes, no properties: runs for every sequence
            if seq.status is FINISHED:
                continue
            token = out.token_ids[i]
            stop = accept(seq, seq.fill_pending(token), token, out.logprobs[i] if out.logprobs is not None else None)
            if seq.grammar is not None and advance_grammar(seq, token) and stop is None:
                stop = "stop", None  # the grammar ended (its stop token need not be one of the request's)
            if stop is None:
                cache_full_blocks(seq)  # a block its token completed
            else:
                finish(seq, *stop)
                stopped.add(seq.request_id)
            touched[seq.request_id] = None
        return self._outputs(step, touched, stopped)

    def _outputs(self, step: LaunchedStep, touched: dict[str, None], stopped: set[str]) -> list[RequestOutput]:
        """The outputs of the requests a completed step touched; finished ones leave the engine."""
        outputs = self.output_processor.make_outputs(touched, stopped, step.batch.scheduled_at, time.time())
        for output in outputs:
            if output.finished:
                self._forget(output.request_id)
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar has compiled, each sample with its own matcher; a compile
        that failed (an error, past its time limit, its process died) finishes its request ("abort"), the
        error logged and kept in ``step_errors``. Never waits: it only looks at finished futures."""
        failed: list[str] = []
        for request_id, (future, seqs) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            error = future.exception() if not future.cancelled() else RuntimeError("the compile was cancelled")
            if error is None:
                compiled = future.result()
                for seq in seqs:
                    seq.grammar = new_matcher(compiled)
                self.scheduler.add_request(seqs)
                continue
            logger.error("request %s: its structured_outputs failed to compile: %s", request_id, error)
            self.scheduler.finish_unqueued(seqs)
            self.step_errors[request_id] = error
            failed.append(request_id)
        if not failed:
            return []
        now = time.time()
        outputs = self.output_processor.make_outputs(failed, set(failed), now, now)
        for request_id in failed:
            self._forget(request_id)
        return outputs

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, the grammar compiler's processes and the block-event publisher. Also
        runs at exit."""
        if self.kv_events is not None:
            self.kv_events.shutdown()
            self.kv_events = None
        if self._grammars is not None:
            self._grammars.shutdown()
        if self.workers is not None:
            self.workers.shutdown()

    @property
    def failure(self) -> str | None:
        """Why the engine cannot run any more (a tensor-parallel worker died), or None."""
        return self.workers.failure if self.workers is not None else None

    # ---- introspection --------------------------------------------------------------------
    def get_stats(self) -> dict[str, int | str | list[int]]:
        """Weights, cache and scheduler counters (``engine_stats.py`` says what each is)."""
        return engine_stats(self)


def _load_tokenizer(path: str) -> object:
    """Imported here: transformers takes most of a second to import, which a run without a tokenizer
    (``skip_tokenizer_init``, token-id prompts) need not pay."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
