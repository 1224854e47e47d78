"""Property tests of the block manager: no block is ever handed out twice, ref counts stay exact, with one
KV group or several (sliding-window groups give back the blocks their window has passed)."""
from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

import pytest

from minfer.engine.block_manager import NO_BLOCK, BlockManager
from minfer.engine.sequence import Sequence
from minfer.sampling_params import SamplingParams

BS = 4


def _seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, str(i), 0, tokens, SamplingParams(), 0, frozenset(), 10_000)


def _held(s: Sequence) -> list[tuple[int, int, int]]:
    """(group, index, block) of every block ``s`` holds."""
    return [(g, i, b) for g, t in enumerate(s.block_tables) for i, b in enumerate(t) if b != NO_BLOCK]


def _check(bm: BlockManager, live: list[Sequence]) -> None:
    refs = Counter(b for s in live for _, _, b in _held(s))
    for s in live:
        held = [b for _, _, b in _held(s)]
        assert len(set(held)) == len(held), "a sequence holds one block twice"
        for g, (table, w) in enumerate(zip(s.block_tables, bm.windows)):
            assert len(table) * BS >= s.num_computed_tokens
            first = max(0, s.num_computed_tokens - w + 1) // BS if w else 0  # what the next query reads
            assert NO_BLOCK not in table[first:], f"group {g} lost a block its window still reads"
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0), f"block {block.block_id} ref count drifted"
        assert (block.ref_count == 0) == (block.block_id in bm.free_ids)
    for g, cached in enumerate(bm.cached):
        for h, block_id in cached.items():
            assert bm.blocks[block_id].hash == h and bm.blocks[block_id].group == g
    in_use = Counter(bm.blocks[b].group for b in refs)
    assert bm.group_blocks == [in_use.get(g, 0) for g in range(len(bm.windows))]
    # a block written by two live sequences must hold the same tokens (and group) for both (shared prefix)
    owners: dict[int, tuple] = {}
    for s in live:
        for g, i, b in _held(s):
            if i < s.num_computed_tokens // BS:
                content = (g, tuple(s.token_ids[: (i + 1) * BS]))
                assert owners.setdefault(b, content) == content, "two sequences share a block with different contents"


ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "preempt", "fork"]), st.integers(0, 10**6),
                         st.lists(st.integers(0, 2), min_size=1, max_size=14)), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 12), caching=st.booleans(),
       windows=st.sampled_from([(0,), (6,), (0, 5), (0, 9, 3)]))
def test_random_operations_keep_invariants(ops, num_blocks, caching, windows):
    bm = BlockManager(num_blocks, BS, caching, windows)
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
                shared_before = {b for s in live if s is not seq for _, _, b in _held(s)}
                if not bm.allocate_slots(seq, 1):
                    seq.token_ids.pop()
                    break
                mine = {b for _, _, b in _held(seq)}
                for src, dst in bm.pending_copies:  # copy on write: the writer got a private copy
                    assert src in shared_before and dst in mine and dst not in shared_before
                bm.pending_copies.clear()
                for table in seq.block_tables:
                    written = table[seq.num_computed_tokens // BS]
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
    assert bm.match_prefix(b) == 8 and b.block_tables == [a.block_tables[0][:2]]
    assert bm.blocks[a.block_tables[0][0]].ref_count == 2
    bm.free(b)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.cached[0]) == 2
    # blocks that hold nothing reusable go first; then the least recently freed cached block
    c = _seq(2, list(range(100, 108)))
    bm.match_prefix(c)
    assert bm.allocate_slots(c, 8)
    assert len(bm.cached[0]) == 2  # the two never-cached blocks were used
    d = _seq(3, list(range(200, 204)))
    bm.match_prefix(d)
    assert bm.allocate_slots(d, 4)
    assert len(bm.cached[0]) == 1  # one cached block evicted


def _run(bm: BlockManager, seq: Sequence, chunk: int) -> None:
    """Compute ``seq``'s tokens in chunks (a decode is a chunk of one), publishing full blocks as the
    scheduler does."""
    while seq.num_computed_tokens < seq.num_tokens:
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        assert bm.allocate_slots(seq, n)
        seq.num_computed_tokens += n
        bm.cache_full_blocks(seq)


@pytest.mark.parametrize("window", [5, 9, 16])
def test_sliding_group_holds_only_its_window(window):
    """A full and a sliding group over one pool: after 200 tokens the full group holds every block, the
    sliding one only those its next query reads (the window's, plus the one it writes), counted."""
    bm = BlockManager(200, BS, True, (0, window))
    seq = _seq(0, list(range(3, 203)))
    _run(bm, seq, 7)
    assert bm.allocate_slots(seq, 1)  # the next decode's room: the passed blocks go back first
    full, sliding = seq.block_tables
    assert NO_BLOCK not in full and len(full) == 51
    held = [b for b in sliding if b != NO_BLOCK]
    first = max(0, 200 - window + 1) // BS
    assert sliding[:first] == [NO_BLOCK] * first and len(held) == 51 - first
    assert bm.group_blocks == [51, len(held)]
    assert bm.num_free_blocks == 200 - 51 - len(held)
    bm.free(seq)
    assert bm.num_free_blocks == 200 and bm.group_blocks == [0, 0]


def test_prefix_hit_needs_the_window_blocks_of_every_group():
    """A hit over a sliding group must find the blocks the window reads; the ones before it need not be
    cached. When the window's blocks were evicted, the hit falls back to a shorter prefix that has them."""
    window = 6
    bm = BlockManager(64, BS, True, (0, window))
    tokens = list(range(3, 43))  # 40 tokens, 10 blocks
    a = _seq(0, tokens)
    _run(bm, a, 40)
    assert bm.allocate_slots(a, 1)  # gives back the sliding blocks the window passed
    bm.free(a)
    b = _seq(1, tokens + [99])
    assert bm.match_prefix(b) == 40
    first = (40 - window + 1) // BS
    assert b.block_tables[1][:first] == [NO_BLOCK] * first and NO_BLOCK not in b.block_tables[1][first:]
    bm.free(b)
    # evict the sliding group's last cached block: the hit must end where the window still finds its blocks
    last = bm.cached[1][b_hash(tokens, 10)]
    del bm.cached[1][bm.blocks[last].hash]
    bm.blocks[last].hash = bm.blocks[last].key = None
    c = _seq(2, tokens + [99])
    hit = bm.match_prefix(c)
    assert hit < 40 and hit % BS == 0
    needed = max(0, hit - window + 1) // BS
    assert all(x != NO_BLOCK for x in c.block_tables[1][needed:hit // BS])
    bm.free(c)
    assert bm.num_free_blocks == 64


def b_hash(tokens: list[int], blocks: int) -> int:
    """The prefix cache's key of the first ``blocks`` full blocks of ``tokens``."""
    h = None
    for i in range(blocks):
        h = hash((h, tuple(tokens[i * BS:(i + 1) * BS])))
    return h
