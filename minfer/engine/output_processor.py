"""OutputProcessor: sampled tokens in, stop decisions and RequestOutputs out.

It owns everything a request produces for its caller: each sample's incremental text, logprobs and
what delta outputs have already carried, the prompt logprobs, and the request's timings. The engine
hands it every token a step accepted; it answers whether that token ends the sequence (a stop token,
EOS, a stop string, the length limit) and builds the outputs in the mode chosen at construction.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from tokenizers.decoders import DecodeStream

from minfer.engine.processor import EngineRequest
from minfer.engine.sequence import Sequence, SequenceStatus
from minfer.outputs import CompletionOutput, RequestMetrics, RequestOutput, RequestOutputKind

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, for leading-space rules

Stop = tuple[str, int | str | None]  # (finish_reason, stop_reason)


class IncrementalDetokenizer:
    """The text each new token adds, without decoding the whole output again.

    A token's text can depend on its neighbours (leading-space rules of SentencePiece, multi-byte
    characters split across byte-level tokens). A fast tokenizer streams through ``tokenizers``'
    ``DecodeStream``, primed with the prompt's last tokens (0.7 µs a token against 5.3 for re-decoding a
    window, on the built-in model's tokenizer). Other tokenizers decode a short window ending at the new
    token and emit only the part after the already-emitted window, holding back text that still ends in
    an incomplete character (U+FFFD).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # window start: decoded for context only
        self.read_offset = len(self.ids)  # text up to here has been emitted
        self.text = ""
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if self._backend is not None:
            try:
                self._stream = DecodeStream(ids=self.ids, skip_special_tokens=skip_special_tokens)
            except TypeError:  # tokenizers before 0.22 cannot prime a stream: the window decode below
                pass

    def step(self, token_id: int) -> str:
        """Append one token; return the text it made final (may be empty)."""
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id) or ""
            self.text += delta
            return delta
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip_special_tokens)
        after = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta


@dataclass(slots=True, eq=False)
class SampleState:
    """One sample's output so far. ``text`` is set once the sample finishes (the incremental text,
    cut at a stop string, or the whole output decoded once)."""

    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str | None = None
    num_reported: int = 0  # output tokens already sent in delta outputs


@dataclass(slots=True, eq=False)
class RequestState:
    request: EngineRequest
    seqs: list[Sequence]
    samples: list[SampleState]
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=lambda: [None])
    reported: bool = False  # a delta output went out (it carried the prompt logprobs)


class OutputProcessor:
    """``output_kind``: FINAL_ONLY returns finished requests only, their text decoded once at the end
    (unless stop strings need it earlier); CUMULATIVE returns every request that got a token, whole;
    DELTA (the server's) returns only what is new. A whole snapshot copies every output token and
    logprob so far, so a stream of n tokens would cost O(n^2); a delta's ``token_ids`` and ``logprobs``
    hold the tokens since the sequence's previous output, from ``token_offset`` on, and
    ``prompt_logprobs`` comes only with the request's first output. ``text`` stays whole (sharing a str
    costs nothing, and stop strings may cut text already produced). A finished request's output is
    whole in every mode, so a consumer that keeps only the last output still gets everything.
    """

    def __init__(self, tokenizer: Any, output_kind: RequestOutputKind) -> None:
        self.tokenizer = tokenizer
        self.output_kind = output_kind
        self.requests: dict[str, RequestState] = {}
        self._incremental = tokenizer is not None and output_kind is not RequestOutputKind.FINAL_ONLY  # text every step

    def add_request(self, request: EngineRequest, seqs: list[Sequence]) -> None:
        p = request.params
        incremental = self._incremental or (self.tokenizer is not None and bool(p.stop_strings))
        samples = [SampleState(IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, p.skip_special_tokens)
                               if incremental else None) for _ in seqs]
        self.requests[request.request_id] = RequestState(request, seqs, samples, RequestMetrics(request.arrival_time))

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def add_prompt_logprobs(self, seq: Sequence, first: int, entries: list[dict[int, float]]) -> None:
        """Logprobs of the prompt tokens at ``first + 1``, ``first + 2``, ...; positions recorded before
        (a preempted sequence recomputes its prompt) are skipped."""
        recorded = self.requests[seq.request_id].prompt_logprobs
        skip = len(recorded) - 1 - first
        if seq.index == 0 and skip < len(entries):
            recorded += entries[max(skip, 0):]

    def accept(self, seq: Sequence, at: int, token: int, logprobs: dict[int, float] | None) -> Stop | None:
        """Record ``token``, the sequence's token at position ``at``; return why it ends the sequence, if it does."""
        p = seq.params
        # The sample's state only when something reads it: this runs for every token of every step, and the
        # lookup cost a tenth of a step's completion at 256 sequences of workload A.
        sample = self.requests[seq.request_id].samples[seq.index] if self._incremental or logprobs is not None \
            or p.stop_strings else None
        if logprobs is not None:
            sample.logprobs.append(logprobs)
            sample.cumulative_logprob += logprobs[token]
        may_stop = at + 1 - len(seq.prompt_token_ids) >= p.min_tokens
        if may_stop and token in p.stop_token_ids:
            return "stop", token
        if may_stop and not p.ignore_eos and token in seq.eos_token_ids:
            return "stop", None
        if sample is not None and sample.detokenizer is not None:
            delta = sample.detokenizer.step(token)
            if delta and may_stop and p.stop_strings:
                stop = self._find_stop_string(sample, len(delta), p.stop_strings, p.include_stop_str_in_output)
                if stop is not None:
                    return "stop", stop
        if at + 1 >= seq.max_total_tokens:
            return "length", None
        return None

    @staticmethod
    def _find_stop_string(sample: SampleState, delta_len: int, stops: tuple[str, ...], keep: bool) -> str | None:
        """A stop string that the new text completed (it may span tokens); the text is cut there."""
        text = sample.detokenizer.text  # type: ignore[union-attr]
        for stop in stops:
            at = text.find(stop, max(0, len(text) - delta_len - len(stop) + 1))
            if at >= 0:
                sample.text = text[:at + len(stop) if keep else at]
                return stop
        return None

    def make_outputs(self, request_ids: Iterable[str], stopped: set[str], scheduled_at: float,
                     now: float) -> list[RequestOutput]:
        """Outputs of the requests that got tokens this step (``stopped``: those of them with a sequence
        that just finished); finished requests are forgotten here."""
        outputs = []
        stream = self.output_kind is not RequestOutputKind.FINAL_ONLY
        FINISHED = SequenceStatus.FINISHED
        for request_id in request_ids:
            state = self.requests[request_id]
            metrics = state.metrics
            if not metrics.first_scheduled_time:
                metrics.first_scheduled_time = scheduled_at
            if not metrics.first_token_time:
                metrics.first_token_time = now
            finished = request_id in stopped and all(s.status is FINISHED for s in state.seqs)
            if finished:
                metrics.finished_time = now
                del self.requests[request_id]
            if finished or stream:
                outputs.append(self._make_output(state, finished))
        return outputs

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput:
        """The request's output: whole, or (DELTA, unfinished request) what is new since each sequence's
        previous output. It runs for every request of every streaming step, so it reads plain attributes."""
        delta = self.output_kind is RequestOutputKind.DELTA and not finished
        request = state.request
        wants_lp = request.params.logprobs is not None
        completions = []
        for seq, sample in zip(state.seqs, state.samples):
            num_prompt, known = len(seq.prompt_token_ids), len(seq.token_ids) - seq.num_pending
            start = sample.num_reported if delta else 0
            sample.num_reported = num_out = known - num_prompt
            if seq.status is SequenceStatus.FINISHED:
                text = self._final_text(seq, sample)
            else:
                text = sample.detokenizer.text if sample.detokenizer is not None else ""
            completions.append(CompletionOutput(
                seq.index, text, seq.token_ids[num_prompt + start:known],
                sample.cumulative_logprob if wants_lp else None, sample.logprobs[start:num_out] if wants_lp else None,
                seq.finish_reason, seq.stop_reason, start))
        prompt_lp = None
        if request.params.prompt_logprobs is not None and not (delta and state.reported):
            prompt_lp = list(state.prompt_logprobs)
        state.reported = state.reported or delta
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions, finished,
                             state.metrics, prompt_lp)

    def _final_text(self, seq: Sequence, sample: SampleState) -> str:
        if sample.text is None:
            sample.text = "" if self.tokenizer is None else self.tokenizer.decode(
                seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
        return sample.text
