"""BlockManager: owns the paged KV cache's blocks — free list, reference counts, prefix cache.

A block holds ``block_size`` consecutive tokens of one sequence. With prefix caching, each full
block is keyed by a hash of its tokens chained to the previous block's hash, so equal prefixes
map to equal keys. A block whose last user freed it keeps its key and stays findable until it is
reused ("evicted"); free blocks are reused least-recently-freed first, blocks that hold nothing
reusable before any cached one.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from minfer.config import cdiv
from minfer.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set while this block is the prefix cache's entry for `key`
    key: tuple | None = None  # (previous block's hash, this block's tokens): verifies a hit


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.hit_tokens = 0
        self.queried_tokens = 0
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) block copies for copy on write

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached blocks that hold a prefix of ``seq``'s tokens; return the tokens reused.

        At least the last token is always left to compute, since its logits are needed.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        self.queried_tokens += seq.num_tokens
        prev: int | None = None
        for i in range((seq.num_tokens - 1) // bs):
            key = (prev, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            h = hash(key)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].key != key:
                break
            self._ref(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            prev = h
        seq.num_computed_tokens = len(seq.block_table) * bs
        self.hit_tokens += seq.num_computed_tokens
        return seq.num_computed_tokens

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq``; all or nothing.

        The first block written to may be shared after a ``fork``: it is then copied first
        (copy on write), the copy queued in ``pending_copies`` for the model runner.
        """
        bs, table = self.block_size, seq.block_table  # runs for every sequence every step: kept lean
        first = seq.num_computed_tokens // bs
        shared = first < len(table) and self.blocks[table[first]].ref_count > 1
        need = (seq.num_computed_tokens + num_new_tokens + bs - 1) // bs - len(table) + shared
        if need > len(self.free_ids):
            return False
        if shared:  # a new list, not an edit in place: see Sequence.block_table
            src = seq.block_table[first]
            self.blocks[src].ref_count -= 1
            dst = self._take_free_block()
            seq.block_table = seq.block_table[:first] + [dst] + seq.block_table[first + 1:]
            self.pending_copies.append((src, dst))
        for _ in range(need - shared):
            seq.block_table.append(self._take_free_block())
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share all of ``parent``'s blocks (and computed tokens): n samples of one
        prompt compute it once. A shared block is copied when either side first writes into it."""
        assert not child.block_table
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the blocks of ``seq`` that are now full, computed (or being computed by a launched
        step) and whose token values are known into the prefix cache. It runs twice per sequence per
        step, so it reads plain attributes (the known tokens inline, not ``num_known_tokens``)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), min(seq.num_computed_tokens, len(seq.token_ids) - seq.num_pending) // bs):
            prev = seq.block_hashes[-1] if seq.block_hashes else None
            key = (prev, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            h = hash(key)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if h not in self.cached and block.hash is None:
                block.hash, block.key = h, key
                self.cached[h] = block.block_id

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references. Its last blocks are queued for reuse first: a shared prefix
        tends to sit at the front of a sequence and is the part most worth keeping."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed more often than referenced"
            if block.ref_count == 0:
                self.free_ids[block_id] = None
                if block.hash is None:
                    self.free_ids.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_ids[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> int:
        block_id, _ = self.free_ids.popitem(last=False)
        block = self.blocks[block_id]
        self._uncache(block)
        block.ref_count = 1
        return block_id

    def _uncache(self, block: Block) -> None:
        if block.hash is not None:
            del self.cached[block.hash]
            block.hash = block.key = None
