"""BlockManager: owns the paged KV cache's blocks — free list, reference counts, prefix cache — for one
or several KV groups.

A block holds ``block_size`` consecutive tokens of one sequence. With prefix caching, each full
block is keyed by a hash of its tokens chained to the previous block's hash, so equal prefixes
map to equal keys. A block whose last user freed it keeps its key and stays findable until it is
reused ("evicted"); free blocks are reused least-recently-freed first, blocks that hold nothing
reusable before any cached one.

KV groups (the hybrid cache, ``engine/kv_groups.py``): the layers of a model are split into groups that
share one pool of blocks, and each sequence holds one block table per group. A group of sliding-window
layers (``window`` > 0) needs only the blocks its window can still reach: once a sequence's next query is
at position p, the blocks wholly before p - window + 1 go back to the pool and their table entries become
``NO_BLOCK`` (the kernels never read them). So a sequence's memory for those layers is bounded by the
window, not by its length. Each group keeps its own prefix cache (the same tokens hash alike in every
group, but each group's blocks hold its own layers' K/V); a prefix hit must hold, in every group, the blocks
its first computed query will read: the whole prefix for full-attention groups, the last window's blocks
for sliding ones.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minfer.config import cdiv
from minfer.engine.sequence import Sequence

if TYPE_CHECKING:
    from minfer.engine.kv_events import KVEventRecorder

NO_BLOCK = -1  # a sliding group's table entry for a block its window has passed (given back to the pool)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while this block is a prefix cache's entry for `key`
    key: tuple | None = None  # (previous block's hash, this block's tokens): verifies a hit
    group: int = 0  # the KV group whose layers' K/V it holds while in use or cached


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: tuple[int, ...] = (0,)) -> None:
        """``windows``: each KV group's attention window (0: full attention; one group by default)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: list[dict[int, int]] = [{} for _ in self.windows]  # per group: hash -> block id
        self.group_blocks = [0] * len(self.windows)  # blocks each group holds (referenced)
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies for copy on write
        self.kv_events: KVEventRecorder | None = None  # set while block events are published (engine/kv_events.py)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def _first_needed(self, position: int, window: int) -> int:
        """The first block a query at ``position`` reads through a group of ``window`` (0: block 0)."""
        return max(0, position - window + 1) // self.block_size if window else 0

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks that hold a prefix of ``seq``'s tokens; return the tokens reused.

        At least the last token is always left to compute, since its logits are needed. The prefix is
        the longest one every group can serve (see the module docstring)."""
        assert not seq.block_tables and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        self.queried_tokens += seq.num_tokens
        keys: list[tuple[int, tuple]] = []
        prev: int | None = _salt(seq)
        for i in range((seq.num_tokens - 1) // bs):
            key = (prev, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            prev = hash(key)
            keys.append((prev, key))
        hits = [[self._lookup(g, h, key) for h, key in keys] for g in range(len(self.windows))]
        k = len(keys)
        for g, w in enumerate(self.windows):  # full groups: the longest run of hits from the start
            if not w:
                k = next((i for i, b in enumerate(hits[g][:k]) if b is None), k)
        runs = {g: _runs(hits[g][:k]) for g, w in enumerate(self.windows) if w}
        while k and any(k - self._first_needed(k * bs, self.windows[g]) > run[k - 1] for g, run in runs.items()):
            k -= 1  # a sliding group lacks a block its window reads from here: try a shorter prefix
        if not k:
            return 0
        tables = []
        for g, w in enumerate(self.windows):
            first = self._first_needed(k * bs, w)
            for block_id in hits[g][first:k]:
                self._ref(block_id, g)
            tables.append([NO_BLOCK] * first + hits[g][first:k])
        seq.block_tables = tables
        seq.block_hashes = [h for h, _ in keys[:k]]
        seq.num_computed_tokens = k * bs
        self.hit_tokens += seq.num_computed_tokens
        return seq.num_computed_tokens

    def _lookup(self, group: int, h: int, key: tuple) -> int | None:
        block_id = self.cached[group].get(h)
        return block_id if block_id is not None and self.blocks[block_id].key == key else None

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq`` in every group; all or nothing.

        Sliding groups first give back the blocks the step's first query no longer reads. The first block
        written to may be shared after a ``fork``: it is then copied first (copy on write), the copy queued
        in ``pending_copies`` for the model runner."""
        bs, computed = self.block_size, seq.num_computed_tokens  # runs for every sequence every step: kept lean
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.windows]
        tables, blocks = seq.block_tables, self.blocks
        end = (computed + num_new_tokens + bs - 1) // bs
        first = computed // bs
        need = 0
        shared = []
        for g, table in enumerate(tables):
            if self.windows[g]:
                self._release_passed(table, g, self._first_needed(computed, self.windows[g]))
            s = first < len(table) and blocks[table[first]].ref_count > 1
            shared.append(s)
            need += end - len(table) + s
        if need > len(self.free_ids):
            return False
        for g, table in enumerate(tables):
            if shared[g]:  # a new list, not an edit in place: see Sequence.block_tables
                src = table[first]
                self._deref(src)
                dst = self._take_free_block(g)
                tables[g] = table = table[:first] + [dst] + table[first + 1:]
                self.pending_copies.append((src, dst))
            for _ in range(end - len(table)):
                table.append(self._take_free_block(g))
        return True

    def _release_passed(self, table: list[int], group: int, first_needed: int) -> None:
        """Give back a sliding group's blocks before ``first_needed`` (the entries freed earlier form a prefix
        of the table, so the walk stops at the first one)."""
        i = min(first_needed, len(table)) - 1
        while i >= 0 and table[i] != NO_BLOCK:
            self._deref(table[i])
            table[i] = NO_BLOCK  # in place: the runner's copy keeps the old id, which no kernel reads
            i -= 1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share all of ``parent``'s blocks (and computed tokens): n samples of one
        prompt compute it once. A shared block is copied when either side first writes into it."""
        assert not child.block_tables
        for table in parent.block_tables:
            for block_id in table:
                if block_id != NO_BLOCK:
                    self.blocks[block_id].ref_count += 1
        child.block_tables = [list(t) for t in parent.block_tables]
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks of ``seq`` that are now full, computed (or being computed by a launched
        step) and whose token values are known into each group's prefix cache. It runs twice per sequence
        per step, so it reads plain attributes (the known tokens inline, not ``num_known_tokens``)."""
        if not self.enable_prefix_caching:
            return
        bs, hashes, events = self.block_size, seq.block_hashes, self.kv_events
        for i in range(len(hashes), min(seq.num_computed_tokens, len(seq.token_ids) - seq.num_pending) // bs):
            key = (hashes[-1] if hashes else _salt(seq), tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            h = hash(key)
            hashes.append(h)
            for g, table in enumerate(seq.block_tables):
                block_id = table[i]
                if block_id == NO_BLOCK:
                    continue  # a tiny window passed it before its last token was known
                block = self.blocks[block_id]
                if h not in self.cached[g] and block.hash is None:
                    block.hash, block.key = h, key
                    self.cached[g][h] = block_id
                    if events is not None:
                        events.stored(g, h, hashes[i - 1] if i else None, key[1], seq)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past those of the first ``num_tokens`` tokens: a speculative step allocates slots
        for every drafted token, and those of rejected drafts hold nothing (new lists: see Sequence)."""
        keep = cdiv(num_tokens, self.block_size)
        for g, table in enumerate(seq.block_tables):
            if len(table) > keep:
                for block_id in reversed(table[keep:]):
                    self._deref(block_id)
                seq.block_tables[g] = table[:keep]

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references. Its last blocks are queued for reuse first: a shared prefix
        tends to sit at the front of a sequence and is the part most worth keeping."""
        for table in seq.block_tables:
            for block_id in reversed(table):
                if block_id != NO_BLOCK:
                    self._deref(block_id)
        seq.block_tables = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``: after the weights change, or to measure a cold
        cache). Refused (False) while any sequence holds blocks: the hashes of running sequences chain on."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.hash = block.key = None
        for cache in self.cached:
            cache.clear()
        if self.kv_events is not None:
            self.kv_events.cleared()
        return True

    def _deref(self, block_id: int) -> None:
        """Drop one reference; a block nobody holds goes back to the pool: to the end of the queue when a
        prefix cache can still find it, to the front (reused first) when it holds nothing reusable."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed more often than referenced"
        if block.ref_count == 0:
            self.group_blocks[block.group] -= 1
            self.free_ids[block_id] = None
            if block.hash is None:
                self.free_ids.move_to_end(block_id, last=False)

    def _ref(self, block_id: int, group: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_ids[block_id]
            self.group_blocks[group] += 1
        block.ref_count += 1

    def _take_free_block(self, group: int) -> int:
        block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evicted: its tokens are no longer a prefix hit
            if self.kv_events is not None:
                self.kv_events.removed(block.group, block.hash)
            del self.cached[block.group][block.hash]
            block.hash = block.key = None
        block.ref_count, block.group = 1, group
        self.group_blocks[group] += 1
        return block_id


def blocks_needed(num_tokens: int, block_size: int, windows: tuple[int, ...], chunk: int) -> int:
    """Blocks one sequence of ``num_tokens`` tokens holds at most, over every group, when its prompt comes
    in chunks of up to ``chunk`` tokens: a sliding group holds the window behind a chunk and the chunk."""
    full = cdiv(num_tokens, block_size)
    return sum(full if not w else min(full, cdiv(w - 1 + chunk, block_size) + 1) for w in windows)


def _runs(hits: list[int | None]) -> list[int]:
    """``runs[i]``: how many consecutive hits end at index i (0 where ``hits[i]`` is a miss)."""
    runs, n = [], 0
    for b in hits:
        n = n + 1 if b is not None else 0
        runs.append(n)
    return runs


def _salt(seq: Sequence) -> int | None:
    """What a sequence's first block chains from: its LoRA adapter (the same tokens through another adapter make
    other K/V), None for the base model."""
    return -seq.lora_id if seq.lora_id else None
