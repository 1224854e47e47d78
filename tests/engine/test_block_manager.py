"""Property tests of the block manager: no block is ever handed out twice, ref counts stay exact."""
from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from minfer.engine.block_manager import BlockManager
from minfer.engine.sequence import Sequence
from minfer.sampling_params import SamplingParams

BS = 4


def _seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, str(i), 0, tokens, SamplingParams(), 0, frozenset(), 10_000)


def _check(bm: BlockManager, live: list[Sequence]) -> None:
    refs = Counter(b for s in live for b in s.block_table)
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table), "a sequence holds one block twice"
        assert len(s.block_table) * BS >= s.num_computed_tokens
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0), f"block {block.block_id} ref count drifted"
        assert (block.ref_count == 0) == (block.block_id in bm.free_ids)
    for h, block_id in bm.cached.items():
        assert bm.blocks[block_id].hash == h
    # a block written by two live sequences must hold the same tokens for both (shared prefix)
    owners: dict[int, tuple] = {}
    for s in live:
        for i, b in enumerate(s.block_table[: s.num_computed_tokens // BS]):
            content = tuple(s.token_ids[: (i + 1) * BS])
            assert owners.setdefault(b, content) == content, "two sequences share a block with different contents"


ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "preempt", "fork"]), st.integers(0, 10**6),
                         st.lists(st.integers(0, 2), min_size=1, max_size=14)), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 12), caching=st.booleans())
def test_random_operations_keep_invariants(ops, num_blocks, caching):
    bm = BlockManager(num_blocks, BS, caching)
    live: list[Sequence] = []
    waiting: list[Sequence] = []
    next_id = 0
    for op, pick, tokens in ops:
        if op == "add":  # admit a new sequence (tokens from a tiny alphabet: prefixes collide often)
            seq = _seq(next_id, tokens)
            next_id += 1
            waiting.append(seq)
        if op in ("add", "grow") and waiting:
            seq = waiting.pop(0)
            bm.match_prefix(seq)
            assert seq.num_computed_tokens < seq.num_tokens
            if bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens):
                seq.num_computed_tokens = seq.num_tokens
                bm.cache_full_blocks(seq)
                live.append(seq)
            else:
                bm.free(seq)
                waiting.insert(0, seq)
        elif op == "grow" and live:  # decode: append generated tokens one by one
            seq = live[pick % len(live)]
            for t in tokens[:3]:
                seq.token_ids.append(t)
                shared_before = {b for s in live if s is not seq for b in s.block_table}
                if not bm.allocate_slots(seq, 1):
                    seq.token_ids.pop()
                    break
                for src, dst in bm.pending_copies:  # copy on write: the writer got a private copy
                    assert src in shared_before and dst in seq.block_table and dst not in shared_before
                bm.pending_copies.clear()
                written = seq.block_table[seq.num_computed_tokens // BS]
                assert written not in shared_before, "wrote into a block another sequence still uses"
                seq.num_computed_tokens += 1
                bm.cache_full_blocks(seq)
        elif op == "fork" and live:  # a new sample shares everything its parent computed
            parent = live[pick % len(live)]
            child = _seq(next_id, list(parent.prompt_token_ids))
            next_id += 1
            child.token_ids = list(parent.token_ids)
            bm.fork(parent, child)
            live.append(child)
        elif op in ("free", "preempt") and live:
            seq = live.pop(pick % len(live))
            bm.free(seq)
            if op == "preempt":
                waiting.insert(0, seq)
        _check(bm, live)
    for seq in live:
        bm.free(seq)
    assert bm.num_free_blocks == num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_hit_reuses_blocks_and_lru_evicts_oldest():
    bm = BlockManager(4, BS)
    a = _seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    bm.match_prefix(a)
    assert bm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    b = _seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 42])
    assert bm.match_prefix(b) == 8 and b.block_table == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    bm.free(b)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.cached) == 2
    # blocks that hold nothing reusable go first; then the least recently freed cached block
    c = _seq(2, list(range(100, 108)))
    bm.match_prefix(c)
    assert bm.allocate_slots(c, 8)
    assert len(bm.cached) == 2  # the two never-cached blocks were used
    d = _seq(3, list(range(200, 204)))
    bm.match_prefix(d)
    assert bm.allocate_slots(d, 4)
    assert len(bm.cached) == 1  # one cached block evicted
