"""The cluster-store tier, scripted: two servers' prefix caches share one (data-less) store.

Each "server" is the real :class:`TieredPrefixCache` (tree, ledger, placement, controller,
store tier) over the data-less ports of :mod:`hiradix.testing.sim_ports`; the store is a
:class:`SimStore` both I/O clients talk to. Invariants are checked after every step.
"""

from __future__ import annotations

import logging

import pytest

from hiradix.core import store_tier
from hiradix.core.ledger import Kind
from hiradix.core.node import Tier
from hiradix.core.policy import make_policy
from hiradix.core.prefix_cache import TieredPrefixCache
from hiradix.core.store_tier import STORE_FAILURES_IN_ROW, STORE_RETRY_S
from hiradix.core.tree import TieredRadixTree
from hiradix.io.protocol import JobDone
from hiradix.testing.sim_ports import SimClock, SimDevicePool, SimStore, simulated_controller

PS = 2  # tokens per page
TIMEOUT_S = 2.0


class Server:
    """One simulated server: the server's prefix cache over data-less ports."""

    def __init__(self, store: SimStore, clock: SimClock, key_prefix: str = "fp1/", write_policy: str = "write_through",
                 dram_pages: int = 64, nvme_slots: int = 0, query_s: float = 0.0, nvme_write_s: float = 0.0):
        self.clock = clock
        self.tree = TieredRadixTree(PS, make_policy("lookahead"), clock=clock)
        self.tiers = simulated_controller(self.tree, dram_pages, nvme_slots, page_bytes=64, write_through=True,
                                          clock=clock, store=store, store_key_prefix=key_prefix,
                                          store_write_policy=write_policy, store_query_s=query_s,
                                          write_s_per_page=nvme_write_s)
        self.device = SimDevicePool(256, PS)
        self.cache = TieredPrefixCache(self.tree, self.device, self.tiers, load_timeout_s=TIMEOUT_S)
        self.held = 0  # device slots owned by requests (none between calls)

    def check(self) -> None:
        self.cache.check_integrity(self.held, used_tokens=self.device.num_used_tokens())

    def step(self) -> None:
        self.cache.step()
        self.check()

    def serve(self, tokens: list[int], namespace=None) -> None:
        """A request computes ``tokens`` and inserts them (SGLang's checkpoint), then finishes."""
        m = self.cache.match(tokens, namespace)
        lock = m.hbm_node
        self.cache.lock(lock)
        new = self.device.alloc(len(tokens) - m.hbm_len)
        slots = self.cache.path_slots(lock) + new
        _, last = self.cache.checkpoint(tokens, namespace, slots, m.hbm_len)
        self.cache.lock(last)
        self.cache.unlock(lock)
        self.cache.unlock(last)
        self.check()

    def admit(self, tokens: list[int], namespace=None):
        """Admission as SGLang runs it: match (starts reads/lookups), wait while reads run, then
        load the DRAM part back. Returns (match at admission, LoadBack)."""
        m = self.cache.match(tokens, namespace)
        back = self.cache.load_back(m.hbm_node, m.dram_node, m.dram_len)
        self.check()
        return m, back


def keys(tag: int, pages: int = 3) -> list[int]:
    return [tag * 100 + i for i in range(pages * PS)]


@pytest.fixture
def cluster():
    clock, store = SimClock(), SimStore()
    return clock, store, Server(store, clock), Server(store, clock)


def settle(*servers: Server, steps: int = 4) -> None:
    for _ in range(steps):
        for s in servers:
            s.step()


def test_turn_routed_to_another_server_hits_through_the_store(cluster):
    clock, store, a, b = cluster
    prompt = keys(1)
    a.serve(prompt)
    settle(a)  # backup lands in DRAM; write-through PUT submitted, then landed
    assert a.tree.tier_tokens[Tier.STORE] == 6 and len(store) == 3
    # B has never seen it: the local match is empty, the lookup of the next pages starts
    m = b.cache.match(prompt)
    assert m.cached_len == 0 and b.tiers.store.lookups
    assert b.cache.should_wait(prompt)
    b.step()  # exists answered: a store-only child under the root, its GET started
    node = next(iter(b.tree.root.children.values()))
    assert node.tiers() == [Tier.STORE] and node.store_keys == a.tiers.store.keys_of(a.tree.match(prompt, split=False).nodes[0])
    assert b.cache.should_wait(prompt)
    b.step()  # GET landed: DRAM + store
    assert node.tiers() == [Tier.DRAM, Tier.STORE] and not b.cache.should_wait(prompt)
    m, back = b.admit(prompt)
    assert (m.hbm_len, m.dram_len) == (0, 6) and back.loaded == 6
    assert back.read_from == {Tier.NVME: 0, Tier.STORE: 6} and back.waited_from[Tier.STORE] == 6
    b.step()
    assert b.tiers.stats.store_tokens["used"] == 6 and b.tiers.store.counts["get_pages"] == 3


def test_lookup_takes_the_leading_run_and_extends_a_local_match(cluster):
    clock, store, a, b = cluster
    history = keys(2, pages=4)
    a.serve(history)
    settle(a)
    b.serve(history[:4])  # B computed the first 2 pages itself
    settle(b)
    turn = history + [7, 7]  # next turn: 4 pages known to A, 1 new page
    b.cache.match(turn)
    b.step()
    b.step()
    m, back = b.admit(turn)
    assert m.hbm_len == 4 and m.dram_len == 4 and back.read_from[Tier.STORE] == 4  # pages 3-4 from the store
    assert back.loaded == 4


def test_salted_requests_and_other_models_never_hit_each_others_pages(cluster):
    clock, store, a, b = cluster
    prompt = keys(3)
    a.serve(prompt, namespace=(None, "salt-a"))
    settle(a)
    other_model = Server(store, clock, key_prefix="fp2/")  # another model or page size
    for server, ns in ((b, (None, "salt-b")), (b, None), (other_model, (None, "salt-a"))):
        server.cache.match(prompt, ns)
        settle(server)
        m, back = server.admit(prompt, ns)
        assert m.cached_len == 0 and back.loaded == 0 and server.tree.tier_tokens[Tier.STORE] == 0
    m = b.cache.match(prompt, (None, "salt-a"))  # the same salt does share
    settle(b)
    assert b.admit(prompt, (None, "salt-a"))[1].read_from[Tier.STORE] == 6


def test_a_get_that_misses_is_a_miss_and_the_request_recomputes(cluster):
    clock, store, a, b = cluster
    prompt = keys(4)
    a.serve(prompt)
    settle(a)
    b.cache.match(prompt)
    b.step()  # found: store-only node, GET in flight
    store._keys.clear()  # the store dropped the objects (holder died, eviction) before the GET ran
    b.step()
    assert not b.tree.root.children  # the stale store record is forgotten
    m, back = b.admit(prompt)
    assert back.loaded == 0 and not b.cache.should_wait(prompt)


def waiting_on_a_slow_lookup(cluster) -> tuple[SimClock, Server, list[int]]:
    """A prompt server ``a`` shared, asked for by a server whose lookups take 10 s: its
    admission waits for the lookup."""
    clock, store, a, _ = cluster
    prompt = keys(5)
    a.serve(prompt)
    settle(a)
    slow = Server(store, clock, query_s=10.0)
    slow.cache.match(prompt)
    assert slow.cache.should_wait(prompt)
    return clock, slow, prompt


def test_a_slow_lookup_waits_at_most_the_timeout(cluster):
    clock, slow, prompt = waiting_on_a_slow_lookup(cluster)
    clock.advance_to(clock() + TIMEOUT_S + 0.1)
    slow.step()  # the deadline passed: the request runs with what is ready
    assert not slow.cache.should_wait(prompt)
    clock.advance_to(clock() + 10.0)
    slow.step()  # the late answer is still used: found, fetched ahead for the next request
    slow.step()
    assert slow.admit(prompt)[1].read_from[Tier.STORE] == 6


def test_puts_wait_while_an_admission_waits_for_a_store_read(cluster):
    """New PUTs wait while a request waits at admission for a store lookup (the store's time
    goes to the read), and start once that wait ends."""
    clock, slow, prompt = waiting_on_a_slow_lookup(cluster)
    slow.serve(keys(6))  # another request's pages: backed up to DRAM, then queued for a PUT
    settle(slow, steps=5)
    assert not slow.tiers.books.in_flight(Kind.PUT) and slow.tree.tier_tokens[Tier.STORE] == 0
    assert slow.tiers.store.counts["put_paused_steps"] >= 4
    clock.advance_to(clock() + TIMEOUT_S + 0.1)
    slow.step()  # the wait expired: the request runs, and the PUT starts
    assert not slow.cache.should_wait(prompt)
    settle(slow)
    assert slow.tree.tier_tokens[Tier.STORE] == 6


def test_puts_wait_at_most_max_put_pause_steps_in_a_row(cluster, monkeypatch):
    """Steady admission reads never starve shares: after MAX_PUT_PAUSE_STEPS paused steps the PUT
    starts although the wait goes on."""
    monkeypatch.setattr(store_tier, "MAX_PUT_PAUSE_STEPS", 3)
    clock, slow, prompt = waiting_on_a_slow_lookup(cluster)
    slow.serve(keys(6))
    settle(slow, steps=5)
    assert slow.tiers.store.counts["put_paused_steps"] == 3 and slow.cache.should_wait(prompt)
    assert slow.tiers.books.in_flight(Kind.PUT) or slow.tree.tier_tokens[Tier.STORE] == 6


def test_write_back_puts_only_what_left_hbm():
    clock, store = SimClock(), SimStore()
    a = Server(store, clock, write_policy="write_back")
    prompt = keys(6)
    a.serve(prompt)
    settle(a)
    assert len(store) == 0 and a.tree.tier_tokens[Tier.DRAM] == 6  # backed up, not shared
    a.cache.evict(6)
    settle(a)
    assert len(store) == 3 and a.tree.tier_tokens[Tier.STORE] == 6


def test_a_write_through_backup_dram_had_no_room_for_is_shared_once_demotions_land():
    """DRAM full of last copies on their way to NVMe: the new node's backup (and so its PUT)
    waits until they landed, instead of leaving it HBM-only and unshared while HBM holds it."""
    clock, store = SimClock(), SimStore()
    a = Server(store, clock, dram_pages=3, nvme_slots=64, nvme_write_s=1.0)
    first, second = keys(1), keys(2)
    a.serve(first)
    settle(a)
    assert len(store) == 3
    a.cache.evict(6)  # first: DRAM's last copy now, its demotion to NVMe takes 3 s
    a.step()
    assert a.tree.tier_tokens[Tier.NVME] == 0 and a.tiers.books.dram.num_free == 0
    a.serve(second)  # write-through finds DRAM full of last copies: deferred
    node = a.tree.match(second, split=False).nodes[-1]
    assert node.tiers() == [Tier.HBM] and len(a.tiers.backups.deferred) == 1
    settle(a)
    assert node.tiers() == [Tier.HBM] and len(store) == 3  # still no room: nothing dropped, nothing lost
    clock.advance_to(clock() + 3.5)  # the demotion landed: its DRAM copy goes (DRAM is short)
    settle(a)
    assert node.tiers() == [Tier.HBM, Tier.DRAM, Tier.STORE] and len(store) == 6
    assert len(a.tiers.backups.deferred) == 0 and a.tiers.backups.deferred.opened_nodes == 1
    assert a.tree.tier_tokens[Tier.NVME] == 6


def test_a_dram_copy_queued_for_a_put_stays_when_its_demotion_lands(monkeypatch):
    """A node queued for a PUT keeps its DRAM copy (the PUT's source) when its demotion to NVMe
    lands while DRAM is short, so it is still shared once the PUT starts."""
    clock, store = SimClock(), SimStore()
    a = Server(store, clock, dram_pages=4, nvme_slots=64)
    monkeypatch.setattr(store_tier, "MAX_PUTS_IN_FLIGHT", 0)  # PUTs stay queued for now
    prompt = keys(3, pages=4)
    a.serve(prompt)
    a.step()  # backup landed: PUT queued
    node = a.tree.match(prompt, split=False).nodes[-1]
    assert a.tiers.store.wants_put(node) and node.tiers() == [Tier.HBM, Tier.DRAM]
    a.cache.evict(8)  # DRAM's last copy now: stored to NVMe
    settle(a)
    books = a.tiers.books
    assert node.tiers() == [Tier.DRAM, Tier.NVME]  # the demotion landed ...
    assert books.dram.num_free < a.tiers.placement.dram_free_low_pages  # ... while DRAM is short
    monkeypatch.setattr(store_tier, "MAX_PUTS_IN_FLIGHT", 32)
    settle(a)
    assert len(store) == 4 and node.in_tier(Tier.STORE)


class FailingPuts:
    """Wraps an I/O client: every PUT page fails and nothing reaches the store (a full store)."""

    def __init__(self, inner):
        self.inner, self.failed = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit_put(self, job_id, dram_pages, keys):
        self.failed.append(JobDone(job_id=job_id, ok=[False] * len(keys)))

    def poll(self):
        done, self.failed = self.failed + self.inner.poll(), []
        return done


def test_failed_puts_in_a_row_switch_the_store_off_once_and_it_comes_back(caplog):
    clock, store = SimClock(), SimStore()
    a = Server(store, clock)
    a.tiers.client = a.tiers.store.client = FailingPuts(a.tiers.client)
    caplog.set_level(logging.WARNING)
    for tag in range(STORE_FAILURES_IN_ROW):
        a.serve(keys(10 + tag))
        settle(a)
    warnings = [r.getMessage() for r in caplog.records if "cluster store switched off" in r.getMessage()]
    assert len(warnings) == 1 and f"store writes failed in {STORE_FAILURES_IN_ROW} steps in a row" in warnings[0]
    assert not a.tiers.store_enabled and a.tree.tier_tokens[Tier.STORE] == 0
    a.cache.match(keys(99))  # off: no lookups, no puts
    assert not a.tiers.store.lookups
    clock.advance_to(clock() + STORE_RETRY_S + 1)
    a.step()
    assert a.tiers.store_enabled  # tried again: still failing -> off again, no second warning, twice the wait
    for tag in range(STORE_FAILURES_IN_ROW):
        a.serve(keys(60 + tag))
        settle(a)
    assert not a.tiers.store_enabled
    assert sum("cluster store switched off" in r.getMessage() for r in caplog.records) == 1
    assert a.tiers.store._retry_at_s - clock() == pytest.approx(2 * STORE_RETRY_S, abs=1.0)
    clock.advance_to(clock() + 2 * STORE_RETRY_S + 1)
    a.step()
    assert a.tiers.store_enabled
    a.tiers.client = a.tiers.store.client = a.tiers.client.inner
    a.serve(keys(50))
    settle(a)
    assert a.tree.tier_tokens[Tier.STORE] == 6 and len(store) == 3
    assert any("cluster store works again" in r.getMessage() for r in caplog.records)


class FlakyPuts(FailingPuts):
    """Wraps an I/O client: the first ``fail`` PUT jobs fail as a whole (their I/O worker died
    under them, as when a wedged store client's worker is restarted); later ones go through."""

    def __init__(self, inner, fail: int):
        super().__init__(inner)
        self.to_fail = fail

    def submit_put(self, job_id, dram_pages, keys):
        if self.to_fail == 0:
            return self.inner.submit_put(job_id, dram_pages, keys)
        self.to_fail -= 1
        self.failed.append(JobDone(job_id=job_id, ok=[False] * len(keys), error="I/O worker pid 1 died"))


def test_a_put_whose_worker_died_is_tried_again_and_lands():
    clock, store = SimClock(), SimStore()
    a = Server(store, clock)
    a.tiers.client = a.tiers.store.client = FlakyPuts(a.tiers.client, fail=store_tier.PUT_ATTEMPTS - 1)
    a.serve(keys(30))
    settle(a, steps=8)
    assert len(store) == 3 and a.tree.tier_tokens[Tier.STORE] == 6  # every page shared
    counts = a.tiers.store.counts
    assert counts["put_retried_pages"] == counts["put_failed_pages"] == 3 * (store_tier.PUT_ATTEMPTS - 1)
    assert counts["put_pages"] == 3 and a.tiers.store_enabled


def test_puts_one_worker_death_fails_at_once_count_once_and_land_on_retry():
    """An I/O worker that dies (a wedged store client cut off) fails every job it holds in the
    same step: more PUT jobs than ``STORE_FAILURES_IN_ROW`` fail at once. That is one failed step,
    not a dead store: the tier stays on and the PUTs land when tried again (a CI run's store was
    switched off for 30 s when 11 jobs failed at once and counted as 11 failures in a row)."""
    clock, store = SimClock(), SimStore()
    a = Server(store, clock)
    prompts = [keys(40 + tag) for tag in range(STORE_FAILURES_IN_ROW + 1)]
    a.tiers.client = a.tiers.store.client = FlakyPuts(a.tiers.client, fail=len(prompts))
    for prompt in prompts:
        a.serve(prompt)
    settle(a, steps=8)
    counts = a.tiers.store.counts
    assert counts["put_failed_pages"] == counts["put_retried_pages"] == 3 * len(prompts)  # all failed once
    assert a.tiers.store_enabled and counts["switch_offs"] == 0
    assert len(store) == 3 * len(prompts) and a.tree.tier_tokens[Tier.STORE] == 6 * len(prompts)


def test_a_put_the_store_refuses_is_not_tried_again():
    clock, store = SimClock(), SimStore()
    a = Server(store, clock)
    a.tiers.client = a.tiers.store.client = FailingPuts(a.tiers.client)  # every page refused (a full store)
    a.serve(keys(32))
    settle(a, steps=8)
    counts = a.tiers.store.counts
    assert counts["put_failed_pages"] == 3 and counts["put_retried_pages"] == 0 and len(store) == 0


def test_a_put_whose_worker_keeps_dying_is_tried_put_attempts_times_then_dropped():
    clock, store = SimClock(), SimStore()
    a = Server(store, clock)
    a.tiers.client = a.tiers.store.client = FlakyPuts(a.tiers.client, fail=100)
    a.serve(keys(31))
    settle(a, steps=12)
    counts = a.tiers.store.counts
    assert counts["put_failed_pages"] == 3 * store_tier.PUT_ATTEMPTS  # then no further try
    assert counts["put_retried_pages"] == 3 * (store_tier.PUT_ATTEMPTS - 1)
    assert len(store) == 0 and a.tree.tier_tokens[Tier.STORE] == 0 and not a.tiers.store._put_failures
    assert a.tiers.store_enabled == (store_tier.PUT_ATTEMPTS < STORE_FAILURES_IN_ROW)


class WedgedPuts(FailingPuts):
    """Wraps an I/O client: PUTs are taken and never answered (a wedged store client, until the
    I/O worker's call limit restarts it)."""

    def submit_put(self, job_id, dram_pages, keys):
        self.failed = []  # nothing ever comes back


def test_puts_a_wedged_store_never_answers_pin_at_most_half_of_dram_and_lose_nothing():
    """PUTs in flight pin their DRAM pages. Against a store that never answers they stop starting
    once they hold half of DRAM, so backups and demotions go on in the other half: every prompt
    leaves HBM with a copy below (none lost), instead of DRAM filling with pinned PUT sources
    and HBM dropping last copies (a CI run: PUT in flight 12, DRAM 96/97, HBM dropped 288)."""
    clock, store = SimClock(), SimStore()
    a = Server(store, clock, dram_pages=12, nvme_slots=64)
    a.tiers.client = a.tiers.store.client = WedgedPuts(a.tiers.client)
    prompts = [keys(20 + tag) for tag in range(6)]  # 3 pages each, 18 in all: more than DRAM
    for prompt in prompts:
        a.serve(prompt)
        settle(a)
        put_pages = sum(len(op.src_ids) for op in a.tiers.books.in_flight(Kind.PUT))
        assert put_pages <= 6, put_pages  # half of DRAM (the last job started below that)
    assert len(a.tiers.books.in_flight(Kind.PUT)) == 2 and len(store) == 0
    for prompt in prompts:  # every prompt leaves HBM, one at a time (as requests need room)
        a.cache.evict(len(prompt))
        settle(a)
    assert a.tiers.books.dropped_tokens[Tier.HBM] == 0
    for prompt in prompts:
        assert a.tree.match(prompt, split=False).matched_len == len(prompt)  # from DRAM or NVMe
    assert a.tree.tier_tokens[Tier.HBM] == 0 and a.tree.tier_tokens[Tier.NVME] >= 24


def test_admission_retries_do_not_ask_again_after_a_lookup_found_nothing(cluster):
    """SGLang retries a skipped request every step: one lookup, one wait, then it runs."""
    clock, store, a, b = cluster
    prompt = keys(7)
    b.cache.match(prompt)
    assert b.cache.should_wait(prompt)
    b.step()  # nothing found
    for _ in range(3):  # the admission retries
        b.cache.match(prompt)
        assert not b.cache.should_wait(prompt)
        b.step()
    assert b.tiers.store.counts["lookup_pages"] == 3  # asked once


def test_persisting_a_prefix_skips_ancestors_only_the_store_holds():
    """A page landed on NVMe whose ancestor is held only by the cluster store (no HBM, DRAM or
    NVMe copy, e.g. evicted after its PUT): nothing local can be written down for it, so the
    journal keeps the node waiting instead of opening a BACKUP of a node without device slots
    (found by tests/e2e/test_e2e_mla.py: a TypeError in the scheduler)."""
    from types import SimpleNamespace

    from hiradix.core.nvme_link import NvmeLink

    class Node(SimpleNamespace):
        __hash__ = object.__hash__  # identity, as TreeNode

        def in_tier(self, tier):
            return tier in self.held

    parent = Node(held={Tier.STORE}, ops=0, alive=True)
    child = Node(held={Tier.NVME}, ops=0, alive=True)
    prepared, synced = [], []
    journal = SimpleNamespace(landed=[child], sync=lambda: synced.append(1))
    link = NvmeLink(tree=SimpleNamespace(path=lambda node: [parent, node]),
                    books=SimpleNamespace(nvme_enabled=True, in_flight=lambda kind: []),
                    placement=SimpleNamespace(prepare=lambda kind, nodes: prepared.append((kind, nodes))),
                    client=None, mover=None, journal=journal)
    link.persist_prefixes()
    assert prepared == [] and journal.landed == [child] and synced == [1]
    parent.held = {Tier.HBM, Tier.STORE}  # back in HBM: now it is backed up (then demoted)
    link.persist_prefixes()
    assert [kind.name for kind, _ in prepared] == ["BACKUP"]


def test_a_lookup_answer_applied_by_a_write_back_wait_is_applied_as_a_lookup(cluster):
    """On one rank, write-back eviction applies I/O results as they arrive (``_apply_results_now``):
    a store lookup's answer among them is applied as the lookup, not as a transfer (it used to
    stay in ``store.lookups`` forever, and that prefix was never looked up again)."""
    clock, store, a, b = cluster
    prompt = keys(7)
    a.serve(prompt)
    settle(a)
    b.cache.match(prompt)
    (op_id,) = b.tiers.store.lookups
    results = b.tiers.client.wait(1.0)
    assert [r.job_id for r in results] == [op_id]
    b.tiers._apply_results_now(results)
    assert op_id not in b.tiers.store.lookups
    node = next(iter(b.tree.root.children.values()))
    assert node.tiers() == [Tier.STORE] and b.tiers.books.in_flight(Kind.GET)  # found: attached, its GET started
    settle(b)
    assert b.admit(prompt)[1].read_from[Tier.STORE] == 6
