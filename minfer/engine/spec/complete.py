"""Completing a speculative step: each sequence's accepted drafts and the token after them enter it one at a time."""
from __future__ import annotations

from typing import TYPE_CHECKING

from minfer.engine.grammar import advance_grammar
from minfer.engine.output_processor import OutputProcessor
from minfer.engine.scheduler import Scheduler
from minfer.engine.spec.speculator import Speculator

if TYPE_CHECKING:
    from minfer.engine.model_runner import LaunchedStep


def complete_speculative(step: "LaunchedStep", outputs: OutputProcessor, scheduler: Scheduler,
                         speculator: Speculator, touched: dict[str, None], stopped: set[str]) -> None:
    """Every token a sequence gained goes through the same stops as a plain step's one (stop ids and strings, EOS,
    length, the grammar's end), and a stop among them drops the rest. Then the accepted drafts' KV counts as
    computed (the target wrote it while verifying them), and the blocks allocated for rejected drafts go back.
    Fills ``touched`` (requests with new tokens) and ``stopped`` (requests a sequence of which finished)."""
    block_manager = scheduler.block_manager
    results = step.sample.result() if step.sample is not None else []
    for seq, (tokens, logprobs) in zip(step.sampled, results):
        drafted, seq.spec_token_ids = len(seq.spec_token_ids), []
        if seq.is_finished:
            continue
        speculator.record(seq.seq_id, drafted, len(tokens))
        stop = None
        for i, token in enumerate(tokens):
            seq.append_pending()
            stop = outputs.accept(seq, seq.fill_pending(token), token, logprobs[i] if logprobs is not None else None)
            if seq.grammar is not None and advance_grammar(seq, token) and stop is None:
                stop = "stop", None  # the grammar ended (its stop token need not be one of the request's)
            if stop is not None:
                break
        if stop is None:
            seq.num_computed_tokens = len(seq.token_ids) - 1
            block_manager.trim(seq, len(seq.token_ids))
            block_manager.cache_full_blocks(seq)
        else:
            scheduler.finish(seq, *stop)
            stopped.add(seq.request_id)
        touched[seq.request_id] = None
    for seq in step.batch.seqs:  # a sequence mid-prompt samples nothing, but every draft is spent
        seq.spec_token_ids = []
