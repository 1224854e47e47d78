"""The data-parallel balancer's rule (``minfer/engine/dp/balancer.py``), decision by decision, without processes."""
from __future__ import annotations

from minfer.engine.dp.balancer import Balancer

BS = 16


def _prompt(head: int, length: int = 8 * BS, tail: int = 0) -> list[int]:
    """``length`` token ids: a prefix that ``head`` decides, then (from the fourth block on) ones that ``tail`` does."""
    ids = [(head * 7 + k) % 300 for k in range(length)]
    return ids[:3 * BS] + [(tail * 13 + k) % 300 for k in range(length - 3 * BS)] if tail else ids


def test_the_least_loaded_replica_takes_a_request_and_a_waiting_one_counts_four() -> None:
    b = Balancer(3, BS, max_num_seqs=64)
    assert [b.route(_prompt(h)) for h in range(3)] == [0, 1, 2]  # distinct prompts spread over idle replicas
    b.started(0, 1)  # replica 0 runs its request: 1 against the others' waiting 4
    assert b.route(_prompt(10)) == 0
    b.finished(1, 1, started=False)  # replica 1's request ends before its first token: it is idle again
    assert b.route(_prompt(11)) == 1
    b.kv_usage[2] = 0.85  # below 90% the cache's usage weighs nothing (its sequences are counted already) ...
    b.finished(2, 1, started=False)
    assert b.score(2) == 0
    b.kv_usage[2] = 0.95  # ... then grows to a full batch at 100%: half of 64 here
    assert abs(b.score(2) - 32) < 1e-9 and b.route(_prompt(12)) == 1  # 1: waiting 4 < 0: running 1 + 4 < 2: 32


def test_a_prompt_sharing_a_prefix_goes_where_its_prefix_went_within_the_margin() -> None:
    b = Balancer(2, BS, max_num_seqs=64)
    b.waiting[0] = 1  # replica 0 is busy: the first prompt of a family goes to 1
    assert b.route(_prompt(1, tail=1)) == 1
    b.finished(1, 1, started=False)
    b.waiting[0] = 0
    # both idle: without affinity the tie would go to replica 0; the shared blocks send the first to 1, and the
    # second too, 1 being then 4 (one waiting) above 0: within 1.1 x 0 + 4
    assert [b.route(_prompt(1, tail=t)) for t in range(2, 4)] == [1, 1]
    assert b.affinity_hits == 2
    assert b.route(_prompt(1, tail=4)) == 0  # 1 has 8 against 0's 0: past the margin, the least loaded after all
    assert b.route(_prompt(2)) == 0  # an unrelated prompt: plain least load (0 has 4, 1 has 8)


def test_the_longest_shared_prefix_wins_and_an_adapter_is_part_of_the_key() -> None:
    b = Balancer(3, BS, max_num_seqs=64)
    system = _prompt(5, length=2 * BS)
    first_turn = system + _prompt(6, length=3 * BS)
    assert b.route(system + _prompt(7, length=BS)) == 0
    b.waiting[0] += 1  # keep 0 loaded so that the conversation starts elsewhere
    assert b.route(first_turn) == 1
    for i in range(3):
        b.waiting[i] = 0
    next_turn = first_turn + _prompt(8, length=2 * BS)  # its previous prompt, whole, is a recorded prefix
    assert b.route(next_turn) == 1  # the conversation's replica, not the system prompt's (0)
    assert b.route(next_turn, lora_id=3) == 0  # through an adapter nothing is cached yet: least load (0 ties 2)


def test_a_dead_replica_is_never_chosen_and_its_prefixes_are_forgotten() -> None:
    b = Balancer(2, BS, max_num_seqs=64)
    prompt = _prompt(9)
    assert b.route(prompt) == 0
    b.remove(0)
    assert b.route(prompt) == 1 and b.route(_prompt(3)) == 1
    b.remove(1)
    try:
        b.route(prompt)
    except RuntimeError as exc:
        assert "no data-parallel replica is alive" in str(exc)
    else:
        raise AssertionError("routed to a dead replica")


def test_short_prompts_have_no_prefix_and_the_memory_is_bounded() -> None:
    b = Balancer(2, BS, max_num_seqs=64, max_prefixes=8)
    assert b.route(list(range(BS - 1))) == 0 and b.route(list(range(BS - 1))) == 1  # no full block: no affinity
    for h in range(20):
        b.route(_prompt(100 + h))
    assert len(b._prefixes) <= 8


def test_round_robin_takes_the_live_replicas_in_turn_whatever_their_load_and_prefixes(monkeypatch) -> None:
    """The baseline the rule is measured against: replicas in turn, a dead one skipped, no affinity, load unread;
    ``MINFER_DP_ROUTING`` chooses it and a wrong value is refused naming the choices."""
    import pytest

    from minfer.engine.dp.balancer import routing_from_env

    b = Balancer(3, BS, max_num_seqs=64, routing="round-robin")
    b.waiting[1] = 50
    assert [b.route(_prompt(1, tail=t)) for t in range(5)] == [0, 1, 2, 0, 1]
    b.remove(2)
    assert [b.route(_prompt(1)) for _ in range(3)] == [0, 1, 0] and b.affinity_hits == 0
    assert b.routed == [4, 3, 1]
    with pytest.raises(ValueError, match="routing must be one of balanced, round-robin"):
        Balancer(2, BS, 64, routing="random")
    assert routing_from_env() == "balanced"
    monkeypatch.setenv("MINFER_DP_ROUTING", "round-robin")
    assert routing_from_env() == "round-robin"
    monkeypatch.setenv("MINFER_DP_ROUTING", "rr")
    with pytest.raises(ValueError, match="MINFER_DP_ROUTING must be one of balanced, round-robin, got 'rr'"):
        routing_from_env()


def test_a_prefix_follows_the_replica_that_served_it_last() -> None:
    """A prefix pushed past the margin onto another replica belongs to that one from then on (the first may have
    evicted it since), not to whichever of the two is less loaded."""
    b = Balancer(2, BS, max_num_seqs=64)
    assert b.route(_prompt(5, tail=1)) == 0
    b.waiting[0] = 10  # replica 0 is past the margin: the family's next prompt goes to 1
    assert b.route(_prompt(5, tail=2)) == 1
    b.waiting[0], b.waiting[1] = 0, 1  # 0 is idle again, 1 within the margin: the family stays on 1
    assert b.route(_prompt(5, tail=3)) == 1 and b.affinity_hits == 1
    b.remove(1)  # its prefixes are forgotten: the family starts over on the least loaded
    assert b.route(_prompt(5, tail=4)) == 0 and b.affinity_hits == 1
