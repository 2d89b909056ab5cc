"""Unready pages (issue 12, deliverable 3) and reads for predicted returns, scripted.

On a simulated server (:class:`tests.helpers.sim_server.SimServer`): NVMe writes take 1 s per
page, reads 0.5 s.
"""

from __future__ import annotations

from hiradix.core import returns
from hiradix.core.ledger import Kind
from hiradix.core.node import Tier
from hiradix.core.policy import LRUPolicy
from hiradix.core.ports import READ_AT_ADMISSION, READ_BACKGROUND
from hiradix.core.predict import PredictivePolicy
from hiradix.core.tree import TieredRadixTree
from hiradix.testing.sim_ports import SimClock, SimStore
from tests.helpers.sim_server import PS, TIMEOUT_S, SimServer, keys


def test_a_page_being_written_to_nvme_is_served_from_dram_until_the_write_lands():
    s = SimServer(dram_pages=4, dram_free_low_pages=4)  # DRAM always "short": a landed store moves down
    node = s.serve(keys(1))
    s.at(0.0)  # the write-through backup lands in DRAM
    s.drop_hbm()  # the DRAM copy is the last one: its store to NVMe starts (2 pages: 2 s)
    assert node.tiers() == [Tier.DRAM] and len(s.tiers.books.in_flight(Kind.DEMOTE)) == 1
    m = s.tree.match(keys(1), split=False, touch=False)
    assert (m.dram_len, m.nvme_len) == (4, 0)  # served from DRAM while the NVMe copy is written
    # the DRAM source cannot be made room of, even with last copies allowed to go
    assert s.tiers.placement.make_room(Tier.DRAM, 4, allow_drop=True) == 0 and node.in_tier(Tier.DRAM)
    assert not s.cache.should_wait(keys(1))
    s.at(1.5)
    assert node.tiers() == [Tier.DRAM]  # still writing
    s.at(2.0)  # landed: now (DRAM short) the page lives on NVMe only
    assert node.tiers() == [Tier.NVME]
    m = s.tree.match(keys(1), split=False, touch=False)
    assert (m.dram_len, m.nvme_len) == (0, 4)


def test_an_admission_read_drops_dram_copies_still_waiting_for_nvme_not_its_own(monkeypatch):
    # DRAM 3 pages; one store to NVMe in flight at a time (10 s/page): DRAM fills with last
    # copies waiting for their store.
    monkeypatch.setattr("hiradix.core.nvme_link.MAX_DEMOTIONS_IN_FLIGHT", 1)
    s = SimServer(dram_pages=3, write_s=10.0)
    old = s.serve(keys(1, pages=1))
    s.at(0.0)
    s.drop_hbm()  # old: DRAM only, its store runs until t = 10
    s.at(10.0)
    s.tiers.placement.make_room(Tier.DRAM, 3)  # the redundant DRAM copy goes: old on NVMe only
    assert old.tiers() == [Tier.NVME]
    s.clock.advance_to(10.0)
    f2 = s.compute(keys(2, pages=1))
    s.clock.advance_to(10.5)
    own = s.compute(keys(1, pages=1) + [777, 778])  # the request's second page, below old
    s.clock.advance_to(11.0)
    f3 = s.compute(keys(3, pages=1))
    s.at(11.0)  # three backups land: DRAM is full
    s.drop_hbm()  # all three are last copies now; f2 (least recent) is stored first, the others wait
    assert [n.tiers() for n in (f2, own, f3)] == [[Tier.DRAM]] * 3 and old.tiers() == [Tier.NVME]
    assert [op.nodes for op in s.tiers.books.in_flight(Kind.DEMOTE)] == [[f2]]
    assert s.tiers.books.dram.num_free == 0
    # the request for old + own: its first page must be read, into a page only a waiting last
    # copy can give: f3 goes (own is the request's, f2's store is in flight)
    m = s.cache.match(keys(1, pages=1) + [777, 778])
    assert m.nvme_len == 2 and [op.nodes for op in s.tiers.books.in_flight(Kind.PREFETCH)] == [[old]]
    assert not f3.alive and own.in_tier(Tier.DRAM) and f2.in_tier(Tier.DRAM)
    assert s.tiers.books.dropped_tokens[Tier.DRAM] == 2
    assert s.submitted[-1][1] == READ_AT_ADMISSION
    assert s.cache.should_wait(keys(1, pages=1) + [777, 778])
    s.at(11.5)  # read landed (0.5 s per page): both pages in DRAM, nothing to wait for
    assert not s.cache.should_wait(keys(1, pages=1) + [777, 778])
    m = s.cache.match(keys(1, pages=1) + [777, 778])
    assert m.dram_len == 4


def test_no_admission_with_an_unread_nvme_part_until_its_timeout():
    # DRAM 2 pages, both pinned by stores in flight (10 s/page): the read cannot start.
    s = SimServer(dram_pages=2, write_s=10.0)
    first = s.serve(keys(1, pages=1))
    s.at(0.0)
    s.drop_hbm()  # its store runs until t = 10
    s.at(10.0)
    s.tiers.placement.make_room(Tier.DRAM, 2)
    assert first.tiers() == [Tier.NVME]
    s.serve(keys(2, pages=1))
    s.serve(keys(3, pages=1))
    s.at(10.0)  # both backups landed
    s.drop_hbm()  # both last copies: their stores run until t = 20 and t = 30 (pinned until then)
    assert s.tiers.books.dram.num_free == 0 and len(s.tiers.books.in_flight(Kind.DEMOTE)) == 2
    m = s.cache.match(keys(1, pages=1))
    assert m.nvme_len == 2 and not s.tiers.books.in_flight(Kind.PREFETCH)  # no room: no read
    assert s.cache.should_wait(keys(1, pages=1))  # waits anyway (before: admitted, recomputed)
    s.at(11.5)
    assert s.cache.should_wait(keys(1, pages=1))
    s.at(12.0)  # 2 s after the first attempt: the wait expires, agreed at this step
    assert not s.cache.should_wait(keys(1, pages=1))
    # a later request for it (after the store at t = 20 freed a DRAM page) reads it and waits
    s.at(20.0)
    for _ in range(70):  # the expired wait is forgotten after a bounded number of steps
        s.at(20.0)
    m = s.cache.match(keys(1, pages=1))
    assert len(s.tiers.books.in_flight(Kind.PREFETCH)) == 1 and s.cache.should_wait(keys(1, pages=1))
    s.at(21.0)
    assert not s.cache.should_wait(keys(1, pages=1)) and first.in_tier(Tier.DRAM)


def learned_server(**kw) -> SimServer:
    """A predictive server that has seen 40 conversations come back 30 s after their first turn."""
    s = SimServer(PredictivePolicy(update_s=1.0, by_turn=False, by_size=False), **kw)
    for k in range(40):
        s.at(float(k))
        s.serve(keys(k, pages=1))
    for k in range(40):
        s.at(k + 30.0)
        s.serve(keys(k, pages=1) + [k * 100 + 50, k * 100 + 51])
    return s


def nvme_only(s: SimServer, ages_s: dict, now_s: float, pages: int = 2) -> dict:
    """Conversations served ``age`` seconds before ``now_s``, then pushed down to NVMe only."""
    convs = {}
    for age, tag in ages_s.items():
        s.at(now_s - age)
        convs[age] = s.serve(keys(tag, pages=pages))
    s.at(now_s)
    s.drop_hbm()
    s.at(now_s + 1.0)  # their stores land
    s.tiers.placement.make_room(Tier.DRAM, s.tiers.books.dram.capacity)  # redundant DRAM copies go
    assert all(n.tiers() == [Tier.NVME] for n in convs.values())
    s.tiers.reads_ahead.reset()  # (what the drop above did to reads ahead is not the workload's doing)
    return convs


def test_reads_for_predicted_returns_rank_the_nearest_return_first():
    s = learned_server(dram_pages=64, nvme_slots=128, write_s=0.01)
    convs = nvme_only(s, {200.0: 60, 25.0: 61, 10.0: 62}, now_s=300.0)
    policy = s.tree.policy
    density = {age: policy.priority(n, Tier.DRAM)[2] for age, n in convs.items()}
    assert density[200.0] == 0.0 < density[10.0] < density[25.0]  # 25 s old: its return is nearest
    tails = returns.plan(s.tree, policy.priority, free_pages=64, max_pages=64, worth=policy.worth_reading)
    assert tails == [[convs[25.0]], [convs[10.0]]]  # the one past its returns is not read at all
    # a budget of 3 pages takes the first (2 pages) only; no free DRAM and no copy to displace: none
    assert returns.plan(s.tree, policy.priority, 64, 3, worth=policy.worth_reading) == [[convs[25.0]]]
    assert returns.plan(s.tree, policy.priority, 0, 64, worth=policy.worth_reading) == []
    # the controller starts them at background priority, within ReadAhead's budget (4 pages)
    before = len(s.submitted)
    assert s.tiers.read_ahead(policy.priority, policy.worth_reading, TIMEOUT_S) == 2
    assert [p for _, p in s.submitted[before:]] == [READ_BACKGROUND, READ_BACKGROUND]
    s.at(s.clock() + 2.0)  # landed: in DRAM, read ahead, not used yet
    assert convs[25.0].in_tier(Tier.DRAM) and convs[10.0].in_tier(Tier.DRAM)
    assert set(s.tiers.reads_ahead.unused) == {convs[25.0].id, convs[10.0].id}


def test_reads_for_predicted_returns_also_bring_store_only_prefixes_into_dram():
    # No NVMe tier; the cluster store holds what this server put there. Pushed out of HBM and
    # DRAM, the conversations are store-only; the next step reads the nearest predicted return
    # store -> DRAM (one GET job, in the background), not the one past its returns.
    s = learned_server(dram_pages=64, nvme_slots=0, store=SimStore())
    convs = {}
    for age, tag in ((200.0, 60), (25.0, 61)):
        s.at(300.0 - age)
        convs[age] = s.serve(keys(tag, pages=2))
    s.at(300.0)  # the last one's DRAM copy lands and its put to the store starts
    s.at(300.5)  # ... and lands
    s.drop_hbm()
    s.tiers.placement.make_room(Tier.DRAM, s.tiers.books.dram.capacity, allow_drop=True)
    s.check()
    assert all(n.tiers() == [Tier.STORE] for n in convs.values()), convs
    s.tiers.reads_ahead.reset()
    before = s.tiers.stats.read_ahead_tokens["started"]
    s.at(301.0)
    assert [(op.kind, op.nodes) for op in s.tiers.books.ops.values()] == [(Kind.GET, [convs[25.0]])]
    assert s.tiers.stats.read_ahead_tokens["started"] - before == 2 * PS
    s.at(303.0)  # landed in DRAM, read ahead and not used yet
    assert convs[25.0].tiers() == [Tier.DRAM, Tier.STORE] and convs[200.0].tiers() == [Tier.STORE]
    assert set(s.tiers.reads_ahead.unused) == {convs[25.0].id}


def test_read_ahead_behind_admission_reads_and_its_budget_follows_its_record():
    s = learned_server(dram_pages=64, nvme_slots=128, write_s=0.01)
    convs = nvme_only(s, {25.0: 61, 10.0: 62, 12.0: 63}, now_s=300.0)
    ra, policy = s.tiers.reads_ahead, s.tree.policy
    # a read a request waits for is in flight: no read ahead starts meanwhile
    s.cache.match(keys(63, pages=2))
    assert s.cache.should_wait(keys(63, pages=2))
    ra.next_s = 0.0
    assert s.tiers.read_ahead(policy.priority, policy.worth_reading, TIMEOUT_S) == 0
    before = len(s.submitted)
    s.at(s.clock() + 1.0)  # the admission read landed; this step's plan reads the other two ahead
    assert [p for _, p in s.submitted[before:]] == [READ_BACKGROUND] * 2
    s.at(s.clock() + 2.0)
    # neither is used and DRAM drops both: trust falls to 0, and reads ahead become probes,
    # one read every PROBE_EVERY_S
    s.tiers.placement.make_room(Tier.DRAM, s.tiers.books.dram.capacity)
    ra.next_s = 0.0
    assert ra.budget(s.clock(), other_reads=False) == ra.max_pages and ra.trust == 0.0 and ra.probing
    ra.planned(s.clock(), started=1)
    assert ra.next_s == s.clock() + returns.PROBE_EVERY_S
    assert ra.budget(s.clock() + 1.0, other_reads=False) == 0
    assert s.tiers.stats.read_ahead_tokens == {"started": 8, "used": 0, "wasted": 8}
    # a read ahead that a request then uses counts for it
    ra.unused[convs[25.0].id] = convs[25.0]
    ra.used([convs[25.0]])
    assert s.tiers.stats.read_ahead_tokens["used"] == 4 and 0.0 < ra.trust < 1.0


def test_plan_ranks_by_the_key_and_displaces_only_lower_ranked_redundant_copies():
    # A tree alone (plan is read-only): X, Y on NVMe only; Z only in the cluster store (another
    # server put it); V and W are DRAM copies also on NVMe. Keys: W 9 > X 5 > Z 4 > Y 3 > V 1.
    tree = TieredRadixTree(PS, LRUPolicy(), clock=SimClock())
    root = tree.root
    nodes = {}
    for name, tag, tiers in (("X", 1, [Tier.NVME]), ("Y", 2, [Tier.NVME]), ("Z", 3, [Tier.STORE]),
                             ("V", 4, [Tier.NVME, Tier.DRAM]), ("W", 5, [Tier.NVME, Tier.DRAM])):
        ids = [f"k{tag}-0", f"k{tag}-1"] if tiers[0] == Tier.STORE else [tag * 10, tag * 10 + 1]
        node = tree.add_child(root, keys(tag), None, tiers[0], ids)
        for extra in tiers[1:]:
            tree.attach(node, extra, [tag * 10 + 5, tag * 10 + 6])
        nodes[name] = node
    rank = {"W": 9, "X": 5, "Z": 4, "Y": 3, "V": 1}
    key = lambda n, tier: (rank[next(k for k, v in nodes.items() if v is n)],)  # noqa: E731
    # no free DRAM: X (2 pages) displaces V (ranked lower); Y would have to displace W: no
    assert returns.plan(tree, key, free_pages=0, max_pages=16) == [[nodes["X"]]]
    # 2 free pages and V: both NVMe prefixes fit; the budget caps them to the first
    assert returns.plan(tree, key, free_pages=2, max_pages=16) == [[nodes["X"]], [nodes["Y"]]]
    assert returns.plan(tree, key, free_pages=2, max_pages=3) == [[nodes["X"]]]
    # from the cluster store: Z, read into free DRAM
    assert returns.plan(tree, key, free_pages=2, max_pages=16, src=Tier.STORE) == [[nodes["Z"]]]
    # the policy's filter decides what is worth reading at all
    assert returns.plan(tree, key, 2, 16, worth=lambda n: n is not nodes["X"]) == [[nodes["Y"]]]


def test_a_scheduler_with_a_request_held_for_its_read_waits_for_the_read_not_in_a_loop():
    """``wait_for_reads`` (the idle scheduler's bounded wait): nothing to wait for unless
    admission held a request for its reads since the last step; then it blocks until the read's
    result arrives (the simulator's clock jumps to it), and the next step lands it."""
    s = SimServer()
    node = s.serve(keys(1))
    s.at(0.0)
    s.drop_hbm()
    s.at(2.0)  # stored to NVMe (1 s per page)
    s.tiers.placement.make_room(Tier.DRAM, s.tiers.books.dram.capacity)  # NVMe only now
    assert node.tiers() == [Tier.NVME]
    assert not s.cache.wait_for_reads(1.0)  # nobody held: no wait, the clock stays
    assert s.clock() == 2.0
    s.cache.match(keys(1))  # admission starts the read (0.5 s per page: lands at 3.0)
    assert s.cache.should_wait(keys(1)) and s.cache.held_for_reads
    assert s.cache.wait_for_reads(5.0)  # blocks until the result: t = 3.0, not 5.0
    assert s.clock() == 3.0 and not s.cache.held_for_reads
    assert not node.in_tier(Tier.DRAM)  # recorded, applied at the next step
    s.at(3.0)
    assert node.in_tier(Tier.DRAM) and not s.cache.should_wait(keys(1))
    assert not s.cache.wait_for_reads(1.0) and s.clock() == 3.0
