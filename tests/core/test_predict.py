"""The ``predictive`` policy (hiradix.core.predict), scripted through the real prefix cache.

A virtual clock, one token per page, HBM only unless a test says otherwise: requests are served
as the SGLang seam serves them (match, lock, allocate, checkpoint, unlock), so the policy learns
only through its hooks. Exact expected eviction orders; invariants after every step.
"""

from __future__ import annotations

import itertools

import pytest

from hiradix.core.lookahead import plan
from hiradix.core.node import Tier
from hiradix.core.policy import LRUPolicy, make_policy, policy_names
from hiradix.core.predict import (
    _MIDS,
    _STARTS,
    MIN_CLASS_EVENTS,
    SHARED,
    SIZE_BUCKETS,
    PredictivePolicy,
    ReuseModel,
    age_bucket,
)
from hiradix.core.prefix_cache import TieredPrefixCache
from hiradix.core.tree import TieredRadixTree
from hiradix.testing.sim_ports import SimClock, SimDevicePool


class Cache:
    """An HBM-only prefix cache on a virtual clock (page size 1)."""

    def __init__(self, policy, hbm_tokens: int = 4096):
        self.clock = SimClock()
        self.tree = TieredRadixTree(1, policy, clock=self.clock)
        self.device = SimDevicePool(hbm_tokens, 1)
        self.cache = TieredPrefixCache(self.tree, self.device, None, check_every_step=True)

    def check(self) -> None:
        self.cache.check_integrity(0, used_tokens=self.device.num_used_tokens())

    def serve(self, at_s: float, tokens: list[int]):
        """One request at ``at_s``: match, lock, allocate the rest, insert, finish. Returns its last node."""
        self.clock.advance_to(at_s)
        self.cache.step()
        m = self.cache.match(tokens)
        self.cache.lock(m.hbm_node)
        new = self.cache.alloc_device(len(tokens) - m.hbm_len)
        assert new is not None
        _, last = self.cache.checkpoint(tokens, None, self.cache.path_slots(m.hbm_node) + new, m.hbm_len)
        self.cache.lock(last)
        self.cache.unlock(m.hbm_node)
        self.cache.unlock(last)
        self.check()
        return last

    def order(self, n: int) -> list:
        """The first ``n`` HBM victims in policy order (leaves under the root: nothing detached)."""
        return list(itertools.islice(self.tree.victims(Tier.HBM), n))


def prompt(conv: int, length: int = 4) -> list[int]:
    return [conv * 1000 + i for i in range(length)]


def test_registered_and_selectable():
    assert policy_names() == ["lru", "lookahead", "predictive"]
    policy = make_policy("predictive")
    assert isinstance(policy, PredictivePolicy) and policy.uses_queue and policy.uses_history and policy.reads_ahead
    assert not LRUPolicy.uses_history and not LRUPolicy.reads_ahead


def test_density_is_lhd_hits_over_remaining_lifetime():
    model = ReuseModel(1, update_s=1.0)
    hit_k, evict_k = age_bucket(60.0), age_bucket(1000.0)
    for _ in range(3):
        model.hit(0, 60.0, 4)  # 12 tokens reused at age ~60 s
    model.evict(0, 1000.0, 4)  # 4 tokens left the cache at ~1000 s
    model.update(0.0)
    life = lambda j: 12 * (_MIDS[hit_k] - _STARTS[j]) + 4 * (_MIDS[evict_k] - _STARTS[j])  # noqa: E731
    assert model.density(0, 0.0) == pytest.approx(12 / life(0))
    assert model.density(0, 60.0) == pytest.approx(12 / life(hit_k))
    assert model.density(0, 61.0 * 2) == 0.0  # past every reuse of the class: nothing more to come
    assert model.density(0, 5000.0) == 0.0  # past every event
    # the counts halve every half-life (600 s by default); the tables are recomputed when due
    assert not model.update(0.5)
    assert model.update(600.0) and model.events[0] == pytest.approx(2.0)


def test_predicted_return_order_differs_from_recency_and_the_queue_comes_first():
    # Learning: 40 conversations each come back 60 s after their first turn (a hit at age 60).
    def run(policy):
        c = Cache(policy)
        for k in range(40):
            c.serve(float(k), prompt(k))
            c.serve(k + 60.0, prompt(k) + [k * 1000 + 500, k * 1000 + 501])
        # Three new first turns, served 500 s, 50 s and 10 s before t = 1200 (never returned yet).
        old, mid, new = (c.serve(t, prompt(k)) for t, k in ((700.0, 900), (1150.0, 901), (1190.0, 902)))
        c.serve(1200.0, prompt(903))  # moves the clock; its own node is the newest
        return c, old, mid, new

    lru, old, mid, new = run(LRUPolicy())
    assert [n for n in lru.order(60) if n in (old, mid, new)] == [old, mid, new]  # recency: oldest first

    c, old, mid, new = run(PredictivePolicy(update_s=1.0, by_turn=False, by_size=False))
    d = {name: c.tree.policy.model.density(0, 1200.0 - t) for name, t in (("old", 700.0), ("mid", 1150.0), ("new", 1190.0))}
    assert d["old"] == 0.0 < d["new"] < d["mid"]  # 500 s: past the returns; 50 s: a return is nearest
    assert [n for n in c.order(60) if n in (old, mid, new)] == [old, new, mid]
    # evicting one node at a time (parents join when their children are gone) drops them so
    gone = []
    while mid.alive:
        assert c.cache.evict(1) >= 1
        c.check()
        gone += [n for n in (old, new, mid) if not n.alive and n not in gone]
    assert gone == [old, new, mid]
    c.serve(1200.0, prompt(901))  # mid's conversation again (a first turn once more)
    mid = c.serve(1200.0, prompt(901))
    # a queued request that needs a node protects it above every prediction (lookahead's order)
    spare = c.serve(1201.0, prompt(904))
    view = plan(c.tree, [(prompt(904), None)], window=8, free_dram_pages=0)
    c.tree.policy.observe_queue(view)
    assert [n for n in c.order(60) if n in (mid, spare)] == [mid, spare]


def test_one_shot_first_turns_go_before_returning_conversations():
    # By turn: of 100 first turns, 40 come back 40 s later (turn 1) and again 30 s after that
    # (turn 2); the other 60 never do and are evicted at t = 400 s.
    def run(policy):
        c = Cache(policy, hbm_tokens=8192)
        for k in range(100):
            t = k * 0.5
            c.serve(t, prompt(k))
        for k in range(0, 100, 5):
            for j in (k, k + 1):
                c.serve(j * 0.5 + 40.0, prompt(j) + [j * 1000 + 10])
        for k in range(0, 100, 5):
            for j in (k, k + 1):
                c.serve(j * 0.5 + 70.0, prompt(j) + [j * 1000 + 10, j * 1000 + 11])
        c.clock.advance_to(400.0)
        for node in [n for n in c.tree.iter_nodes() if not n.children and n.num_tokens == 4]:
            c.device.free(c.tree.detach(node, Tier.HBM))  # the 60 one-shot first turns leave
        c.check()
        c.serve(1000.0, prompt(5000))  # conversation X, turn 0 ...
        conv = c.serve(1010.0, prompt(5000) + [5000 * 1000 + 1])  # ... and its turn 1
        first = c.serve(1025.0, prompt(6000))  # a new first turn
        c.serve(1030.0, prompt(7000))  # now: the first turn is 5 s old, the conversation 20 s
        return c, first, conv

    lru, first, conv = run(LRUPolicy())
    assert [n for n in lru.order(200) if n in (first, conv)] == [conv, first]  # recency: older first

    c, first, conv = run(PredictivePolicy(half_life_s=1e6, update_s=1.0, by_turn=True, by_size=False))
    model = c.tree.policy.model
    turn0, turn1 = 0, SIZE_BUCKETS
    assert model.events[turn0] >= MIN_CLASS_EVENTS and model.events[turn1] >= MIN_CLASS_EVENTS
    assert conv.policy_stamp[:2] == (turn1, 1) and first.policy_stamp[:2] == (turn0, 0)
    assert model.density(turn0, 5.0) < model.density(turn1, 20.0)
    assert [n for n in c.order(200) if n in (first, conv)] == [first, conv]


def test_hooks_count_a_request_once_and_a_split_keeps_the_stamp():
    c = Cache(PredictivePolicy(update_s=1.0))
    a = c.serve(10.0, prompt(1, 6))
    assert a.policy_stamp[2] == 10.0 and a.policy_stamp[3] is True  # stamped at insert, ended a turn
    events = sum(c.tree.policy.model.events)
    # the same request inserts a longer key again (its output): not a hit again
    c.cache.checkpoint(prompt(1, 6) + [7], None, c.cache.path_slots(a) + c.cache.alloc_device(1), 6, inserted_len=6)
    assert sum(c.tree.policy.model.events) == events
    # another request diverges inside: the split's upper node inherits the stamp (then both are re-stamped)
    b = c.serve(20.0, prompt(1, 3) + [42])
    upper = b.parent
    assert upper.num_tokens == 3 and upper.policy_stamp[2] == 20.0
    assert sum(c.tree.policy.model.events) == events + 1  # one hit: the shared first 3 tokens
    # the next request through the branch point stamps it SHARED (two children: reused by many)
    c.serve(30.0, prompt(1, 3) + [43])
    assert upper.policy_stamp[0] == SHARED
    # an eviction is counted at the node's age, by class (tree -> observe_delete)
    model = c.tree.policy.model
    c.clock.advance_to(100.0)
    leaf_class, stamp_s = b.policy_stamp[0], b.policy_stamp[2]
    before = model.evictions[leaf_class][age_bucket(100.0 - stamp_s)]
    c.device.free(c.tree.detach(b, Tier.HBM))
    assert not b.alive
    assert model.evictions[leaf_class][age_bucket(100.0 - stamp_s)] == before + b.num_tokens
