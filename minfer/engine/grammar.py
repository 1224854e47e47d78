"""Structured outputs in the engine: grammars compiled off the step loop, one matcher per sample, and
each step's token bitmask.

The flow of one constrained request:

1. ``GrammarCompiler.submit`` hands its ``StructuredOutputsParams`` to a compiler process (xgrammar's compile
   precomputes, for every grammar state, which of the vocabulary's tokens fit: tens of milliseconds
   to minutes for a large schema and a 128k vocabulary), bounded in time and cancelled when its last
   waiting request is aborted. Equal constraints share one compile (``key``). The engine keeps the request
   out of the scheduler until the compile is done, so it never blocks the requests behind it.
2. Each sample gets its own ``xgrammar.GrammarMatcher`` (``Sequence.grammar``).
3. A step that samples a constrained row launches its forward first; while the GPU runs it the host
   completes the previous step (so every matcher has accepted every known token), fills the rows'
   bitmasks (``BitmaskFiller.fill``, on xgrammar's threads), and only then queues the sampling, which masks
   the logits (``sampler.apply_token_bitmask``) before anything else draws from them.
4. Each sampled token advances its sample's matcher (``advance``); a matcher that accepts a stop token
   terminates, which finishes the sample with reason "stop".

A matcher accepts exactly the tokens that end up in its sequence's ``token_ids``: tokens are accepted when
a step completes, and a token dropped in flight (its sequence stopped a step earlier) is never accepted,
so preemption (recompute keeps the tokens) and async scheduling need no rollback. The one rollback: a
speculative step's masks walk the matcher through the drafted tokens and back (``BitmaskFiller._fill_drafted``).
"""
from __future__ import annotations

import bisect
import copy
import logging
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any

import torch

from minfer.config import cdiv
from minfer.engine.grammar_worker import CompilerPool, GrammarCompileError  # noqa: F401 - the engine's error
from minfer.engine.sequence import Sequence
from minfer.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("minfer")

COMPILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CACHE_SIZE = 256  # compiled grammars kept (least recently used goes first)


class GrammarCompiler:
    """Compiles constraints in child processes (``grammar_worker.CompilerPool``) and caches the results by key.

    A compile is bounded (``timeout`` seconds from the moment a child takes it: past it the child is killed
    and the request fails naming the limit), cancellable (``cancel``: a running compile's child is killed),
    and cannot take the engine down: a child that crashes (xgrammar's recursion on a hostile schema) fails
    the compile it ran and is replaced. Children start lazily (none until the first constrained request);
    while every child is busy on a compile that has run past ``SLOW_AFTER``, a spare starts (up to
    ``MAX_PROCESSES``), so a cheap compile never waits behind expensive ones for longer than a child's start-up.

    The tokenizer's xgrammar view (``TokenizerInfo``, a pass over the vocabulary) is built in this process,
    on the first constrained request, and sent to each child as JSON; the children's compiled grammars come
    back as JSON and are read back on a thread (xgrammar releases the GIL there), so the engine's loop only
    polls futures. The tokenizer is a copy: a Rust ``tokenizers`` object used from two threads at once (the
    engine's detokenizing) can fail with 'Already borrowed'."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: frozenset[int], timeout: float = 30.0) -> None:
        self.vocab_size = vocab_size
        tokenizer, stop = copy.deepcopy(tokenizer), sorted(stop_token_ids)

        def tokenizer_info() -> Any:
            import xgrammar

            return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                           stop_token_ids=stop or None)

        self._histogram = _Histogram()
        self._pool = CompilerPool(tokenizer_info, self._histogram.record, timeout)
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        # the pool's thread does not hold this object: dropping the compiler (or the interpreter's exit) stops it
        self._finalizer = weakref.finalize(self, self._pool.stop)

    @property
    def timeout(self) -> float:
        """Seconds a compile may run in its child; read when a child takes a compile."""
        return self._pool.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._pool.timeout = seconds

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of ``params``, as a future (an already compiled key returns its own)."""
        key = params.key
        future = self._cache.get(key)
        if future is not None and not (future.done() and (future.cancelled() or future.exception() is not None)):
            self._cache.move_to_end(key)
            return future
        future = self._cache[key] = self._pool.submit(key)
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def cancel(self, future: Future) -> bool:
        """Give up a compile nobody waits for: dropped from the queue, or its child killed. False when it had
        already finished."""
        return self._pool.cancel(future)

    def running(self) -> list[int]:
        """The processes running a compile now (a cancelled one no longer counts)."""
        return self._pool.running()

    def process_ids(self) -> list[int]:
        """The compiler processes alive now."""
        return self._pool.process_ids()

    def stats(self) -> dict[str, Any]:
        """The compile-time histogram (``compile_histogram``)."""
        return self._histogram.snapshot()

    def shutdown(self) -> None:
        """Kill the children and stop the thread; compiles still pending are cancelled. Idempotent."""
        self._finalizer()


class _Histogram:
    """Compile times (seconds measured in the child, compiling only), written from the pool's thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts = [0] * (len(COMPILE_BUCKETS) + 1)
        self.seconds = 0.0

    def record(self, seconds: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(COMPILE_BUCKETS, seconds)] += 1
            self.seconds += seconds

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return compile_histogram(list(self.counts), self.seconds)


def compile_histogram(counts: list[int] | None = None, total: float = 0.0) -> dict[str, Any]:
    """Compile times as Prometheus reads a histogram: cumulative counts per upper bound (the last is
    +inf), their sum and count (compiles only: a cached grammar costs none)."""
    cumulative, running = [], 0
    for bound, n in zip((*COMPILE_BUCKETS, float("inf")), counts or [0] * (len(COMPILE_BUCKETS) + 1)):
        running += n
        cumulative.append((bound, running))
    return {"buckets": cumulative, "sum": total, "count": running}


def new_matcher(compiled: Any) -> Any:
    import xgrammar

    return xgrammar.GrammarMatcher(compiled)


class BitmaskFiller:
    """Fills the token bitmask of a step's sampling rows: a constrained row allows what its matcher
    allows, every other row (unconstrained, or finished while the step was in flight) allows all.

    The host buffer is pinned (the upload must not wait for the forward the fill hides under), and it and
    the device buffer it uploads into are allocated once. Before the host buffer is refilled, the previous
    step's upload must have left it (an event; in practice long done: the previous step's draws, queued
    after that upload, have been read). The device buffer needs no wait: the next upload is queued on the
    same stream behind the previous step's sampling, the only reader of the mask."""

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        import xgrammar

        self.device = device
        cuda = device.type == "cuda"
        shape = (max_rows, cdiv(vocab_size, 32))
        self._host = torch.empty(shape, dtype=torch.int32, pin_memory=cuda)
        self._device = torch.empty(shape, dtype=torch.int32, device=device) if cuda else None
        self._uploaded = torch.cuda.Event() if cuda else None
        self._batch = xgrammar.BatchGrammarMatcher()

    def fill(self, seqs: list[Sequence], speculative: bool = False) -> torch.Tensor:
        """[rows, ceil(vocab / 32)] int32 on the device (bit j of word w: token 32 w + j allowed), a row per sequence;
        ``speculative``: 1 + k rows per sequence of k drafted tokens, row j allowing what its grammar allows after
        the first j drafts (``_fill_drafted``)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        if speculative:
            bitmask = self._fill_drafted(seqs)
        else:
            bitmask = self._host[:len(seqs)]
            rows = [i for i, s in enumerate(seqs) if _constrained(s)]
            if len(rows) == len(seqs):  # every row constrained: xgrammar writes them all
                self._batch.batch_fill_next_token_bitmask([s.grammar for s in seqs], bitmask)
            else:
                # numpy, not torch: a torch fill of this size runs on the intra-op thread pool, whose threads
                # then spin beside xgrammar's and slow its fill many times over (RESULTS.md, structured outputs)
                bitmask.numpy()[:] = -1
                if rows:
                    self._batch.batch_fill_next_token_bitmask([seqs[i].grammar for i in rows], bitmask, rows)
        if self._uploaded is None:
            return bitmask.clone()  # the CPU: the buffer is reused, the mask must not change under the sampler
        on_device = self._device[:len(bitmask)]
        on_device.copy_(bitmask, non_blocking=True)
        self._uploaded.record()
        return on_device

    def _fill_drafted(self, seqs: list[Sequence]) -> torch.Tensor:
        """A speculative step's rows: each constrained sequence's matcher takes its drafts one by one, a row filled
        before each and after the last, then rolls back (the matcher takes the accepted tokens when the step
        completes). A draft the grammar refuses ends the walk: the rows after it are never read, since the
        verifier rejects that draft (its row's mask refuses it)."""
        bitmask = self._host[:sum(len(s.spec_token_ids) + 1 for s in seqs)]
        bitmask.numpy()[:] = -1
        row = 0
        for seq in seqs:
            if _constrained(seq):
                matcher, taken = seq.grammar, 0
                for token in seq.spec_token_ids:
                    if matcher.is_terminated():
                        break  # a drafted stop token ended it: the sequence stops there
                    matcher.fill_next_token_bitmask(bitmask, row + taken)
                    if not matcher.accept_token(token):
                        break
                    taken += 1
                else:
                    if not matcher.is_terminated():
                        matcher.fill_next_token_bitmask(bitmask, row + taken)
                if taken:
                    matcher.rollback(taken)
            row += len(seq.spec_token_ids) + 1
        return bitmask


def _constrained(seq: Sequence) -> bool:
    """Whether ``seq``'s next token is masked: it has a live grammar and has passed its gate."""
    return (seq.grammar is not None and seq.grammar_after is None and not seq.is_finished
            and not seq.grammar.is_terminated())


def advance_grammar(seq: Sequence, token: int) -> bool:
    """A completed token into a constrained sample: while it still reasons (``grammar_after``), only the count of
    its end marker's tokens matched so far moves (a marker's first token starts no other); after, its matcher.
    True when the grammar has ended."""
    if seq.grammar_after is not None:
        gate, n = seq.grammar_after, seq.gate_matched
        n = n + 1 if token == gate[n] else int(token == gate[0])
        seq.grammar_after, seq.gate_matched = (None, 0) if n == len(gate) else (gate, n)
        return False
    return advance(seq, token)


def advance(seq: Sequence, token: int) -> bool:
    """Feed a sampled token to the sample's matcher; True when the grammar has ended (a stop token)."""
    matcher = seq.grammar
    if not matcher.accept_token(token):  # the mask made this impossible: a bug, but not the caller's
        logger.error("sequence %d: token %d does not fit its grammar; ending it", seq.seq_id, token)
        return True
    return matcher.is_terminated()

