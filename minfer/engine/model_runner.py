"""ModelRunner: owns the model, the paged KV cache and the sampler; launches one flattened step.

Step inputs are built with numpy over per-sequence arrays (no per-token Python loops) and go to
the device through pinned memory (a CUDA-graph decode step's in one packed transfer, see
``cuda_graphs.py``); nothing in ``launch`` waits for the device, so with async scheduling the host
prepares step N+1 while the GPU runs step N. A token sampled by step N that step N+1 consumes never
visits the host on the way: it is copied on the device from step N's sampled ids into step N+1's
input ids.

Under tensor parallelism every rank runs a ModelRunner over its shard. Rank 0's (the engine's)
builds each step and sends its host arrays down the ``StepChannel``; the others ``follow``: they
rebuild the same step from those arrays and run the same forward, CUDA-graph replays and one-token
path included, so the collectives inside pair up. Only rank 0 samples: the sampler and everything
per request (seeds, penalties, logprobs) stays in one process, and the workers receive just the
sampled ids (one broadcast on the device), which they need as the next step's pending input tokens.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from minfer.config import EngineConfig, ModelConfig, cdiv
from minfer.distributed import SINGLE, Command, StepChannel, TensorParallel
from minfer.engine.cuda_graphs import DecodeGraphs
from minfer.engine.input_batch import InputBatch, SamplingMetadata
from minfer.engine.kv_cache import KVCacheSpec, allocate_kv_cache, release_kv_cache
from minfer.engine.kv_sizing import count_kv_blocks, profile_step
from minfer.engine.lora_manager import LoRAManager
from minfer.engine.sampler import DeviceSample, Sampler, SpecSample
from minfer.engine.prompt_logprobs import prompt_logprob_chunks, prompt_logprobs
from minfer.engine.spec.draft_probs import DraftProbs, ragged_arange
from minfer.engine.spec.verify import SpecInputs, verify_inputs
from minfer.engine.scheduler import SchedulerOutput
from minfer.engine.sequence import Sequence
from minfer.engine.state_cache import allocate_state_cache, slot_bytes, state_layers
from minfer.engine.step_arrays import StepArrays, as_decode_rows, synthetic_step, token_layout
from minfer.model.loader import build_model
from minfer.ops import AttentionMetadata, select_ops

if TYPE_CHECKING:
    from minfer.engine.spec.draft_model import DraftModel
    from minfer.engine.spec.eagle3 import Eagle3Drafter

logger = logging.getLogger("minfer")


@dataclass(slots=True)
class LaunchedStep:
    """A step whose kernels are queued: its draws (still on the device; row r belongs to
    ``sampled[r]``) and its prompt logprobs (already on the host)."""

    batch: SchedulerOutput
    sampled: list[Sequence]
    sample: DeviceSample | SpecSample | None
    prompt_logprobs: dict[Sequence, tuple[int, list[dict[int, float]]]]  # (first position, entries)
    # logits, metadata and a speculative step's drafts, not yet sampled
    deferred: tuple[torch.Tensor, SamplingMetadata, SpecInputs | None] | None = None


class ModelRunner:
    def __init__(self, model_config: ModelConfig, config: EngineConfig, model_dir: Path, max_model_len: int,
                 tp: TensorParallel = SINGLE, channel: StepChannel | None = None,
                 device: torch.device | None = None, draft: "DraftModel | Eagle3Drafter | None" = None) -> None:
        """``tp``, ``channel`` and ``device``: this rank's group, the step channel and its GPU under tensor
        parallelism (every rank constructs its runner at once: start-up runs collectives). ``draft``: speculative
        decoding's drafter, loaded already: its cache takes as many blocks as the target's."""
        self.model_config, self.config = model_config, config
        self.tp, self.channel, self.draft = tp, channel, draft
        self.device = device or config.resolved_device()
        self.dtype = config.resolved_dtype(model_config)
        self.block_size, self.max_model_len = config.block_size, max_model_len
        self.ops = select_ops(config.attention_backend, self.device, self.block_size, model_config.max_head_dim,
                              max(config.max_num_batched_tokens, max_model_len))
        started = time.perf_counter()
        self.model = build_model(model_dir, model_config, self.dtype, self.device, max_model_len, self.ops, tp,
                                 config.quantization, config.load_format)
        logger.info("start-up: load weights took %.2f s", time.perf_counter() - started)
        if draft is not None:  # an EAGLE-3 head taps the target's layers: before the profile and the graphs
            draft.prepare_target(self.model)
        self.lora = LoRAManager(config, model_config, self.model, self.dtype, self.device, self.ops,
                                config.max_num_seqs, tp, channel) if config.enable_lora else None  # before the forward
        self._rank_min(0)  # every rank has its shard: no collective below waits out a slow load
        self.forward = self.ops.model_forward(self.model)  # fused at one token on the Triton ops
        self.sampler = Sampler(self.device, self.ops)
        self.kv_spec = KVCacheSpec.for_layers(  # the model's cache, as its layers hold it
            self.model.attention_layers(), self.block_size, self.dtype, config.kv_cache_dtype, max_model_len,
            hybrid=not config.disable_hybrid_kv_cache_manager)
        self.num_kv_groups = len(self.kv_spec.kv_groups)
        self.input_batch = InputBatch(config.max_num_seqs, cdiv(max_model_len, self.block_size), self.device,
                                      self.num_kv_groups)
        self.state_layers = state_layers(self.model)
        if self.state_layers:  # before the memory profile: the KV budget is what it leaves
            slots = config.max_num_seqs + 1  # a slot per input-batch row, and one for graph padding rows
            allocate_state_cache(self.state_layers, slots, self.device)
            logger.info("state cache: %d slots of %.2f MiB (%d recurrent layers)", slots,
                        slot_bytes(self.state_layers) / 2**20, len(self.state_layers))
        started = time.perf_counter()
        pair_bytes = self.block_bytes + (draft.block_bytes if draft is not None else 0)
        blocks = count_kv_blocks(config, pair_bytes, max_model_len, self.device, model_config.vocab_size,
                                 self._profile_peak)
        self.num_kv_blocks = self._rank_min(blocks)  # the smallest budget fits every rank
        logger.info("start-up: memory profile took %.2f s", time.perf_counter() - started)
        allocate_kv_cache(self.model.attention_layers(), self.kv_spec, self.num_kv_blocks, self.device)
        spec = self.kv_spec
        scales = f" + {str(spec.scale_dtype).removeprefix('torch.')} scale per token and KV head" if spec.quantized else ""
        logger.info("KV cache: %d blocks of %d tokens, %d bytes each (%.2f GiB, %s%s)", self.num_kv_blocks,
                    self.block_size, self.block_bytes, self.num_kv_blocks * self.block_bytes / 2**30,
                    spec.format_name, scales)
        if self.num_kv_groups > 1:
            logger.info("hybrid KV cache: %d groups of %d layers, windows %s", self.num_kv_groups,
                        spec.pages_per_block, [g.window for g in spec.kv_groups])
        self.graphs = self._capture_graphs()
        if self.device.type == "cuda" and self.ops.name == "triton":
            started = time.perf_counter()
            self.warm_up_kernels(self.model, self.forward)
            logger.info("start-up: kernel warm-up took %.2f s", time.perf_counter() - started)

    def _rank_min(self, value: int) -> int:
        """The smallest ``value`` over the tensor-parallel ranks (no time limit: start-up work differs by rank)."""
        if self.channel is None:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.channel.group)
        return int(t.item())

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (and their scales) src -> dst in every layer: copy on write."""
        if self.channel is not None:
            self.channel.send(Command.COPY_BLOCKS, [np.array(pairs, dtype=np.int64).reshape(-1, 2)])
        self._copy_blocks(pairs)

    @torch.no_grad()
    def _copy_blocks(self, pairs: list[tuple[int, int]] | np.ndarray) -> None:
        src = torch.tensor([int(s) for s, _ in pairs], device=self.device)
        dst = torch.tensor([int(d) for _, d in pairs], device=self.device)
        caches = {id(c): c for attn in self.model.attention_layers()  # KV groups share tensors: each once
                  for c in (attn.k_cache, attn.v_cache, attn.k_scale, attn.v_scale) if c is not None}
        for cache in caches.values():
            raw = cache.view(torch.uint8)  # as bytes: float8 has no CPU indexing kernels
            raw[dst] = raw[src]

    @property
    def block_bytes(self) -> int:
        return self.kv_spec.block_bytes

    @torch.no_grad()
    def _profile_peak(self) -> int:
        """Peak bytes of a forward at the full token budget (8-bit prefill staged, as a step's may be) and the LM
        head at max_num_seqs rows, beside the weights and the temporary cache (``kv_sizing.count_kv_blocks``)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.config.max_num_batched_tokens
        staging = self.ops.staging_tokens if self.kv_spec.scale_dtype is not None else 0
        a, blocks = profile_step(n, self.max_model_len, staging, self.block_size, self.num_kv_groups)
        allocate_kv_cache(self.model.attention_layers(), self.kv_spec, blocks, self.device, zero=False)
        ids, positions, *slots = self._upload(torch.int64, a.ids, a.positions, *a.slots)
        with self.ops.forcing_8bit_prefill(staged=True):
            hidden = self.model(ids, positions, self._metadata(a, slots))
        self.model.compute_logits(hidden[-min(n, self.config.max_num_seqs):])
        release_kv_cache(self.model.attention_layers())
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - blocks * self.block_bytes

    @torch.no_grad()
    def warm_up_kernels(self, model: torch.nn.Module, forward: Any, width: int = 64) -> None:
        """Compile the Triton variants eager (mixed prefill + decode) steps use before the first request, not while
        serving (on a GPU each costs seconds). Steps of 1, 7, 16 and 49 tokens (8-bit prefill staged, the last again
        converting in the kernel, as steps the staging rules refuse do) cover decodes with and without split-K,
        prompt chunks and every integer specialisation class; they write garbage into block 0, which no sequence
        holds yet. ``model``, ``forward``: the target's or a drafter's; ``width``: each row's blocks."""
        for i, (num_decodes, chunk) in enumerate(((1, 0), (3, 4), (1, 15), (40, 9), (40, 9))):
            q_lens = [1] * num_decodes + ([chunk] if chunk else [])
            ctx = [width * self.block_size - 8] * num_decodes + ([chunk] if chunk else [])
            a = synthetic_step(q_lens, ctx, np.zeros((len(q_lens), width), dtype=np.int32), self.num_kv_groups)
            a.positions[:] = a.slots[:] = 0  # positions in any rotary table; all writes into block 0
            ids, positions, rows, *slots = self._upload(torch.int64, a.ids, a.positions, a.logit_rows, *a.slots)
            with self.ops.forcing_8bit_prefill(staged=i < 4):
                hidden = forward(ids, positions, self._metadata(a, slots[:1] if model is not self.model else slots))
            logits = model.compute_logits(hidden[rows], float32=False)
        self.ops.gumbel_argmax(logits, torch.zeros(len(logits), dtype=torch.int64, device=self.device),
                               torch.ones(len(logits), device=self.device))
        self.ops.greedy_argmax(logits)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _capture_graphs(self) -> DecodeGraphs | None:
        if self.device.type != "cuda" or not self.ops.cuda_graphs or self.config.enforce_eager:
            return None
        started = time.perf_counter()
        graphs = DecodeGraphs(self.model, self.config.max_num_seqs, cdiv(self.max_model_len, self.block_size),
                              self.block_size, self.device, forward=self.forward, num_groups=self.num_kv_groups,
                              state_slots=self.config.max_num_seqs + 1 if self.state_layers else 0, lora=self.lora)
        graphs.capture()
        logger.info("start-up: graph capture took %.2f s", time.perf_counter() - started)
        return graphs

    def free_rows(self, seq_ids: list[int]) -> None:
        """Forget the per-row state of sequences the scheduler finished or preempted."""
        self.input_batch.free(seq_ids)

    def prepare(self, batch: SchedulerOutput) -> StepArrays:
        """Flatten the step on the host: per-token ids, positions, slots (and LoRA slots), per-sequence tables.
        Per-sequence facts are read with one plain list comprehension each (no properties, no generators): at 256
        sequences this loop is most of the cost. A speculative step's sequences append their drafts after their
        last known token; every row from it on gives logits (the target's at each drafted position and after)."""
        seqs, nd = batch.seqs, batch.num_decodes
        rows = self.input_batch.rows(seqs)
        q_list = [s.num_scheduled_tokens for s in seqs]
        start_list = [s.num_computed_tokens for s in seqs]
        token_lists = [s.token_ids for s in seqs]
        ids_list = [t[c] for t, c in zip(token_lists[:nd], start_list)]  # decodes: one token each
        for s, t, c, q in zip(seqs[nd:], token_lists[nd:], start_list[nd:], q_list[nd:]):  # prompt chunks
            ids_list += t[c:c + q]
            if s.spec_token_ids:
                ids_list += s.spec_token_ids
        q_lens = np.array(q_list, dtype=np.int64)
        starts = np.array(start_list, dtype=np.int64)
        num_tokens = np.array([len(t) for t in token_lists], dtype=np.int64)
        spec_lens = None
        if batch.speculative:
            spec_lens = np.array([len(s.spec_token_ids) for s in seqs], dtype=np.int64)
            num_tokens += spec_lens
        ids = np.array(ids_list, dtype=np.int64)
        ib = self.input_batch
        tables = ib.block_tables[:, rows, :int(ib.num_blocks[:, rows].max())]  # [groups, seqs, width]
        cu, positions, slots = token_layout(q_lens, starts, tables, self.block_size)
        ends = starts + q_lens
        pending = np.array([i for i, s in enumerate(seqs) if s.num_pending], dtype=np.int64)
        fill_src = ib.sample_row[rows[pending]]
        fill_dst = cu[pending] + num_tokens[pending] - 1 - starts[pending]  # always its sequence's last token
        samples = ends == num_tokens
        logit_rows, verify = cu[1:][samples] - 1, False
        if spec_lens is not None:  # each sampling sequence's last 1 + k rows; no prompt chunk: run as decode rows
            k = spec_lens[samples]
            logit_rows = np.repeat(logit_rows - k, k + 1) + ragged_arange(k + 1)
            verify = bool((q_lens == 1 + spec_lens).all())
        lora = np.repeat(self.lora.step_slots(seqs), q_lens) if self.lora is not None else None  # each token's
        return StepArrays(ids, positions, slots, tables, ends.astype(np.int32), q_lens, cu,
                          logit_rows, nd, fill_dst, fill_src, rows, num_tokens, samples, spec_lens, verify, lora)

    def _upload(self, dtype: torch.dtype, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Copy ``arrays`` to the device as ``dtype`` in one transfer, through pinned memory on CUDA
        (an asynchronous copy that never waits for the GPU); returns one device view per array.

        Each view starts on a 64-byte boundary: Triton specialises kernels on 16-byte pointer
        alignment, and views at arbitrary offsets compiled new variants in the middle of a run."""
        align = 64 // dtype.itemsize
        starts = np.cumsum([0] + [-(-a.size // align) * align for a in arrays])
        host = torch.empty(int(starts[-1]), dtype=dtype, pin_memory=self.device.type == "cuda")
        buf = host.numpy()
        for a, at in zip(arrays, starts):
            buf[at:at + a.size] = a.ravel()
        dev = host.to(self.device, non_blocking=True)
        return [dev[at:at + a.size].view(a.shape) for a, at in zip(arrays, starts)]

    def _metadata(self, a: StepArrays, slots: list[torch.Tensor]) -> AttentionMetadata:
        """Attention inputs of an eager step (``slots``: each KV group's slot mapping, on the device); each
        group's tables, and the prefill rows' tables and lengths, go up as arrays of their own (aligned,
        see AttentionMetadata)."""
        nd, num_seqs, groups = a.num_decodes, len(a.q_lens), len(a.tables)
        ctx_lens, p_ctx, p_cu, *tables = self._upload(
            torch.int32, a.ctx_lens, a.ctx_lens[nd:], a.cu[nd:] - nd, *a.tables, *a.tables[:, nd:])
        state = {}
        if self.state_layers:  # a made-up step (profile, warm-up) has no rows: any slots, none live yet
            rows = a.batch_rows if a.batch_rows is not None else np.arange(num_seqs) % (self.config.max_num_seqs + 1)
            state_slots, has, cu = self._upload(torch.int32, rows, a.ctx_lens > a.q_lens, a.cu)
            state = dict(state_slots=state_slots, has_state=has.bool(), query_start_loc=cu)
        return AttentionMetadata(**state,
            slot_mapping=slots, block_tables=tables[:groups], context_lens=ctx_lens, num_decodes=nd,
            block_size=self.block_size, prefill_query_start_loc=p_cu,
            max_prefill_query_len=int(a.q_lens[nd:].max()) if nd < num_seqs else 0,
            prefill_block_tables=tables[groups:], prefill_context_lens=p_ctx,
            context_lens_host=a.ctx_lens.tolist(), query_lens_host=a.q_lens.tolist())

    @torch.no_grad()
    def launch(self, batch: SchedulerOutput, prev_tokens: torch.Tensor | None,
               defer_sampling: bool = False, arrays: StepArrays | None = None,
               draft_probs: DraftProbs | None = None) -> LaunchedStep:
        """Queue one forward over the step's tokens (a graph replay for pure decodes) and the draws of
        the sequences that reach their end; ``prev_tokens`` are the previous step's sampled ids, the
        source of this step's pending input tokens. Waits for the device only for prompt logprobs.
        ``defer_sampling``: when a sampling row is constrained (structured outputs), queue the forward
        only and leave ``deferred`` set: ``sample`` queues the draws later, with the token masks filled
        while the forward runs (a constrained sequence still mid-prompt samples nothing and does not
        defer). ``arrays``: ``prepare(batch)``, when the engine built the step's inputs ahead.
        ``draft_probs``: a draft model's distributions of a speculative step's drafted tokens (None: n-gram
        drafts, or all greedy)."""
        a = self.prepare(batch) if arrays is None else arrays
        if self.draft is not None:
            self.draft.note_step(batch.seqs, a)
        if len(a.fill_dst) and prev_tokens is None:
            raise RuntimeError("a scheduled token is pending, but no previous step's sampled ids were given")
        chunks = prompt_logprob_chunks(batch)
        if self.channel is not None:
            rows = np.array([(lo, hi) for _, _, lo, hi in chunks], dtype=np.int64).reshape(-1, 2)
            self.channel.send(Command.STEP, a.message(rows))
        hidden, logits, rows = self._forward_step(a, prev_tokens)
        seqs = batch.seqs
        every = len(a.logit_rows) == len(seqs) and a.spec_lens is None
        which = slice(None) if every else a.samples
        sampled = list(seqs) if every else [s for s, m in zip(seqs, a.samples.tolist()) if m]
        step = LaunchedStep(batch, sampled, None, {})
        if sampled:
            if logits is None:
                logits = self.model.compute_logits(hidden[rows], float32=False)
            sample_rows = a.batch_rows[which]
            counts = a.num_tokens[which] - self.input_batch.prompt_lens[sample_rows]
            if a.spec_lens is None:
                meta = self.input_batch.sampling_metadata(sample_rows, counts, sampled)
                step.deferred = (logits, meta, None)
            else:
                k = a.spec_lens[which]
                draft_ids, = self._upload(torch.int64, np.array([t for s in sampled for t in s.spec_token_ids],
                                                                 dtype=np.int64))
                step.deferred = verify_inputs(self.input_batch, logits, sampled, sample_rows, counts, k, draft_ids,
                                              draft_probs)
            self.input_batch.sample_row[sample_rows] = np.arange(len(sampled))
            if not (defer_sampling and any(s.grammar is not None for s in sampled)):
                self.sample(step)
        step.prompt_logprobs = prompt_logprobs(self.model, self.sampler, chunks, hidden) if chunks else {}
        return step

    @torch.no_grad()
    def sample(self, step: LaunchedStep, bitmask: torch.Tensor | None = None) -> None:
        """Queue the draws of a launched step (``bitmask``: structured outputs' allowed tokens per row)."""
        logits, meta, spec = step.deferred
        step.deferred = None
        if spec is None:
            sample = step.sample = self.sampler(logits, meta, bitmask)
            self.tp.broadcast(sample.token_ids)  # the followers' next pending input tokens
        else:
            sample = step.sample = self.sampler.verify(logits, meta, spec.spec_lens, spec.draft_ids,
                                                       spec.draft_probs, bitmask)
            self.tp.broadcast(torch.zeros(len(logits), dtype=torch.int64, device=self.device))  # no pending ids
        sample.start_copy()

    def _forward_step(self, a: StepArrays, prev_tokens: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The step's forward, on every rank alike: (hidden states, the sampling rows' logits when the
        decode graph made them, else None, the sampling rows on the device when they were uploaded)."""
        rows = None
        if a.verify:
            a = as_decode_rows(a)
        if self.graphs is not None and a.num_decodes == len(a.q_lens) and self.graphs.can_run(len(a.q_lens),
                                                                                              a.tables.shape[2]):
            src_rows = np.full(len(a.ids), -1, dtype=np.int64)
            src_rows[a.fill_dst] = a.fill_src  # a decode's one token is its row
            hidden, logits = self.graphs.run(a.ids, a.positions, a.slots, src_rows, a.ctx_lens, a.tables, prev_tokens,
                                             a.batch_rows, a.lora_slots)
            if len(a.logit_rows) != len(logits):
                rows, = self._upload(torch.int64, a.logit_rows)
                logits = logits[rows]
            return hidden, logits, rows
        ids, positions, rows, fill_dst, fill_src, *slots = self._upload(
            torch.int64, a.ids, a.positions, a.logit_rows, a.fill_dst, a.fill_src, *a.slots)
        if len(a.fill_dst):
            ids.index_copy_(0, fill_dst, prev_tokens.index_select(0, fill_src))
        if self.lora is not None:
            self.lora.set_eager(a.lora_slots, self._upload)
        return self.forward(ids, positions, self._metadata(a, slots)), None, rows

    @torch.no_grad()
    def follow(self) -> None:
        """A tensor-parallel worker's loop: run every command rank 0 sends until it says stop."""
        prev_tokens: torch.Tensor | None = None
        drafts: torch.Tensor | None = None  # the draft model's last draws (speculative decoding)
        while True:
            command, arrays = self.channel.recv()
            if command is Command.STEP:
                prev_tokens = self._follow_step(*StepArrays.from_message(arrays), prev_tokens)
            elif command is Command.DRAFT:
                drafts = self.draft.follow(arrays, drafts)
            elif command is Command.LORA:
                self.lora.follow(arrays)
            elif command is Command.COPY_BLOCKS:
                self._copy_blocks(arrays[0])
            elif command is Command.SHUTDOWN:
                return

    def _follow_step(self, a: StepArrays, prompt_logprob_rows: np.ndarray, prev_tokens: torch.Tensor | None
                     ) -> torch.Tensor | None:
        """Rank 0's ``launch`` as seen from a worker: the same forward and LM-head gathers, in the same
        order; returns the sampled ids rank 0 broadcasts."""
        hidden, logits, rows = self._forward_step(a, prev_tokens)
        tokens = None
        if len(a.logit_rows):
            if logits is None:
                self.model.compute_logits(hidden[rows], float32=False)
            tokens = self.tp.broadcast(torch.empty(len(a.logit_rows), dtype=torch.int64, device=self.device))
        for lo, hi in prompt_logprob_rows.tolist():
            self.model.compute_logits(hidden[lo:hi])
        return tokens
