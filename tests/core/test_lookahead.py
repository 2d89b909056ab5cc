"""The look-ahead window and policy (CachedAttention §3.3) against LRU, on scripted queues.

Pure bookkeeping: a tree, its DRAM/NVMe books, and ``hiradix.core.lookahead.plan`` fed the token
keys of the waiting queue. Exact expected sets per tier; invariants after every step.
"""

from __future__ import annotations

import pytest

from hiradix.core.ledger import Kind, TierBooks
from hiradix.core.lookahead import plan
from hiradix.core.node import Tier
from hiradix.core.placement import Placement
from hiradix.core.policy import LRUPolicy, make_policy
from hiradix.core.tree import TieredRadixTree
from tests.helpers.core import FakeClock, SlotPool, complete, evict_hbm, prepare

PS = 2


def build(policy_name: str, dram_pages: int = 64, nvme_slots: int = 64):
    tree = TieredRadixTree(PS, make_policy(policy_name), clock=FakeClock())
    books = TierBooks(tree, dram_pages, nvme_slots)
    return tree, books, SlotPool(512)


def seq(tag: int, pages: int = 2) -> list[int]:
    """A prompt of ``pages`` pages unique to ``tag``."""
    return [tag] * (pages * PS)


def insert(tree, pool, tokens):
    slots = pool.alloc(len(tokens))
    dup, node, _ = tree.insert(tokens, slots)
    pool.release(slots[:dup])
    return node


def look(tree, books, queue, window=8):
    view = plan(tree, [(q, None) for q in queue], window, books.dram.num_free)
    if tree.policy.uses_queue:
        tree.policy.observe_queue(view)
    return view


def hbm_resident(tree, tags):
    return {t for t in tags if tree.match(seq(t), split=False, touch=False).hbm_len == 2 * PS}


@pytest.mark.parametrize("policy", ["lru", "lookahead"])
def test_hbm_eviction_keeps_what_the_queue_needs(policy):
    tree, books, pool = build(policy)
    for tag in (1, 2, 3, 4):  # inserted oldest first: 1 is the LRU victim
        insert(tree, pool, seq(tag))
    books.check_integrity()
    # queue: request for 1 runs next (position 0), request for 2 after it (position 1)
    view = look(tree, books, [seq(1), seq(2)])
    assert view.window == 2 and view.protected_nodes == 2
    freed = evict_hbm(tree, 2 * 2 * PS, books)  # room for two nodes
    for slots in freed:
        pool.release(slots)
    books.check_integrity()
    kept = hbm_resident(tree, (1, 2, 3, 4))
    if policy == "lookahead":
        assert kept == {1, 2}  # unneeded nodes go first, whatever their recency
    else:
        assert kept == {3, 4}  # recency only: the queued requests lose their prefixes
    # one more node: lookahead now evicts the one needed latest (2), keeps the next one (1)
    for slots in evict_hbm(tree, 1, books):
        pool.release(slots)
    books.check_integrity()
    assert hbm_resident(tree, (1, 2, 3, 4)) == ({1} if policy == "lookahead" else {4})


@pytest.mark.parametrize("policy", ["lru", "lookahead"])
def test_dram_eviction_keeps_what_the_queue_needs(policy):
    tree, books, pool = build(policy, dram_pages=8, nvme_slots=0)
    nodes = {tag: insert(tree, pool, seq(tag)) for tag in (1, 2, 3, 4)}
    complete(books, prepare(books, Kind.BACKUP, list(nodes.values())).op_id)
    for slots in evict_hbm(tree, 100, books):
        pool.release(slots)
    books.check_integrity()
    assert books.dram.num_free == 0 and all(n.tiers() == [Tier.DRAM] for n in nodes.values())
    look(tree, books, [seq(3), seq(1)])  # 3 runs first, then 1
    assert Placement(tree, books).make_room(Tier.DRAM, 4, allow_drop=True) == 4
    books.check_integrity()
    in_dram = {t for t, n in nodes.items() if n.alive and n.in_tier(Tier.DRAM)}
    assert in_dram == ({1, 3} if policy == "lookahead" else {3, 4})


def test_protection_is_a_priority_never_a_refusal():
    tree, books, pool = build("lookahead")
    for tag in (1, 2):
        insert(tree, pool, seq(tag))
    look(tree, books, [seq(1), seq(2)])  # everything is needed
    freed = evict_hbm(tree, 4 * PS, books)
    assert sum(len(f) for f in freed) == 4 * PS  # still evicted: needed-latest first
    books.check_integrity()


def test_plan_is_read_only_and_reports_nvme_tails_inside_the_prefetch_window():
    tree, books, pool = build("lookahead", dram_pages=6, nvme_slots=32)
    nodes = {tag: insert(tree, pool, seq(tag)) for tag in (1, 2, 3)}
    complete(books, prepare(books, Kind.BACKUP, list(nodes.values())).op_id)
    for slots in evict_hbm(tree, 100, books):
        pool.release(slots)
    for tag in (1, 2, 3):
        complete(books, prepare(books, Kind.DEMOTE, [nodes[tag]]).op_id)  # moves it down
    books.check_integrity()
    before = [(n.id, n.num_tokens, n.last_access_s) for n in tree.iter_nodes()]
    # each request needs 2 pages + 1 new page; DRAM has 6 free pages -> L_pw = 6 pages / 3 pages = 2
    queue = [seq(1) + [9] * PS, seq(2) + [9] * PS, seq(3) + [9] * PS]
    view = look(tree, books, queue)
    assert [(n.id, n.num_tokens, n.last_access_s) for n in tree.iter_nodes()] == before  # no split, no touch
    assert view.window == 3 and view.prefetch_window == 2
    assert view.prefetch == [[nodes[1]], [nodes[2]]]  # the third request is outside L_pw
    assert view.needed_at == {nodes[1].id: 0, nodes[2].id: 1, nodes[3].id: 2}


def test_backups_never_block_prefetch():
    """DRAM full of copies of HBM-resident nodes still accepts an NVMe -> DRAM prefetch."""
    tree, books, pool = build("lookahead", dram_pages=4, nvme_slots=8)
    cold = insert(tree, pool, seq(9))
    complete(books, prepare(books, Kind.BACKUP, [cold]).op_id)
    for slots in evict_hbm(tree, 100, books):
        pool.release(slots)
    complete(books, prepare(books, Kind.DEMOTE, [cold]).op_id)  # moves it: DRAM copy freed
    hot = [insert(tree, pool, seq(t)) for t in (1, 2)]
    complete(books, prepare(books, Kind.BACKUP, hot).op_id)  # DRAM: 4/4 pages of backups
    for node in hot:
        tree.inc_lock(node)  # running requests: their HBM copies stay
    books.check_integrity()
    assert books.dram.num_free == 0 and cold.tiers() == [Tier.NVME]
    view = look(tree, books, [seq(9)])
    # no free DRAM page, but the backups are reclaimable: the window still prefetches
    assert view.prefetch_window == 1 and view.prefetch == [[cold]]
    op = prepare(books, Kind.PREFETCH, view.prefetch[0], ahead=True)
    assert op is not None
    books.check_integrity()
    books.complete(op.op_id, True)
    books.check_integrity()
    assert cold.in_tier(Tier.DRAM) and not cold.waited_for_read  # ahead of admission: a DRAM hit
    assert sum(n.in_tier(Tier.DRAM) for n in hot) == 1  # one backup copy made the room
    for node in hot:
        tree.dec_lock(node)


def test_completed_prefetches_are_used_with_data_three_times_dram():
    """Pages prefetched for a queued request are still in DRAM when it is admitted."""
    dram_pages, per_req_pages = 8, 2
    tree, books, pool = build("lookahead", dram_pages=dram_pages, nvme_slots=64)
    tags = list(range(1, 13))  # 12 requests x 2 pages = 24 pages = 3x DRAM
    nodes = {}
    for tag in tags:
        nodes[tag] = insert(tree, pool, seq(tag, per_req_pages))
        complete(books, prepare(books, Kind.BACKUP, [nodes[tag]], allow_drop=True).op_id)
        for slots in evict_hbm(tree, 100, books):
            pool.release(slots)
        complete(books, prepare(books, Kind.DEMOTE, [nodes[tag]]).op_id)  # moves it down
    books.check_integrity()
    assert books.dram.num_free == dram_pages and all(n.tiers() == [Tier.NVME] for n in nodes.values())
    queue = [seq(t, per_req_pages) for t in tags]
    dram_hits = 0
    while queue:
        view = look(tree, books, queue)
        for tail in view.prefetch:  # the window prefetches, then the ack lands
            if all(n.pinned[Tier.NVME] == 0 and not n.in_tier(Tier.DRAM) for n in tail):
                op = prepare(books, Kind.PREFETCH, tail, ahead=True)
                assert op is not None
                books.complete(op.op_id, True)
        books.check_integrity()
        head = queue.pop(0)  # admit the first request: what does it find?
        m = tree.match(head)
        dram_hits += m.dram_len
        if m.dram_len:
            nodes_ = [n for n in m.nodes if n.in_tier(Tier.DRAM)]
            op = books.prepare(Kind.PROMOTE, nodes_, hbm_slots=pool.alloc(m.dram_len))
            books.complete(op.op_id, True)
        for slots in evict_hbm(tree, 100, books):  # it finished; HBM is tiny
            pool.release(slots)
        books.check_integrity()
    assert dram_hits == len(tags) * per_req_pages * PS  # every prompt was a DRAM hit
    assert books.wasted_prefetch_tokens == 0


def test_lru_has_no_window():
    tree, _, _ = build("lru")
    assert isinstance(tree.policy, LRUPolicy) and not tree.policy.uses_queue


def test_queued_key_reuses_its_peek_until_the_path_changes():
    """A queued request's peek is revalidated in O(path nodes); a split, a deletion or a new
    node after the path makes it match again, with the same result a fresh match gives."""
    from hiradix.core.lookahead import QueuedKey, peek

    tree, books, pool = build("lookahead")
    calls = []
    real_match = tree.match
    tree.match = lambda *a, **kw: calls.append(1) or real_match(*a, **kw)
    insert(tree, pool, seq(1, pages=2))
    key = QueuedKey(seq(1, pages=2) + [7] * PS)
    assert peek(tree, key).hbm_len == 2 * PS and len(calls) == 1
    assert peek(tree, key).hbm_len == 2 * PS and len(calls) == 1  # reused: the path did not change
    insert(tree, pool, seq(1, pages=2) + [7] * PS)  # a new node after the path: match again
    assert peek(tree, key).hbm_len == 3 * PS and len(calls) == 2
    real_match(seq(1, pages=1))  # a split on the path: match again
    m = peek(tree, key)
    assert len(calls) == 3 and m.hbm_len == 3 * PS and len(m.nodes) == 3
    assert peek(tree, key) == real_match(key.tokens, split=False, touch=False) and len(calls) == 3  # reused again
    for slots in evict_hbm(tree, 100, books):  # nodes deleted (no lower copy): match again
        pool.release(slots)
    assert peek(tree, key).hbm_len == 0 and len(calls) == 4
