"""Beam search over the engine, vLLM's design with HF transformers' semantics.

The engine knows nothing of beams. Each round every live beam of every prompt is one request of one token,
``prompt + beam tokens`` with ``logprobs=K`` (K = ``max(2, 1 + number of EOS ids) * beam_width``: HF's number of
candidates, so that at least ``beam_width`` of them do not end in EOS); the requests of a round run as one batch. The
prefix cache serves each request's full KV blocks (beams share their prompt's and their common ancestors'), and only
the tokens past the last full block are computed again: a beam's partial last block is recomputed, not shared by
copy-on-write. ``beam_search_rounds`` is the algorithm as a generator (it yields a round's prompts and parameters,
and is sent their logprobs), so the offline ``LLM`` drives it with blocking steps (``run_beam_search``) and the
server with awaited ones.

The search is HF's ``generate(num_beams=k, do_sample=False, length_penalty=..., early_stopping=...)`` step for step:

- the K best (beam, token) continuations by cumulative logprob (raw log-softmax, as HF's without logits
  processors); those ending in EOS finish, but only if among the k best; the k best others run on;
- a finished sequence scores ``cum_logprob / generated_len ** length_penalty``, its EOS counted, the prompt not;
- at ``max_tokens`` the k best continuations all finish; before it the search stops once k sequences finished and
  (``early_stopping=True``) at once, or (False) when the best running beam's ``cum_logprob / len ** length_penalty``
  cannot beat the worst finished one, or (``"never"``) the same with ``max_tokens`` as the length when
  ``length_penalty > 0``;
- the output: the k finished sequences, best score first.

vLLM's own ``beam_search`` differs: it always runs ``max_tokens`` steps (no early stop), takes every EOS among
its 2k candidates as finished (not only those in the top k), and divides by the length with the prompt and without
the EOS. ``temperature`` is accepted for vLLM's signature and changes nothing (as in vLLM, whose beam scores are raw
logprobs, and in HF with ``do_sample=False``).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from minfer.outputs import CompletionOutput, RequestOutput
from minfer.sampling_params import SamplingParams

Round = tuple[list[list[int]], SamplingParams]  # the token-id prompts of a round and their one-token parameters
TopLogprobs = dict[int, float]  # a beam's next-token logprobs: at least its K best


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``; ``early_stopping`` (True, False or "never") is HF's, with its default."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _finite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One result, vLLM's shape: ``tokens`` are the prompt's then the generated ones, ``text`` their decoding
    (``LLM.beam_search``: the whole sequence, as vLLM's), ``logprobs`` each generated token's step entry (its
    beam's K best). ``score`` is HF's ``sequences_scores``: ``cum_logprob / generated_len ** length_penalty``."""

    tokens: list[int]
    logprobs: list[TopLogprobs]
    cum_logprob: float
    num_prompt_tokens: int
    score: float
    finish_reason: str  # "stop": it ended with EOS; "length": at max_tokens
    text: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


@dataclass(slots=True)
class _Beam:
    tokens: list[int]  # generated
    logprobs: list[TopLogprobs]
    cum_logprob: float = 0.0


@dataclass
class BeamSearch:
    """One prompt's search. ``max_tokens``: the generated length cap (the params' unless the context cuts it);
    ``eos_token_ids``: the engine's (ignored with ``ignore_eos``)."""

    prompt_token_ids: list[int]
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    max_tokens: int
    running: list[_Beam] = field(default_factory=lambda: [_Beam([], [])])
    finished: list[tuple[float, _Beam]] = field(default_factory=list)  # (score, beam), best first, <= width
    length: int = 0  # tokens generated by every running beam

    def __post_init__(self) -> None:
        if self.params.ignore_eos:
            self.eos_token_ids = frozenset()

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.eos_token_ids)) * self.params.beam_width

    @property
    def done(self) -> bool:
        return not self.running

    def prompts(self) -> list[list[int]]:
        return [self.prompt_token_ids + beam.tokens for beam in self.running]

    def advance(self, tops: list[TopLogprobs]) -> None:
        """One step: ``tops[i]`` is running beam i's next-token logprobs."""
        width, penalty = self.params.beam_width, self.params.length_penalty
        self.length += 1
        last = self.length >= self.max_tokens
        # HF's topk over (beam, token) in that order: ties go to the earlier beam, then the lower token id
        candidates = sorted(((beam.cum_logprob + lp, i, token) for i, (beam, top) in enumerate(zip(self.running, tops))
                             for token, lp in top.items()), key=lambda c: (-c[0], c[1], c[2]))[:self.num_candidates]
        running: list[_Beam] = []
        for rank, (cum, i, token) in enumerate(candidates):
            ends = last or token in self.eos_token_ids
            if rank >= width if ends else len(running) >= width:  # only the k best may finish; k beams run on
                continue
            parent = self.running[i]
            child = _Beam(parent.tokens + [token], parent.logprobs + [tops[i]], cum)
            if ends:
                self.finished.append((cum / self.length ** penalty, child))
            else:
                running.append(child)
        self.finished.sort(key=lambda f: -f[0])  # stable: an older sequence stays ahead of a new one it ties
        del self.finished[width:]
        self.running = [] if last else running
        if self.running and not self._may_improve():
            self.running = []

    def _may_improve(self) -> bool:
        """HF's stopping rule once ``beam_width`` sequences finished (see the module's docstring)."""
        if len(self.finished) < self.params.beam_width:
            return True
        if self.params.early_stopping is True:
            return False
        penalty = self.params.length_penalty
        length = self.max_tokens if self.params.early_stopping == "never" and penalty > 0 else self.length
        return self.running[0].cum_logprob / length ** penalty > self.finished[-1][0]

    def output(self, decode: Callable[[list[int]], str] | None = None) -> BeamSearchOutput:
        """The finished sequences, best first; ``decode`` (of prompt + generated tokens) fills ``text``."""
        n = len(self.prompt_token_ids)
        sequences = []
        for score, beam in self.finished:
            tokens = self.prompt_token_ids + beam.tokens
            reason = "stop" if beam.tokens[-1] in self.eos_token_ids else "length"
            sequences.append(BeamSearchSequence(tokens, beam.logprobs, beam.cum_logprob, n, score, reason,
                                                decode(tokens) if decode is not None else None))
        return BeamSearchOutput(sequences)

    def request_output(self, request_id: str, prompt: str | None,
                       decode: Callable[[list[int]], str] | None = None) -> RequestOutput:
        """The result as a finished ``RequestOutput``, a choice per sequence, best first (what the server's responses
        render, as vLLM's do): ``text`` the generated tokens' decoding, a final EOS left out."""
        choices = []
        for i, seq in enumerate(self.output().sequences):
            ids = seq.output_token_ids
            shown = ids[:-1] if seq.finish_reason == "stop" else ids
            choices.append(CompletionOutput(i, decode(shown) if decode is not None else "", ids, seq.cum_logprob,
                                            seq.logprobs, seq.finish_reason))
        return RequestOutput(request_id, prompt, self.prompt_token_ids, choices, finished=True)


def step_params(num_logprobs: int) -> SamplingParams:
    """A round's requests: one greedy token (its draw is not used) and the ``num_logprobs`` best raw logprobs."""
    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=num_logprobs, ignore_eos=True)


def beam_search_rounds(searches: list[BeamSearch]) -> Generator[Round, list[TopLogprobs], None]:
    """Drive ``searches`` together: yields each round's prompts (every live beam, search by search) and their
    parameters, and is sent one logprobs entry per prompt, in order."""
    while True:
        live = [s for s in searches if not s.done]
        if not live:
            return
        tops = yield [p for s in live for p in s.prompts()], step_params(max(s.num_candidates for s in live))
        start = 0
        for s in live:
            count = len(s.running)
            s.advance(tops[start:start + count])
            start += count


def run_beam_search(searches: list[BeamSearch], step: Callable[[list[list[int]], SamplingParams],
                                                                list[TopLogprobs]]) -> None:
    """The blocking driver: ``step(prompts, params)`` runs a round and returns each prompt's logprobs entry."""
    rounds = beam_search_rounds(searches)
    try:
        request = next(rounds)
        while True:
            request = rounds.send(step(*request))
    except StopIteration:
        return


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
