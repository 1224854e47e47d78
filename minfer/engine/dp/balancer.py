"""The data-parallel balancer: which replica serves a request.

The rule, per request (``Balancer.route``):

1. Every live replica i has a load ``score(i) = 4·W(i) + R(i) + S·F(i)``: W(i) the sequences sent to it that have not
   produced a token yet (queued or in prefill), R(i) those producing tokens, S its ``max_num_seqs``, and F(i) how far
   its KV-cache usage U(i) (0..1, from its latest stats, at most ``replica.STATS_INTERVAL_S`` old) is into its last
   tenth, ``max(0, U - 0.9) / 0.1`` (``KV_FULL_FROM``): a full cache weighs as a full batch. W and R are counted here,
   as requests leave and their first and last outputs come back, so a burst of requests spreads at once instead of
   waiting for the replicas' next stats. The blocks in use are mostly R's own sequences', already counted; weighed
   below 90% too, the snapshot's staleness herded every request of a burst onto the replica whose last snapshot was
   lower. A waiting sequence weighs four running ones (vLLM's internal balancer's weight): its prefill delays every
   running sequence's next token, and it waits.
2. Prefix affinity: the prompt's leading block-aligned prefixes (1, 2, 3, ... full blocks of ``block_size`` tokens,
   within its first ``MAX_AFFINITY_TOKENS``; the adapter's id is part of the key, as KV computed through an adapter
   differs) are looked up, the longest first, among the prefixes of recently routed prompts (the last
   ``MAX_PREFIXES`` recorded). The longest one found names the replica that served it last, a, which gets the
   request if ``score(a) <= 1.1·m + 4``, m being the least score (``AFFINITY_SLACK`` 10% and ``AFFINITY_MARGIN`` 4,
   one waiting sequence's weight): its prefix cache likely holds those blocks, whose prefill is then saved. Past that
   margin the saving is not worth the imbalance. Only the last replica counts: one that served the prefix before
   may have evicted it since.
3. Otherwise the least loaded replica gets it (ties: the lowest index).
4. The prompt's prefixes of 1, 2, 4, 8, ... blocks and its whole block-aligned prompt are then recorded as served by
   the chosen replica: a shared system prompt is found at a power-of-two depth, and a conversation's next turn (its
   previous prompt, the answer, a new message) at the previous prompt's full length.

A dead replica is never chosen and its prefixes are forgotten. Affinity is a preference, never a promise: a replica
may have evicted the blocks since, and the request is correct anywhere. The decision is host arithmetic on the event
loop, one hash per block looked up (``benchmarks/dp_balancer.py`` measures it).

``MINFER_DP_ROUTING=round-robin`` routes the live replicas in turn instead, load and prefixes unread: the baseline
the rule is measured against (``benchmarks/gpu_dp.sh``'s prefix runs), not a setting to serve with.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Sequence

WAITING_WEIGHT = 4  # a waiting sequence counts as this many running ones
KV_FULL_FROM = 0.9  # KV-cache usage from which a replica's load grows with it, to a full batch at 100%
AFFINITY_MARGIN = 4.0  # the affine replica may be this much above the least loaded one ...
AFFINITY_SLACK = 0.1  # ... plus this share of the least load
MAX_AFFINITY_TOKENS = 2048  # the longest prefix looked up (128 blocks of 16)
MAX_PREFIXES = 65536  # prefix keys remembered (the least recently routed first out)
ROUTING_ENV = "MINFER_DP_ROUTING"
ROUTINGS = ("balanced", "round-robin")


def routing_from_env() -> str:
    """The routing rule ``MINFER_DP_ROUTING`` names (default ``balanced``); ValueError naming the choices."""
    routing = os.environ.get(ROUTING_ENV, "balanced")
    if routing not in ROUTINGS:
        raise ValueError(f"{ROUTING_ENV} must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    return routing


class Balancer:
    """Routing state for ``num_replicas`` replicas; the caller reports what becomes of each request it routed."""

    def __init__(self, num_replicas: int, block_size: int, max_num_seqs: int,
                 margin: float = AFFINITY_MARGIN, slack: float = AFFINITY_SLACK,
                 max_prefixes: int = MAX_PREFIXES, routing: str = "balanced") -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        self.block_size, self.max_num_seqs, self.max_prefixes = block_size, max_num_seqs, max_prefixes
        self.routing, self._turn = routing, 0
        self.margin, self.slack = margin, slack
        self.waiting = [0] * num_replicas  # W(i)
        self.running = [0] * num_replicas  # R(i)
        self.kv_usage = [0.0] * num_replicas  # U(i)
        self.alive = [True] * num_replicas
        self.routed = [0] * num_replicas  # requests ever sent to each (for /stats)
        self.affinity_hits = 0  # requests that went to an affine replica
        self._prefixes: OrderedDict[int, int] = OrderedDict()  # prefix key -> the replica that served it last

    def score(self, i: int) -> float:
        full = max(0.0, self.kv_usage[i] - KV_FULL_FROM) / (1.0 - KV_FULL_FROM)
        return WAITING_WEIGHT * self.waiting[i] + self.running[i] + self.max_num_seqs * full

    def route(self, prompt_token_ids: Sequence[int], n: int = 1, lora_id: int = 0) -> int:
        """The replica for a request of ``n`` samples (counted as waiting there until ``started``)."""
        scores = {i: self.score(i) for i, up in enumerate(self.alive) if up}
        if not scores:
            raise RuntimeError("no data-parallel replica is alive")
        if self.routing == "round-robin":
            choice = next((i for i in scores if i >= self._turn), min(scores))
            self._turn = choice + 1
            self.waiting[choice] += n
            self.routed[choice] += 1
            return choice
        best = min(scores, key=scores.__getitem__)
        keys = self._keys(prompt_token_ids, lora_id)
        choice, prefixes = best, self._prefixes
        for key in reversed(keys):  # the longest prefix first
            affine = prefixes.get(key)
            if affine is not None:
                if affine in scores and scores[affine] <= scores[best] * (1 + self.slack) + self.margin:
                    choice = affine
                    self.affinity_hits += 1
                break
        for k in {*(2 ** j - 1 for j in range(len(keys).bit_length())), len(keys) - 1} if keys else ():
            prefixes.pop(keys[k], None)
            prefixes[keys[k]] = choice  # (re)inserted last: the most recent
        while len(prefixes) > self.max_prefixes:
            prefixes.popitem(last=False)
        self.waiting[choice] += n
        self.routed[choice] += 1
        return choice

    def started(self, i: int, n: int) -> None:
        """The request's first output came back: its sequences run."""
        self.waiting[i] -= n
        self.running[i] += n

    def finished(self, i: int, n: int, started: bool) -> None:
        """The request ended (finished, failed or aborted)."""
        if started:
            self.running[i] -= n
        else:
            self.waiting[i] -= n

    def remove(self, i: int) -> None:
        """Replica ``i`` died: never route to it again and forget what it served."""
        self.alive[i] = False
        self.waiting[i] = self.running[i] = 0
        self.kv_usage[i] = 0.0
        for key in [k for k, replica in self._prefixes.items() if replica == i]:
            del self._prefixes[key]

    def _keys(self, ids: Sequence[int], lora_id: int) -> list[int]:
        """``keys[k]``: the key of the prompt's first k + 1 full blocks, each chaining the one before to its block."""
        bs, key, keys = self.block_size, hash(("prefix", lora_id)), []
        for start in range(0, min(len(ids), MAX_AFFINITY_TOKENS) // bs * bs, bs):
            key = hash((key, tuple(ids[start:start + bs])))
            keys.append(key)
        return keys
