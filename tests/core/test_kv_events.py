"""The record behind KV events (hiradix.core.kv_events): replaying the batches gives the tree's tiers.

A simulated server (the real prefix cache, controller, placement and ledger over data-less ports,
a cluster store shared with a second server) runs a random multi-turn churn through HBM, DRAM,
NVMe and the store; a consumer replays every batch taken: after every take its per-tier view is
the set of pages the tree holds in that tier, each page named by a key computed afresh from its
whole prefix (so the per-node key cache and the splits are checked too), with no event storing a
page the view holds or removing one it lacks. Then a flush (one TiersCleared, an empty view) and
a restart whose re-indexed NVMe pages come as stored. Scripted steps check the netting, the
order (parents first, chains in one event), the overflow re-sync, and that off means no work.
"""

from __future__ import annotations

import random

import pytest

from hiradix.core.keys import ROOT_HASH, chain
from hiradix.core.kv_events import PagesRemoved, PagesStored, TierEvents, TiersCleared, coalesce, replay, tree_view
from hiradix.core.node import Tier
from hiradix.core.policy import LRUPolicy
from hiradix.core.prefix_cache import TieredPrefixCache
from hiradix.core.tree import TieredRadixTree
from hiradix.testing.sim_ports import SimClock, SimDevicePool, SimStore, simulated_controller
from tests.helpers.core import FakeClock

PS = 2  # tokens per page


class Keys:
    """A pure page-key chain (hiradix's own page hash) that counts its calls."""

    def __init__(self):
        self.calls = 0

    def chain(self, prior, namespace, tokens):
        self.calls += 1
        return chain(prior if prior is not None else ROOT_HASH, namespace, tokens, PS)


class Server:
    """A simulated server: small HBM, DRAM and NVMe, the cluster store written through."""

    def __init__(self, store: SimStore, clock: SimClock, events: bool = True, max_pending_pages: int = 1 << 16,
                 hbm_tokens: int = 64, dram_pages: int = 12, nvme_slots: int = 40):
        self.clock = clock
        self.tree = TieredRadixTree(PS, LRUPolicy(), clock=clock)
        self.keys = Keys()
        if events:
            self.tree.events = TierEvents(self.tree, self.keys, max_pending_pages)
        self.tiers = simulated_controller(self.tree, dram_pages, nvme_slots, page_bytes=64, write_through=True,
                                          clock=clock, read_s_per_page=0.01, write_s_per_page=0.02, store=store,
                                          store_read_s_per_page=0.01, store_write_s_per_page=0.01)
        self.device = SimDevicePool(hbm_tokens, PS)
        self.cache = TieredPrefixCache(self.tree, self.device, self.tiers, load_timeout_s=1.0)

    def flush(self) -> None:
        """SGLang's ``flush_cache``: the cache's reset, then a fresh device allocator."""
        self.cache.reset()
        self.device = self.cache.device = SimDevicePool(self.device.capacity_tokens, PS)

    def step(self, dt_s: float = 0.05) -> None:
        self.clock.advance_to(self.clock() + dt_s)
        self.cache.step()

    def check(self) -> None:
        self.cache.check_integrity(0, used_tokens=self.device.num_used_tokens())

    def serve(self, tokens: list[int], namespace=None) -> None:
        """A request: waits (a few steps at most) for its NVMe/store reads, loads its DRAM part
        back, computes the rest, inserts it, finishes."""
        m = self.cache.match(tokens, namespace)
        for _ in range(8):
            if not self.cache.should_wait(tokens, namespace):
                break
            self.step()
        m = self.cache.match(tokens, namespace)
        self.cache.lock(m.hbm_node)
        back = self.cache.load_back(m.hbm_node, m.dram_node, m.dram_len)
        if back.node is not m.hbm_node:
            self.cache.lock(back.node)
            self.cache.unlock(m.hbm_node)
        hit = m.hbm_len + back.loaded
        usable = len(tokens) - len(tokens) % PS
        new = self.cache.alloc_device(usable - hit)
        assert new is not None, "HBM too small for one request"
        _, last = self.cache.checkpoint(tokens[:usable], namespace, self.cache.path_slots(back.node) + new, hit)
        self.cache.lock(last)
        self.cache.unlock(back.node)
        self.cache.unlock(last)


def fresh_keys(tree: TieredRadixTree, node) -> list:
    """The keys of ``node``'s pages, computed from its whole prefix."""
    tokens = [t for n in tree.path(node) for t in n.tokens]
    return chain(ROOT_HASH, node.namespace, tokens, PS)[-(node.num_tokens // PS):]


def fresh_view(tree: TieredRadixTree) -> dict[Tier, set]:
    """Per tier, the keys of the pages the tree holds, each computed from its whole prefix."""
    view = {t: set() for t in Tier}
    for node in tree.iter_nodes():
        for tier in node.tiers():
            view[tier].update(fresh_keys(tree, node))
    return view


def churn(server: Server, rng: random.Random, turns: int, on_take=None, other: Server | None = None) -> None:
    """Multi-turn sessions (some salted) in random order, think time between turns; another
    server puts prompts into the store that this one later finds there."""
    histories: dict[int, list[int]] = {}
    namespaces = {s: (None, f"salt{s % 2}") if s % 3 == 0 else None for s in range(8)}
    for turn in range(turns):
        s = rng.randrange(8)
        history = histories.setdefault(s, [])
        if len(history) > 20:  # a session ends; a new one starts in its place
            history.clear()
        history += [1000 * (s + 1) + turn * 10 + i for i in range(rng.choice((2, 4, 6)))]
        if other is not None and rng.random() < 0.2:
            shared = [7, 7] + [500 + turn * 8 + i for i in range(8)]
            other.serve(shared)
            other.step(0.5)
            server.serve(shared + [1, 2])  # finds the other's pages in the store (a lookup, then a read)
        server.serve(list(history), namespaces[s])
        for _ in range(rng.randrange(1, 4)):
            server.step(rng.choice((0.01, 0.05, 0.3)))
        if on_take is not None and rng.random() < 0.5:
            on_take()


@pytest.mark.parametrize("seed", range(4))
def test_replaying_every_batch_gives_the_pages_each_tier_holds_through_churn_flush_and_restart(seed):
    rng = random.Random(seed)
    clock, store = SimClock(), SimStore()
    server, other = Server(store, clock), Server(store, clock, events=False)
    events = server.tree.events
    batches, view = [], None
    seen = {t: 0 for t in Tier}

    def take_and_check():
        nonlocal view
        batch = events.take()
        batches.append(batch)
        for e in batch:
            if isinstance(e, PagesStored):
                seen[e.tier] += len(e.keys)
        view = replay([batch], view)  # no duplicated, lost or stale event (replay asserts)
        assert view == fresh_view(server.tree) == tree_view(events)
        server.check()

    take_and_check()
    assert batches[0] == [TiersCleared()]  # a new record starts from an empty view
    churn(server, rng, 120, take_and_check, other)
    take_and_check()
    assert all(seen[t] for t in Tier), seen  # pages went through every tier, the store included
    assert events.overflows == 0

    # flush (SGLang's flush_cache): one TiersCleared, nothing else; the view is empty
    server.flush()
    take_and_check()
    assert batches[-1] == [TiersCleared()]
    assert not any(view.values())

    # a restart: the NVMe pages re-indexed at start (persistence's restore) come as stored (DISK)
    churn(server, rng, 40)
    take_and_check()
    on_nvme = [n for n in server.tree.iter_nodes() if all(m.in_tier(Tier.NVME) for m in server.tree.path(n))]
    assert on_nvme
    restarted = TieredRadixTree(PS, LRUPolicy(), clock=FakeClock())
    restarted.events = TierEvents(restarted, Keys())
    copies = {server.tree.root: restarted.root}
    for node in on_nvme:  # parents first, as the NVMe index restores them
        copies[node] = restarted.restore(copies[node.parent], node.tokens, node.namespace, node.nvme_slots)
    batch = restarted.events.take()
    assert batch[0] == TiersCleared() and {e.tier for e in batch[1:]} == {Tier.NVME}
    restored = {k for n in on_nvme for k in fresh_keys(server.tree, n)}
    assert replay([batch]) == fresh_view(restarted) == {**{t: set() for t in Tier}, Tier.NVME: restored}


def test_a_page_that_comes_and_goes_within_a_step_is_not_sent_and_one_that_goes_and_comes_back_neither():
    clock, store = SimClock(), SimStore()
    s = Server(store, clock, hbm_tokens=16)
    ev = s.tree.events
    assert ev.take() == [TiersCleared()]
    s.serve([1, 2, 3, 4])  # stored in HBM (the DRAM backup is in flight)
    s.cache.evict(4)  # HBM's copy is the last one: waits for its backup, then leaves HBM
    batch = ev.take()
    assert [(type(e), e.tier) for e in batch] == [(PagesStored, Tier.DRAM)]  # HBM: stored, then removed
    node = next(s.tree.iter_nodes())
    s.cache.load_back(s.tree.root, node, 4)  # back to HBM...
    s.tiers.land_now()
    ids = s.tree.detach(node, Tier.DRAM)  # (DRAM drops it and takes it again in the same step)
    s.tree.attach(node, Tier.DRAM, ids)
    s.cache.evict(4)  # ...and out of HBM again in the same step: nothing to say
    assert ev.take() == []
    s.check()


def test_a_batch_lists_the_clear_then_removals_then_stores_parents_first_as_chains():
    tree = TieredRadixTree(PS, clock=FakeClock())
    tree.events = ev = TierEvents(tree, Keys())
    ev.take()
    _, a, _ = tree.insert([1, 2, 3, 4], list(range(4)))  # one node of 2 pages
    _, b, _ = tree.insert([1, 2, 3, 4, 5, 6, 7, 8], list(range(8)))  # its child, 2 pages
    tree.attach(b, Tier.DRAM, [0, 1])  # the child reaches DRAM before its parent
    tree.attach(a, Tier.DRAM, [2, 3])
    batch = ev.take()
    ka, kb = ev.keys_of(a), ev.keys_of(b)
    assert batch == [
        PagesStored(Tier.HBM, ka + kb, None, [1, 2, 3, 4, 5, 6, 7, 8], None),
        PagesStored(Tier.DRAM, ka + kb, None, [1, 2, 3, 4, 5, 6, 7, 8], None),  # parent first, one chain
    ]
    tree.match([1, 2, 3, 4, 5, 6], split=True)  # a split shares the cached keys out
    assert ev.keys_of(b) == kb[1:] and ev.take() == []
    tree.detach(b, Tier.HBM)
    tree.reset()  # a flush after it: only the clear is sent
    assert ev.take() == [TiersCleared()]
    assert coalesce([]) == []


def test_overflow_drops_the_step_and_the_next_take_resends_the_whole_state():
    clock, store = SimClock(), SimStore()
    s = Server(store, clock, max_pending_pages=6)
    ev = s.tree.events
    view = replay([ev.take()])
    rng = random.Random(7)
    churn(s, rng, 30)  # far more than 6 page changes between takes
    assert ev.overflows > 0 and ev.pending_pages == 0  # recording paused until the take
    batch = ev.take()
    assert batch[0] == TiersCleared() and all(isinstance(e, PagesStored) for e in batch[1:])
    view = replay([batch], view)
    assert view == fresh_view(s.tree)
    # parents before children: a chain's parent page was sent before it (in some tier: a tier
    # below HBM need not hold a page's parent)
    known = set()
    for e in batch[1:]:
        assert e.parent_key is None or e.parent_key in known, e
        known.update(e.keys)
    s.serve([9, 9, 9, 9])  # then it records again
    assert replay([ev.take()], view) == fresh_view(s.tree)


def test_off_there_is_no_record_and_no_key_is_computed():
    clock, store = SimClock(), SimStore()
    s = Server(store, clock, events=False)
    churn(s, random.Random(3), 60)
    assert s.tree.events is None and s.keys.calls == 0
    assert all(n.event_keys is None for n in s.tree.iter_nodes())


def test_keys_are_computed_once_per_node():
    tree = TieredRadixTree(PS, clock=FakeClock())
    keys = Keys()
    tree.events = ev = TierEvents(tree, keys)
    _, a, _ = tree.insert([1, 2, 3, 4], list(range(4)))
    _, b, _ = tree.insert([1, 2, 3, 4, 5, 6], list(range(6)))
    tree.attach(a, Tier.DRAM, [0, 1])
    tree.attach(b, Tier.DRAM, [2])
    tree.detach(b, Tier.HBM)
    assert keys.calls == 2  # a, then b (from a's cached last key)
    batch = ev.take()
    assert [type(e) for e in batch] == [TiersCleared, PagesStored, PagesStored]  # HBM: b came and went
    assert not any(isinstance(e, PagesRemoved) for e in batch)


def test_bad_bound_is_refused():
    with pytest.raises(ValueError):
        TierEvents(TieredRadixTree(PS), Keys(), 0)
