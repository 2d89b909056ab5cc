"""The HBM candidates kept in a heap between evictions (hiradix.core.victim_heap) give exactly the
order a fresh ranking of every candidate gives, under touches, locks, inserts, evictions and a
look-ahead window whose requests come and go (keys that go down are re-keyed)."""

from __future__ import annotations

import random

import pytest

from hiradix.core.lookahead import QueuedKey, plan
from hiradix.core.node import Tier
from hiradix.core.policy import make_policy
from hiradix.core.tree import TieredRadixTree
from hiradix.core.victim_heap import STALE_SLACK
from tests.helpers.core import FakeClock, SlotPool, evict_hbm

PS = 2


def fresh_order(tree: TieredRadixTree) -> list[int]:
    """Node ids of the HBM candidates, ranked from scratch (the order before the kept heap)."""
    key = tree.policy.priority
    return [n.id for n in sorted(tree.candidates(Tier.HBM), key=lambda n: (key(n, Tier.HBM), n.id))]


def walked_order(tree: TieredRadixTree) -> list[int]:
    """Node ids the kept heap yields, nothing detached (every candidate once)."""
    return [n.id for n in tree.victims(Tier.HBM)]


@pytest.mark.parametrize("policy", ["lru", "lookahead"])
@pytest.mark.parametrize("seed", range(6))
def test_the_kept_heap_ranks_like_a_fresh_ranking(policy, seed):
    rng = random.Random(seed)
    clock = FakeClock()
    tree, pool = TieredRadixTree(PS, make_policy(policy), clock=clock), SlotPool(4096)
    prompts: list[list[int]] = []
    locked = []
    for step in range(300):
        op = rng.random()
        if op < 0.35 or not prompts:  # a new turn: a known prefix (or none) + new pages
            base = rng.choice(prompts)[: rng.randrange(0, 12, PS)] if prompts and rng.random() < 0.7 else []
            tokens = base + [rng.randrange(1000) for _ in range(rng.choice([2, 4, 6]))]
            slots = pool.alloc(len(tokens))
            dup, node, _ = tree.insert(tokens, slots)
            pool.release(slots[:dup])
            prompts.append(tokens)
        elif op < 0.55:  # a hit: recency grows
            tree.touch(rng.choice(prompts))
        elif op < 0.65:  # a running request locks its path, later unlocks
            if locked and rng.random() < 0.5:
                tree.dec_lock(locked.pop(rng.randrange(len(locked))))
            else:
                m = tree.match(rng.choice(prompts), split=False, touch=False)
                if m.nodes:
                    tree.inc_lock(m.hbm_node)
                    locked.append(m.hbm_node)
        elif op < 0.8 and tree.policy.uses_queue:  # the window changes: protections come and go
            window = [QueuedKey(p) for p in rng.sample(prompts, min(len(prompts), rng.randrange(0, 5)))]
            tree.policy.observe_queue(plan(tree, window, 8, 0))
        else:  # an eviction takes what the kept heap ranks first
            for slots in evict_hbm(tree, rng.choice([2, 4, 8])):
                pool.release(slots)
        if step % 10 == 0 or op >= 0.8:
            assert walked_order(tree) == fresh_order(tree), step
        tree.check_integrity()
    assert tree._hbm_heap is not None and len(tree._hbm_heap) <= 2 * len(tree.candidates(Tier.HBM)) + STALE_SLACK + 64


def test_a_policy_whose_keys_change_with_age_ranks_afresh_each_time():
    from hiradix.core.predict import PredictivePolicy

    assert PredictivePolicy.keys_grow is False and make_policy("lru").keys_grow
    tree, pool = TieredRadixTree(PS, PredictivePolicy(), clock=FakeClock()), SlotPool(64)
    tree.insert([1, 2, 3, 4], pool.alloc(4))
    assert [n.num_tokens for n in tree.victims(Tier.HBM)] == [4]
    assert tree._hbm_heap is None  # nothing kept
