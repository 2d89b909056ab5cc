"""Scripted scenarios for the tiered radix tree (HBM only); integrity checked after every step."""

from __future__ import annotations

import pytest

from hiradix.core.node import IntegrityError, Tier
from hiradix.core.tree import TieredRadixTree
from tests.helpers.core import FakeClock, SlotPool, evict_hbm


def make_tree(page_size: int = 1) -> TieredRadixTree:
    return TieredRadixTree(page_size, clock=FakeClock())


def check(tree: TieredRadixTree, pool: SlotPool | None = None) -> None:
    tree.check_integrity()
    if pool is not None:
        held = sum(len(s) for s in tree.all_hbm_slots())
        # per tier: free + used == capacity (no request holds slots in these scenarios)
        assert len(pool.free) + held == pool.capacity
        assert held == tree.hbm_evictable_tokens + tree.hbm_protected_tokens


def peek_hbm_len(tree: TieredRadixTree, tokens, namespace=None) -> int:
    """HBM hit length without touching recency or splitting."""
    return tree.match(tokens, namespace, split=False, touch=False).hbm_len


def insert(tree: TieredRadixTree, pool: SlotPool, tokens, namespace=None):
    """Insert like SGLang's checkpoint: allocate slots, give duplicates back."""
    slots = pool.alloc(len(tokens) - len(tokens) % tree.page_size)
    dup_len, node, _ = tree.insert(tokens, slots, namespace)
    pool.release(slots[:dup_len])
    return dup_len, node


def test_insert_match_split_scenario():
    tree, pool = make_tree(), SlotPool(64)
    # insert [1,2,3] -> one node
    assert insert(tree, pool, [1, 2, 3])[0] == 0
    check(tree, pool)
    # same again -> all three are duplicates
    assert insert(tree, pool, [1, 2, 3])[0] == 3
    check(tree, pool)
    # [1,2,4,5] -> splits [1,2,3] into [1,2] + [3], adds [4,5]
    dup_len, node = insert(tree, pool, [1, 2, 4, 5])
    assert dup_len == 2 and list(node.tokens) == [4, 5]
    check(tree, pool)
    assert sorted(len(n.tokens) for n in tree.iter_nodes()) == [1, 2, 2]
    # match [1,2,3,9] -> 3 tokens in HBM, ends on node [3]
    m = tree.match([1, 2, 3, 9])
    assert (m.hbm_len, list(m.hbm_node.tokens), m.dram_len, m.nvme_len) == (3, [3], 0, 0)
    check(tree, pool)
    # match ending inside [4,5] splits it
    m = tree.match([1, 2, 4])
    assert m.hbm_len == 3 and list(m.hbm_node.tokens) == [4]
    check(tree, pool)
    # path slots are the first insert's slots for [1,2] then the split node's
    slots = [s for part in tree.path_hbm_slots(m.hbm_node) for s in part]
    assert len(slots) == 3 and len(set(slots)) == 3
    # unrelated key -> miss at root
    assert tree.match([7, 7]).hbm_len == 0


def test_peek_does_not_modify_tree():
    tree, pool = make_tree(), SlotPool(16)
    insert(tree, pool, [1, 2, 3, 4])
    before = [(n.id, len(n.tokens), n.last_access_s) for n in tree.iter_nodes()]
    m = tree.match([1, 2, 9], split=False, touch=False)
    assert m.hbm_len == 2 and m.last_node.num_tokens == 4
    assert [(n.id, len(n.tokens), n.last_access_s) for n in tree.iter_nodes()] == before
    check(tree, pool)


def test_page_granularity():
    tree, pool = make_tree(page_size=4), SlotPool(64)
    # 10 tokens -> 8 inserted (two pages)
    dup_len, node = insert(tree, pool, list(range(10)))
    assert dup_len == 0 and node.num_tokens == 8
    check(tree, pool)
    # differs inside the second page -> match stops at the page boundary, split at 4
    m = tree.match([0, 1, 2, 3, 4, 5, 99, 7])
    assert m.hbm_len == 4
    check(tree, pool)
    assert sorted(n.num_tokens for n in tree.iter_nodes()) == [4, 4]
    # differs in the first page -> no match at all
    assert tree.match([0, 1, 2, 98, 4, 5, 6, 7]).hbm_len == 0
    # keys shorter than a page never match or insert
    assert tree.match([0, 1, 2]).hbm_len == 0
    assert insert(tree, pool, [0, 1, 2])[0] == 0
    check(tree, pool)


def test_namespaces_are_disjoint():
    tree, pool = make_tree(), SlotPool(32)
    insert(tree, pool, [1, 2, 3], namespace=("lora-a", None))
    check(tree, pool)
    assert tree.match([1, 2, 3]).hbm_len == 0
    assert tree.match([1, 2, 3], ("lora-b", None)).hbm_len == 0
    assert tree.match([1, 2, 3], ("lora-a", None)).hbm_len == 3
    assert insert(tree, pool, [1, 2, 3])[0] == 0  # plain namespace gets its own copy
    check(tree, pool)
    assert tree.hbm_evictable_tokens == 6


def test_locks_protect_from_eviction_and_account_exactly():
    tree, pool = make_tree(), SlotPool(32)
    _, a = insert(tree, pool, [1, 2, 3, 4])
    _, b = insert(tree, pool, [1, 2, 5, 6])
    check(tree, pool)
    shared = a.parent
    assert list(shared.tokens) == [1, 2]
    # lock b's path: [1,2] and [5,6] become protected
    assert tree.inc_lock(b) == -4
    check(tree, pool)
    assert (tree.hbm_evictable_tokens, tree.hbm_protected_tokens) == (2, 4)
    # lock it twice: counts stay, lock_ref doubles
    assert tree.inc_lock(b) == 0 and b.lock_ref == 2 and shared.lock_ref == 2
    check(tree, pool)
    # evicting everything can only take a's unshared [3,4]
    freed = evict_hbm(tree, 100)
    pool.release(s for part in freed for s in part)
    assert [len(f) for f in freed] == [2]
    check(tree, pool)
    assert tree.match([1, 2, 3, 4]).hbm_len == 2
    # unlock both -> everything evictable
    assert tree.dec_lock(b) == 0
    assert tree.dec_lock(b) == 4
    check(tree, pool)
    with pytest.raises(ValueError, match="unbalanced"):
        tree.dec_lock(b)
    freed = evict_hbm(tree, 100)
    pool.release(s for part in freed for s in part)
    check(tree, pool)
    assert tree.hbm_evictable_tokens == 0 and not list(tree.iter_nodes())


def test_evict_order_is_lru_and_amount_bounded():
    tree, pool = make_tree(), SlotPool(64)
    insert(tree, pool, [1] * 1 + [10, 11, 12])  # oldest
    insert(tree, pool, [2, 20, 21, 22])
    insert(tree, pool, [3, 30, 31, 32])
    check(tree, pool)
    tree.match([2, 20])  # touch [2,...] -> most recent; split at 2
    check(tree, pool)
    freed = evict_hbm(tree, 3)  # needs 3 tokens: the oldest leaf [1,10,11,12] has 4
    pool.release(s for part in freed for s in part)
    check(tree, pool)
    assert sum(len(f) for f in freed) == 4
    assert peek_hbm_len(tree, [1, 10, 11, 12]) == 0
    assert peek_hbm_len(tree, [3, 30, 31, 32]) == 4
    # next victim is the unmatched tail [21,22]: the split left it its old access time
    freed = evict_hbm(tree, 1)
    pool.release(s for part in freed for s in part)
    check(tree, pool)
    assert [len(f) for f in freed] == [2]
    assert peek_hbm_len(tree, [2, 20, 21, 22]) == 2
    # then [3,...], inserted before the touch of [2,20]
    freed = evict_hbm(tree, 1)
    pool.release(s for part in freed for s in part)
    check(tree, pool)
    assert peek_hbm_len(tree, [3, 30, 31, 32]) == 0
    assert peek_hbm_len(tree, [2, 20]) == 2


def test_evict_cascades_to_parent_after_children():
    tree, pool = make_tree(), SlotPool(64)
    insert(tree, pool, [1, 2, 3])
    insert(tree, pool, [1, 2, 4])
    check(tree, pool)
    freed = evict_hbm(tree, 3)  # both leaves (1 token each), then the parent [1,2]
    pool.release(s for part in freed for s in part)
    check(tree, pool)
    assert sorted(len(f) for f in freed) == [1, 1, 2]
    assert tree.hbm_evictable_tokens == 0


def test_insert_lower_tier_node_adopts_hbm_slots():
    """A node that lost its HBM copy (kept on DRAM) takes the recomputed slots on insert."""
    tree, pool = make_tree(), SlotPool(64)
    _, node = insert(tree, pool, [1, 2, 3, 4])
    tree.attach(node, Tier.DRAM, [100, 101, 102, 103])  # as if demoted (bookkeeping only)
    freed = evict_hbm(tree, 4)
    pool.release(s for part in freed for s in part)
    check(tree, pool)
    m = tree.match([1, 2, 3, 4])
    assert (m.hbm_len, m.dram_len) == (0, 4) and m.last_node is node
    # re-insert: nothing is a duplicate; the node adopts the new slots
    dup_len, last = insert(tree, pool, [1, 2, 3, 4, 5])
    check(tree, pool)
    assert dup_len == 0 and last.parent is node and node.hbm_slots is not None
    assert tree.match([1, 2, 3, 4, 5]).hbm_len == 5


def test_reset_and_integrity_detects_corruption():
    tree, pool = make_tree(), SlotPool(16)
    _, a = insert(tree, pool, [1, 2, 3])
    check(tree, pool)
    a.hbm_slots = [a.hbm_slots[0]] * 3  # two tokens claiming one slot
    with pytest.raises(IntegrityError, match="shares an HBM slot"):
        tree.check_integrity()
    tree.reset()
    tree.check_integrity()
    assert tree.match([1, 2, 3]).hbm_len == 0
    with pytest.raises(ValueError):
        TieredRadixTree(0)


def test_randomized_against_reference_model():
    """Random insert/match/lock/evict; the tree must agree with a plain set of prefixes."""
    import random

    rng = random.Random(7)
    tree, pool = make_tree(page_size=2), SlotPool(4096)
    held_locks = []
    for step in range(400):
        op = rng.random()
        seq = [rng.randrange(3) for _ in range(rng.randrange(2, 12))]
        if op < 0.45:
            insert(tree, pool, seq)
            aligned = len(seq) - len(seq) % 2
            assert tree.match(seq, split=False, touch=False).hbm_len == aligned
        elif op < 0.6:
            m = tree.match(seq)
            if m.hbm_len:
                tree.inc_lock(m.hbm_node)
                held_locks.append(m.hbm_node)
        elif op < 0.75 and held_locks:
            tree.dec_lock(held_locks.pop(rng.randrange(len(held_locks))))
        else:
            before = tree.hbm_evictable_tokens
            want = rng.randrange(1, 10)
            freed = evict_hbm(tree, want)
            got = sum(len(f) for f in freed)
            pool.release(s for part in freed for s in part)
            assert got >= min(want, before) or tree.hbm_evictable_tokens == 0 or not tree._hbm_leaves
        check(tree, pool)
    for node in held_locks:
        tree.dec_lock(node)
    check(tree, pool)
    assert tree.hbm_protected_tokens == 0


def test_plan_keeps_a_parent_whose_child_the_store_still_holds():
    """A parent's last local copy goes only after every child is deleted; a child that keeps a
    store record is not deleted by dropping its DRAM copy, so the parent stays (found by the MLA
    churn test: the scheduler died on ``_delete``'s assertion, a node deleted with a child)."""
    tree = make_tree(page_size=2)
    parent = tree.add_child(tree.root, [1, 2], None, Tier.DRAM, [10])
    child = tree.add_child(parent, [3, 4], None, Tier.DRAM, [11])
    tree.attach(child, Tier.STORE, ["k-child"])
    other = tree.add_child(tree.root, [5, 6], None, Tier.DRAM, [12])
    plan = tree.plan_evict(Tier.DRAM, 3, allow_sole=True)
    assert parent not in plan and set(plan) == {child, other}
    for node in plan:  # drop them as the ledger would: no assertion, the child keeps its record
        tree.detach(node, Tier.DRAM)
    assert child.alive and child.tiers() == [Tier.STORE] and parent.tiers() == [Tier.DRAM]
    tree.check_integrity()
    # once the child's record is forgotten too, it is deleted and the parent may go
    tree.detach(child, Tier.STORE)
    assert tree.plan_evict(Tier.DRAM, 1, allow_sole=True) == [parent]


def test_nvme_keeps_a_parent_while_a_child_is_on_nvme():
    """NVMe copies go children first, also when the store or DRAM holds the parent too: an NVMe
    page whose parent left NVMe is an orphan after a restart (found by the TP 2 MLA restart
    test: a 24-slot NVMe tier re-indexed 0 pages, 24 orphans, after the store let inner nodes go)."""
    tree = make_tree(page_size=2)
    parent = tree.add_child(tree.root, [1, 2], None, Tier.NVME, [0])
    tree.attach(parent, Tier.STORE, ["k-parent"])
    tree.attach(parent, Tier.DRAM, [20])
    child = tree.add_child(parent, [3, 4], None, Tier.NVME, [1])
    assert tree.plan_evict(Tier.NVME, 2, allow_sole=True) == [child]
    tree.detach(child, Tier.NVME)
    tree.check_integrity()
    assert tree.plan_evict(Tier.NVME, 1, allow_sole=True) == [parent]  # its last NVMe child is gone
    assert tree.plan_evict(Tier.DRAM, 1, allow_sole=True) == [parent]  # other tiers keep their rules
