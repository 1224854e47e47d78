"""The pooling runner (``runner="pooling"``): each request's prompt runs once and becomes one vector.

A pooling engine is the generate engine's scheduler, block manager and model runner with another step: prompts
are prefills, scheduled and chunked like any other (under ``max_num_batched_tokens``, preempted when the KV cache
is short), and the step runs the runner's own forward, then pools instead of sampling. The KV cache serves the
prompt's later chunks only: a request finishes, and frees its blocks, in the step that computes its last prompt
token. The hidden states pooled are the final norm's output (``model.norm``, which ``compute_logits`` applies
before the LM head: HF ``AutoModel``'s ``last_hidden_state``), in float32:

- LAST: the last prompt token's row, in the step that computes it;
- MEAN: each chunk's rows summed into a float32 accumulator per sequence, divided by the prompt's length at the
  end; a chunk at position 0 starts the sum afresh (a sequence recomputed after a preemption counts each token
  once; prefill-only steps leave at most one prompt part-done, which the scheduler serves first, so it is rare);
- CLS: the row of position 0, kept until the prompt is done.

The prefix cache: a hit skips the prompt's first tokens, whose hidden states MEAN and CLS need, so the engine runs
without it for them (``PoolerConfig.prefix_caching``); LAST keeps it (the last token is always computed).
Then a request's dimensions cut and normalisation apply (``PoolingParams``; vLLM's order: cut, then normalise),
one copy to the host per step. ``LLMEngine`` hands its ``step`` and ``add_processed_request`` here when its
runner is "pooling"; a generate engine never reaches this file.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch

from minfer.config import ModelConfig
from minfer.engine.pooler_config import PoolerConfig, read_pooler_config
from minfer.engine.sequence import Sequence
from minfer.outputs import RequestMetrics
from minfer.pooling_outputs import PoolingRequestOutput
from minfer.pooling_params import PoolingParams
from minfer.sampling_params import SamplingParams

logger = logging.getLogger("minfer")

# What a pooling sequence carries where the scheduler and the input batch read sampling parameters: it never samples.
_PROMPT_ONLY = SamplingParams(max_tokens=1, temperature=0.0)


def add_pooling_request(engine: Any, request: Any) -> None:
    """Route a checked request (``EngineRequest``) to the engine's pooler; refuse a request of the other runner."""
    if engine.pooler is None:
        raise ValueError("embedding requests (PoolingParams) need an engine built with runner='pooling' "
                         "(LLM(model, runner='pooling'), minfer serve --runner pooling); this one generates")
    engine.pooler.add(engine, request)


class Pooler:
    """A pooling engine's part: the model's ``PoolerConfig``, the live requests, the per-sequence accumulators."""

    def __init__(self, model_dir: Path, model_config: ModelConfig) -> None:
        self.config: PoolerConfig = read_pooler_config(model_dir, model_config.hidden_size)
        self.requests: dict[str, tuple[Any, RequestMetrics]] = {}  # request id -> (EngineRequest, metrics)
        self._acc: dict[int, torch.Tensor] = {}  # seq id -> MEAN: the float32 sum so far; CLS: position 0's row
        self._next_seq_id = 0  # a pooling engine's sequences are all made here
        c = self.config
        logger.info("pooling: %s%s, from %s%s", c.pooling_type, ", normalised" if c.normalize else "", c.source,
                    "" if c.prefix_caching else "; prefix caching off (it would skip tokens the pooling reads)")

    @property
    def prefix_caching(self) -> bool:
        return self.config.prefix_caching

    def add(self, engine: Any, request: Any) -> None:
        """Queue one prompt as one sequence that never samples (its whole length is its budget)."""
        params = request.params
        if not isinstance(params, PoolingParams):
            raise ValueError("this engine runs runner='pooling': it embeds prompts (LLM.embed, /v1/embeddings); "
                             "generating text needs an engine built with runner='generate'")
        if request.lora_request is not None:
            raise ValueError("lora_request is not supported with runner='pooling'")
        self.config.check(params)
        ids = request.prompt_token_ids
        seq = Sequence(self._next_seq_id, request.request_id, 0, ids, _PROMPT_ONLY, 0, frozenset(), len(ids))
        self._next_seq_id += 1
        engine.requests[request.request_id] = [seq]
        self.requests[request.request_id] = (request, RequestMetrics(request.arrival_time))
        engine.scheduler.add_request([seq])

    @torch.no_grad()
    def step(self, engine: Any) -> list[PoolingRequestOutput]:
        """Schedule prompt chunks, run them, pool; the requests whose prompt is done finish with their vector."""
        if len(self.requests) > len(engine.requests):  # some were aborted: forget them
            self.requests = {rid: r for rid, r in self.requests.items() if rid in engine.requests}
        scheduler, runner = engine.scheduler, engine.runner
        batch = scheduler.schedule()
        runner.free_rows(batch.freed_seq_ids)
        for seq_id in batch.freed_seq_ids:  # finished, aborted or preempted (a recompute starts from position 0)
            self._acc.pop(seq_id, None)
        if not batch.seqs:
            return []
        for seq in batch.seqs:
            metrics = self.requests[seq.request_id][1]
            metrics.first_scheduled_time = metrics.first_scheduled_time or batch.scheduled_at
        a = runner.prepare(batch)
        hidden, _, _ = runner._forward_step(a, None)  # the generate step's forward; nothing is pending
        done = self._pool(runner.model, hidden, a.cu.tolist(), batch.seqs)
        scheduler.on_launched(batch, [])
        if not done:
            return []
        vectors = torch.stack([v for _, v in done]).cpu()  # the step's one copy to the host
        now, outputs = time.time(), []
        for (seq, _), vector in zip(done, vectors):
            scheduler.finish(seq, "stop")
            del engine.requests[seq.request_id]
            request, metrics = self.requests.pop(seq.request_id)
            metrics.first_token_time = metrics.finished_time = now
            outputs.append(PoolingRequestOutput.make(request.request_id, request.prompt, request.prompt_token_ids,
                                                     self._finish(vector, request.params), metrics))
        return outputs

    def _pool(self, model: Any, hidden: torch.Tensor, cu: list[int], seqs: list[Sequence]
              ) -> list[tuple[Sequence, torch.Tensor]]:
        """Pool this step's rows (sequence i's chunk is rows ``cu[i]:cu[i + 1]``); returns the sequences whose
        prompt this step completes, with their float32 vectors on the device."""
        starts = [s.num_computed_tokens for s in seqs]
        done = [i for i, s in enumerate(seqs) if s.num_computed_tokens + s.num_scheduled_tokens == len(s.token_ids)]
        kind, device = self.config.pooling_type, hidden.device
        if kind == "LAST":
            if not done:
                return []
            rows = torch.tensor([cu[i + 1] - 1 for i in done], dtype=torch.int64, device=device)
            return list(zip([seqs[i] for i in done], model.norm(hidden[rows]).float()))
        if kind == "CLS":
            firsts = [i for i, start in enumerate(starts) if start == 0]
            if firsts:
                rows = torch.tensor([cu[i] for i in firsts], dtype=torch.int64, device=device)
                for i, vector in zip(firsts, model.norm(hidden[rows]).float()):
                    self._acc[seqs[i].seq_id] = vector
            return [(seqs[i], self._acc.pop(seqs[i].seq_id)) for i in done]
        lens = torch.tensor([cu[i + 1] - cu[i] for i in range(len(seqs))], device=device)
        owner = torch.repeat_interleave(torch.arange(len(seqs), device=device), lens)
        normed = model.norm(hidden[:cu[-1]]).float()
        sums = normed.new_zeros(len(seqs), normed.shape[1]).index_add_(0, owner, normed)
        for i, seq in enumerate(seqs):
            if starts[i] == 0:
                self._acc[seq.seq_id] = sums[i]
            else:
                self._acc[seq.seq_id] += sums[i]
        return [(seqs[i], self._acc.pop(seqs[i].seq_id) / len(seqs[i].token_ids)) for i in done]

    def _finish(self, vector: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        """A request's dimensions cut, then its normalisation (the model's default unless it says)."""
        if params.dimensions is not None:
            vector = vector[:params.dimensions]
        normalize = self.config.normalize if params.normalize is None else params.normalize
        return torch.nn.functional.normalize(vector, p=2, dim=-1) if normalize else vector.clone()
