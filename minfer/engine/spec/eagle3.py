"""The EAGLE-3 drafter: a one-layer head (``models/eagle3.py``) drafting from the target's hidden states.

The target's layers named by the head write the residual stream entering them into rows of ``aux``, one per
token of the step (``DecoderLayer.capture``, in its forward, its one-token forward and so its CUDA graphs), so
the step that verifies drafts also yields the features of the next drafts. ``note_step`` keeps where each
sequence's tokens sit in those rows; the next speculative step's ``propose`` then feeds the head, for each
sequence of its batch, every position p of the last step whose next token is now known: the feature of p with
token p + 1, overwriting what the head's cache held there (its own guesses of the last drafts). The last of
those positions, the one before the sequence's newest token, draws the first draft; each further draft is a
one-token step on the head's own output feature.

The head's KV cache mirrors the target's as a draft model's does: the target's block count, its full-attention
group's block tables. A sequence's positions from steps that did not speculate (a batch too large, every
sequence backing off) are not fed: the head attends over whatever its cache holds there, which lowers the
acceptance, never the output, which the target verifies. Its steps replay CUDA graphs of its own as a draft
model's do (a catch-up of a few tokens a sequence as one-token rows), the features staged into a buffer the
graphs read. It runs unsplit: tensor parallelism is refused.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from minfer.config import EngineConfig, ModelConfig
from minfer.distributed import TensorParallel
from minfer.engine.kv_cache import KVCacheSpec
from minfer.engine.sequence import Sequence
from minfer.engine.spec.draft_model import GRAPH_CATCH_UP, attach_to_target
from minfer.engine.spec.draft_probs import DraftProbs, collect_drafts
from minfer.engine.cuda_graphs import DecodeGraphs
from minfer.engine.step_arrays import StepArrays, as_decode_rows, token_layout
from minfer.model.loader import build_model, resolve_model_path, safetensors_files
from minfer.model.models.eagle3 import default_aux_layers
from minfer.model.models.llama import DecoderLayer
from minfer.model.registry import load_model_config
from minfer.ops import select_ops
from minfer.spec_config import SpeculativeConfig

logger = logging.getLogger("minfer")
_NONE = np.zeros(0, dtype=np.int64)
WARM_UP_ROWS = 64  # at least the tokens of ModelRunner.warm_up_kernels' largest made-up step (49)


class Eagle3Drafter:
    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, target: ModelConfig, max_model_len: int,
                 device: torch.device, tp: TensorParallel) -> None:
        if tp.size > 1:
            raise ValueError("speculative_config.method 'eagle3' needs tensor_parallel_size 1 (the head runs unsplit "
                             "beside the target); use 'ngram' or 'draft_model' under tensor parallelism")
        path = resolve_model_path(spec.model, None, config.download_dir, config.load_format)
        self.model_config = mc = load_model_config(path, draft_head=True)
        extra, n = mc.extra, target.num_hidden_layers
        if mc.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model {spec.model!r} has vocab_size {mc.vocab_size}, the target "
                             f"{target.vocab_size}: an EAGLE-3 head must be trained for the target")
        if extra["target_hidden_size"] != target.hidden_size:
            raise ValueError(f"speculative_config.model {spec.model!r} reads hidden states of width "
                             f"{extra['target_hidden_size']}, the target's are {target.hidden_size}")
        self.aux_layers = extra["aux_layer_ids"] or default_aux_layers(n)
        if len(set(self.aux_layers)) != 3 or not all(0 <= i < n for i in self.aux_layers):
            raise ValueError(f"speculative_config.model {spec.model!r}: eagle_aux_hidden_state_layer_ids "
                             f"{list(self.aux_layers)} must be 3 distinct layers of the target's {n}")
        if config.load_format != "dummy":  # a head may bring its own token embedding; most share the target's
            extra["own_embedding"] = any(name.endswith("embed_tokens.weight") for file in safetensors_files(path)
                                         for name in safe_open(str(file), framework="pt").keys())
        self.device = device
        self.dtype = config.resolved_dtype(target)  # the target's: the head reads its hidden states
        self.block_size = config.block_size
        self.ops = select_ops(config.attention_backend, device, config.block_size, mc.max_head_dim,
                              config.max_num_batched_tokens)
        started = time.perf_counter()
        self.model = build_model(path, mc, self.dtype, device, max_model_len, self.ops, tp, None, config.load_format)
        logger.info("start-up: load the EAGLE-3 head took %.2f s", time.perf_counter() - started)
        self.kv_spec = KVCacheSpec.for_layers(self.model.attention_layers(), config.block_size, self.dtype,
                                              config.kv_cache_dtype, max_model_len, hybrid=False)
        # the most sequences a step drafts for, and so the rows of the head's graphs (a catch-up's tokens each a row)
        drafting = min(config.max_num_seqs, spec.disable_by_batch_size or config.max_num_seqs)
        self.graph_rows = drafting * (1 + spec.num_speculative_tokens)
        # every target forward's tokens: a step's budget, a verify step's rows, the start-up warm-up's 49
        self.max_rows = max(config.max_num_batched_tokens, config.max_num_seqs * (1 + spec.num_speculative_tokens),
                            WARM_UP_ROWS)
        self.aux: torch.Tensor | None = None  # [rows, 3 * hidden]: the target's captured states of its last step
        # the features the head's graphs read, staged before each replay (the eager warm-up's steps too)
        self.features = torch.zeros(max(self.graph_rows, WARM_UP_ROWS), mc.hidden_size, dtype=self.dtype,
                                    device=device)
        self.graphs: DecodeGraphs | None = None
        self.last: tuple[list[Sequence], np.ndarray, np.ndarray] | None = None  # its sequences, cu, start positions
        self.runner: Any = None
        self.group = 0

    @property
    def block_bytes(self) -> int:
        return self.kv_spec.block_bytes

    def prepare_target(self, model: Any) -> None:
        """Point the target's aux layers at ``aux`` (before its memory profile and graph capture, which then
        include the copies) and share its token embedding."""
        layers = model.layers
        if not all(isinstance(layer, DecoderLayer) for layer in layers) or \
                getattr(model, "fused_one_token", None) not in (None, "llama"):
            raise ValueError(f"speculative_config.method 'eagle3': a {type(model).__name__} target does not expose "
                             "its hidden states yet (Llama-layout decoders do: Llama, Qwen2/3, Mixtral, gpt-oss)")
        h = model.config.hidden_size
        self.aux = torch.zeros(self.max_rows, 3 * h, dtype=self.dtype, device=self.device)
        for j, i in enumerate(self.aux_layers):
            layers[i].capture = self.aux[:, j * h:(j + 1) * h]
        if not self.model_config.extra.get("own_embedding"):
            self.model.share_embedding(model.embed)

    def attach(self, runner: Any) -> None:
        """Allocate the head's cache with the target's block count and read the target's block tables."""
        attach_to_target(self, runner, "an EAGLE-3 head", self.graph_rows, self._graph_forward)

    def forget(self, seq_ids: list[int]) -> None:
        """Nothing to drop: a sequence's head KV lives in its blocks, rewritten from the features it is fed."""

    def note_step(self, seqs: list[Sequence], a: StepArrays) -> None:
        """The target's step that is filling ``aux``: sequence i's tokens are rows cu[i]..cu[i+1] from position
        starts[i]."""
        self.last = (seqs, a.cu, a.positions[a.cu[:-1]] if len(a.positions) else a.cu[:-1])

    @torch.no_grad()
    def propose(self, seqs: list[Sequence], room: list[int], batch: list[Sequence]) -> DraftProbs | None:
        """Feed the head what the last step computed for the sequences of ``batch``, then draft ``room[i]`` tokens
        for ``seqs[i]`` (``Sequence.spec_token_ids``); a sequence the last step left short of its newest token
        drafts nothing. Returns the draft distributions (None when a row draws greedily)."""
        for seq in seqs:
            seq.spec_token_ids = []
        fed, starts, counts, rows = self._fed(batch)
        if not fed:
            return None
        order = np.argsort(counts > 1, kind="stable")  # one-token rows first, as the attention layout wants
        fed, starts, counts, rows = [fed[i] for i in order], starts[order], counts[order], rows[order]
        ids = np.concatenate([np.asarray(s.token_ids[p + 1:p + 1 + c], dtype=np.int64)
                              for s, p, c in zip(fed, starts.tolist(), counts.tolist())])
        aux_rows = np.concatenate([np.arange(r, r + c) for r, c in zip(rows.tolist(), counts.tolist())])
        ib = self.runner.input_batch
        feature, logits = self._forward(ids, None, starts, counts, ib.rows(fed),
                                        self.model.combine(self.aux.index_select(0, self._upload(aux_rows))))
        index = {s.seq_id: i for i, s in enumerate(fed)}
        lengths = np.array([len(s.token_ids) for s in seqs], dtype=np.int64)
        drafting = [i for i, s in enumerate(seqs) if s.seq_id in index
                    and starts[index[s.seq_id]] + counts[index[s.seq_id]] == lengths[i] - 1]
        if not drafting:
            return None
        pick = self._upload(np.array([index[seqs[i].seq_id] for i in drafting]))
        feature, logits = feature.index_select(0, pick), logits.index_select(0, pick)
        order = np.array(drafting, dtype=np.int64)
        batch_rows = ib.rows([seqs[i] for i in order])
        outputs = lengths[order] - ib.prompt_lens[batch_rows]  # output tokens before the first draft
        tokens, probs = self._sample(logits, order, batch_rows, outputs, seqs)
        steps = [(order, tokens, probs)]
        room_arr = np.asarray(room)
        for j in range(1, max(room[i] for i in drafting)):  # draft j + 1 from draft j, on the head's own feature
            keep = np.flatnonzero(room_arr[order] > j)
            order, batch_rows, outputs = order[keep], batch_rows[keep], outputs[keep]
            keep_dev = self._upload(keep)
            feature, logits = self._forward(None, tokens.index_select(0, keep_dev), lengths[order] - 2 + j,
                                            np.ones(len(order), dtype=np.int64), batch_rows,
                                            feature.index_select(0, keep_dev))
            tokens, probs = self._sample(logits, order, batch_rows, outputs + j, seqs)
            steps.append((order, tokens, probs))
        return collect_drafts(seqs, steps)

    def _fed(self, batch: list[Sequence]) -> tuple[list[Sequence], np.ndarray, np.ndarray, np.ndarray]:
        """The sequences of ``batch`` the last step left features for: each one's first position, how many
        positions (those whose next token is known) and the first of their rows in ``aux``."""
        if self.last is None:
            return [], _NONE, _NONE, _NONE
        last_seqs, cu, first = self.last
        where = {s.seq_id: i for i, s in enumerate(last_seqs)}
        fed, starts, counts, rows = [], [], [], []
        for seq in batch:
            i = where.get(seq.seq_id)
            if i is None:
                continue
            start = int(first[i])
            count = min(int(cu[i + 1] - cu[i]), len(seq.token_ids) - 1 - start)
            if count > 0:
                fed.append(seq)
                starts.append(start)
                counts.append(count)
                rows.append(int(cu[i]))
        self.last = None  # read once: the next step overwrites aux
        as_array = lambda xs: np.array(xs, dtype=np.int64)  # noqa: E731
        return fed, as_array(starts), as_array(counts), as_array(rows)

    def _forward(self, ids: np.ndarray | None, prev: torch.Tensor | None, starts: np.ndarray, q_lens: np.ndarray,
                 batch_rows: np.ndarray, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over ``q_lens`` tokens per sequence from position ``starts`` (one-token rows first; the tokens
        ``ids`` on the host, or one each in ``prev`` on the device), through the target's block tables of its
        full-attention group: each sequence's last output feature and its logits over the target's vocabulary.
        A replay of the head's decode graphs when every sequence brings few tokens (each token a row of its own,
        as a verify step's are: ``step_arrays.as_decode_rows``), else eager."""
        runner, ib, g = self.runner, self.runner.input_batch, self.group
        tables = ib.block_tables[g:g + 1, batch_rows, :int(ib.num_blocks[g, batch_rows].max())]
        cu, positions, slots = token_layout(q_lens, starts, tables, self.block_size)
        a = StepArrays(ids if ids is not None else np.zeros(len(positions), dtype=np.int64), positions, slots, tables,
                       (starts + q_lens).astype(np.int32), q_lens, cu, cu[1:] - 1, int((q_lens == 1).sum()),
                       _NONE, _NONE, batch_rows)
        if self.graphs is not None and q_lens.max() <= GRAPH_CATCH_UP:
            d = as_decode_rows(a)
            n = len(d.ids)
            if self.graphs.can_run(n, d.tables.shape[2]):
                self.features[:n].copy_(feature)
                src = np.arange(n) if prev is not None else np.full(n, -1, dtype=np.int64)
                hidden, logits = self.graphs.run(d.ids, d.positions, d.slots, src, d.ctx_lens, d.tables, prev)
                if len(a.logit_rows) == n:
                    return hidden, logits
                last = self._upload(a.logit_rows)
                return hidden.index_select(0, last), logits.index_select(0, last)
        pos, last, slot = runner._upload(torch.int64, positions, a.logit_rows, slots[0])
        hidden = self.model(prev if prev is not None else self._upload(ids), pos, runner._metadata(a, [slot]), feature)
        hidden = hidden.index_select(0, last)
        return hidden, self.model.compute_logits(hidden, float32=False)

    def _graph_forward(self, ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        """The forward the head's graphs capture: its features staged in ``features`` beforehand."""
        return self.model(ids, positions, meta, self.features[:ids.shape[0]])

    def _sample(self, logits: torch.Tensor, order: np.ndarray, batch_rows: np.ndarray, outputs: np.ndarray,
                seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draw a draft from each row's logits with its sequence's sampling parameters."""
        meta = self.runner.input_batch.sampling_metadata(batch_rows, outputs, [seqs[i] for i in order])
        return self.runner.sampler.draft(logits, meta)

    def _upload(self, array: np.ndarray) -> torch.Tensor:
        return self.runner._upload(torch.int64, np.asarray(array, dtype=np.int64))[0]

