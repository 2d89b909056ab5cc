"""Scripted tier scenarios: backups, demotions, prefetches, promotions and their acks.

Pure bookkeeping (no bytes move); ``books.check_integrity()`` after every step proves, per
tier, free + held + reserved == capacity and one owner per slot/page.
"""

from __future__ import annotations

import pytest

from hiradix.core.ledger import Kind
from hiradix.core.node import Tier
from tests.helpers.core import Harness

def dram_pages_used(h: Harness) -> int:
    return h.books.dram.num_used


def test_path_demoted_partially_evicted_then_reloaded_then_drained():
    h = Harness(dram_pages=16, nvme_slots=0)
    # a -> b -> c: three nodes of 2 pages each
    h.insert([1, 1, 1, 1])
    h.insert([1, 1, 1, 1, 2, 2, 2, 2])
    c, _ = h.insert([1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    b, a = c.parent, c.parent.parent
    h.check()
    # back up a, b, c to DRAM (write-through); completes -> each node in HBM and DRAM
    op = h.backup([a, b, c])
    h.check()
    assert h.complete(op.op_id, True) is op
    h.check()
    assert all(n.tiers() == [Tier.HBM, Tier.DRAM] for n in (a, b, c))
    # HBM evicts everything -> path lives in DRAM only
    h.evict_hbm(12)
    h.check()
    assert h.tree.hbm_evictable_tokens == 0 and [n.tiers() for n in (a, b, c)] == [[Tier.DRAM]] * 3
    # c's DRAM copy is evicted (DRAM pressure; NVMe absent -> the last copy may go):
    # a and b were used more recently, so the LRU leaf c goes, with exactly its 2 pages
    h.tree.match([1, 1, 1, 1, 2, 2, 2, 2], split=False, touch=True)
    assert h.placement.make_room(Tier.DRAM, 2) == 2
    h.check()
    assert not c.alive and dram_pages_used(h) == 4
    # the request for a,b,c: a and b load back from DRAM, c must be recomputed
    m = h.tree.match([1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    assert m.hbm_len == 0
    loaded = [n for n in m.nodes if n.in_tier(Tier.DRAM)]
    op = h.promote(loaded)
    h.check()
    h.complete(op.op_id, True)
    h.check()
    node, new = h.insert([1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    h.check()
    assert h.tree.match([1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3], split=False, touch=False).hbm_len == 12
    # drain DRAM completely
    while h.books.dram.num_used:
        assert h.placement.make_room(Tier.DRAM, 1, allow_drop=True) >= 1
        h.check()
    assert h.books.dram.num_free == 16


def test_scenario_reload_exact_pages():
    """The exact variant of the a->b->c scenario: which nodes load and which recompute."""
    h = Harness(dram_pages=6, nvme_slots=0)
    c, _ = h.insert([1, 1, 2, 2, 3, 3])  # one node, split below
    h.tree.match([1, 1])
    h.tree.match([1, 1, 2, 2])
    b = c.parent
    a = b.parent
    assert [n.num_tokens for n in (a, b, c)] == [2, 2, 2]
    h.check()
    h.complete(h.backup([a, b, c]).op_id, True)  # # backup a,b,c -> DRAM full (3 of 6 pages used)
    h.check()
    h.evict_hbm(6)  # # HBM -> nothing; DRAM holds a, b, c
    h.check()
    assert h.books.dram.num_used == 3
    # # evict c's DRAM copy: c is the LRU-first leaf in DRAM
    h.tree.match([1, 1, 2, 2], split=False, touch=True)  # a, b recently used
    assert h.placement.make_room(Tier.DRAM, 1, allow_drop=True) == 1
    h.check()
    assert not c.alive and a.in_tier(Tier.DRAM) and b.in_tier(Tier.DRAM)
    m = h.tree.match([1, 1, 2, 2, 3, 3])
    assert (m.hbm_len, m.dram_len, m.nvme_len) == (0, 4, 0)  # # a, b load; c recomputes


def test_evict_n_pages_bounded_by_one_node():
    h = Harness(dram_pages=12, nvme_slots=0)
    nodes = []
    for i in range(4):  # four independent nodes of 3 pages each -> DRAM full
        node, _ = h.insert([10 + i] * 6)
        nodes.append(node)
    h.complete(h.backup(nodes).op_id, True)
    h.evict_hbm(24)
    h.check()
    assert h.books.dram.num_free == 0
    for n in (1, 2, 3, 4):
        before = h.books.dram.num_free
        freed = h.placement.make_room(Tier.DRAM, n, allow_drop=True)
        h.check()
        # at least n (or all that is left), at most n plus one node's pages
        assert min(n, 12 - before) <= freed <= n + 3
        assert h.books.dram.num_free - before == freed
        if h.books.dram.num_free == 12:
            break


def test_redundant_copies_go_first_and_last_copies_wait_for_nvme():
    h = Harness(dram_pages=4, nvme_slots=4)
    hot, _ = h.insert([1] * 4)  # stays in HBM, backed up in DRAM (redundant DRAM copy)
    cold, _ = h.insert([2] * 4)  # only in DRAM after HBM eviction (last copy)
    h.complete(h.backup([hot, cold]).op_id, True)
    h.tree.inc_lock(hot)
    h.evict_hbm(8)
    h.check()
    assert hot.tiers() == [Tier.HBM, Tier.DRAM] and cold.tiers() == [Tier.DRAM]
    # needs 2 pages: only hot's redundant copy may go while NVMe has room
    pages = h.placement.alloc(Tier.DRAM, 2)  # held by the test itself until freed below
    assert pages is not None and hot.tiers() == [Tier.HBM] and cold.tiers() == [Tier.DRAM]
    # 2 more pages: cold is a last copy and NVMe has room -> refused, nothing dropped
    assert h.placement.alloc(Tier.DRAM, 2) is None
    assert cold.tiers() == [Tier.DRAM]
    h.books.dram.free(pages)
    h.check()
    # demote cold to NVMe: the worker writes, then the DRAM pages are freed
    op = h.demote(cold)
    h.check()
    assert cold.pinned[Tier.DRAM] == 1 and cold not in h.tree.candidates(Tier.DRAM)
    h.complete(op.op_id, [True, True])
    h.check()
    assert cold.tiers() == [Tier.NVME] and h.books.dram.num_free == 4
    h.tree.dec_lock(hot)


def test_late_duplicate_out_of_order_and_reset_acks_change_nothing():
    h = Harness(dram_pages=8, nvme_slots=8)
    x, _ = h.insert([1] * 4)
    y, _ = h.insert([2] * 4)
    h.complete(h.backup([x, y]).op_id, True)
    h.evict_hbm(8)
    d1, d2 = h.demote(x), h.demote(y)
    h.check()
    # out of order: d2 first
    h.complete(d2.op_id, True)
    h.check()
    h.complete(d1.op_id, True)
    h.check()
    assert x.tiers() == [Tier.NVME] and y.tiers() == [Tier.NVME]
    snapshot = (h.books.dram.num_free, h.books.nvme.num_free, [n.tiers() for n in h.tree.iter_nodes()])
    # duplicate and unknown acks
    assert h.complete(d1.op_id, True) is None
    assert h.complete(999, False) is None
    h.check()
    assert snapshot == (h.books.dram.num_free, h.books.nvme.num_free, [n.tiers() for n in h.tree.iter_nodes()])
    # a prefetch is in flight when the node's NVMe copy is evicted: impossible (pinned)
    p = h.books.prepare(Kind.PREFETCH, [x])
    assert x not in h.tree.candidates(Tier.NVME)
    h.check()
    # reset while the prefetch is in flight: its pages stay reserved until the late ack
    h.books.reset()
    h.tree.reset()
    h.books.tree = h.tree
    assert h.books.dram.num_used == 2 and h.books.nvme.num_used == 2  # quarantined
    h.complete(p.op_id, True)  # late ack after reset -> frees the quarantine only
    assert h.books.dram.num_used == 0 and h.books.nvme.num_used == 0
    assert list(h.tree.iter_nodes()) == []


def test_failed_prefetch_is_a_miss_and_drops_bad_copy():
    h = Harness(dram_pages=8, nvme_slots=8)
    x, _ = h.insert([1] * 4)
    h.complete(h.backup([x]).op_id, True)
    h.evict_hbm(4)
    h.complete(h.demote(x).op_id, True)
    h.check()
    assert x.tiers() == [Tier.NVME]
    op = h.books.prepare(Kind.PREFETCH, [x])
    h.check()
    h.complete(op.op_id, [True, False])  # second page failed its checksum
    h.check()
    assert not x.alive and h.books.dram.num_used == 0 and h.books.nvme.num_used == 0
    assert h.tree.match([1] * 4).hbm_len == 0 and h.tree.match([1] * 4).nvme_len == 0


def test_split_during_transfer_follows_both_halves():
    h = Harness(dram_pages=8, nvme_slots=8)
    x, _ = h.insert([1, 1, 2, 2, 3, 3, 4, 4])
    h.complete(h.backup([x]).op_id, True)
    h.evict_hbm(8)
    h.complete(h.demote(x).op_id, True)
    op = h.books.prepare(Kind.PREFETCH, [x])
    h.tree.match([1, 1, 2, 2])  # splits x while its prefetch is in flight
    upper = x.parent
    assert upper.num_tokens == 4 and upper.pinned[Tier.NVME] == 1
    h.check()
    h.complete(op.op_id, True)
    h.check()
    assert upper.tiers() == [Tier.DRAM, Tier.NVME] and x.tiers() == [Tier.DRAM, Tier.NVME]
    assert upper.waited_for_read and x.waited_for_read
    assert h.tree.match([1, 1, 2, 2, 3, 3, 4, 4]).dram_len == 8


def test_promote_attaches_hbm_and_pins_until_landed():
    h = Harness(dram_pages=8, nvme_slots=0)
    x, _ = h.insert([5] * 6)
    h.complete(h.backup([x]).op_id, True)
    h.evict_hbm(6)
    op = h.promote([x])
    h.check()
    assert x.in_tier(Tier.HBM) and x.pinned[Tier.HBM] == 1 and x.pinned[Tier.DRAM] == 1
    assert h.placement.evict_hbm(6) == []  # pinned: the copy has not landed
    assert h.placement.make_room(Tier.DRAM, 3, allow_drop=True) == 0
    h.complete(op.op_id, True)
    h.check()
    assert x not in h.tree.candidates(Tier.HBM) or x.pinned == [0, 0, 0, 0]
    assert x.pinned == [0, 0, 0, 0]
    with pytest.raises(AssertionError):
        h.books.prepare(Kind.PROMOTE, [x], hbm_slots=[1, 2])  # wrong slot count


def test_nvme_switched_off_forgets_its_copies():
    h = Harness(dram_pages=8, nvme_slots=8)
    a, _ = h.insert([1, 1, 2, 2])  # a: 2 pages
    b, _ = h.insert([1, 1, 2, 2, 3, 3])  # b below a: 1 page
    h.complete(h.backup([a, b]).op_id, True)
    h.evict_hbm(6)
    for node in (a, b):
        h.complete(h.demote(node).op_id, True)  # moved down: NVMe only
    keep, _ = h.insert([7, 7])  # HBM + NVMe: loses only its NVMe copy
    h.complete(h.backup([keep]).op_id, True)
    h.complete(h.demote(keep).op_id, True)
    h.check()
    assert [n.tiers() for n in (a, b)] == [[Tier.NVME]] * 2 and keep.tiers() == [Tier.HBM, Tier.NVME]
    assert h.placement.forget_nvme() == 4
    h.check()
    assert not a.alive and not b.alive and keep.tiers() == [Tier.HBM]
    assert h.tree.tier_tokens[Tier.NVME] == 0 and not h.books.nvme_enabled


def test_aborted_prefetch_keeps_the_nvme_copy():
    """A worker death is not a checksum failure: nothing moved, the NVMe copy stays."""
    h = Harness(dram_pages=8, nvme_slots=8)
    x, _ = h.insert([1] * 4)
    h.complete(h.backup([x]).op_id, True)
    h.evict_hbm(4)
    h.complete(h.demote(x).op_id, True)
    op = h.books.prepare(Kind.PREFETCH, [x])
    h.check()
    h.complete(op.op_id, False, aborted=True)
    h.check()
    assert x.alive and x.tiers() == [Tier.NVME] and h.books.dram.num_used == 0
    assert x.pinned == [0, 0, 0, 0]


def test_abandon_subtree_quarantines_transfers_in_flight():
    """A slow disk pins a DRAM-only child (demotion in flight) under an HBM-only parent that
    must be evicted: the child is forgotten at once, its pages stay reserved until the ack."""
    h = Harness(dram_pages=4, nvme_slots=8)
    parent, _ = h.insert([1, 2, 3, 4])
    child, _ = h.insert([1, 2, 3, 4, 5, 6, 7, 8])
    h.complete(h.backup([child]).op_id, True)
    h.evict_hbm(4)  # the leaf goes: child is DRAM-only now
    assert child.tiers() == [Tier.DRAM] and parent.tiers() == [Tier.HBM]
    op = h.demote(child)  # the worker is slow: this never acks in time
    h.check()
    h.books.drop_subtree(child)
    assert child.alive  # a pinned copy cannot be dropped
    assert h.books.abandon_subtree(child)
    h.check()
    assert not child.alive and not parent.children
    assert (h.books.dram.num_used, h.books.nvme.num_used) == (2, 2)  # held by the quarantine
    h.evict_hbm(4)  # the parent can go now
    assert not parent.alive
    h.check()
    assert h.complete(op.op_id, True) is None  # the late ack frees what it held, nothing else
    h.check()
    assert (h.books.dram.num_used, h.books.nvme.num_used) == (0, 0)
