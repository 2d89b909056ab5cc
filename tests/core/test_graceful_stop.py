"""A graceful stop (issue 30, item 3), scripted: the writes in flight land or are counted lost,
bounded; the durable index never lists an orphan; a TP group drains in lockstep.

The real prefix cache, tier controller, ledger and durable index (a journal file in ``tmp_path``)
run over the data-less ports (:mod:`hiradix.testing.sim_ports`): NVMe writes take
``WRITE_S`` seconds per page on a virtual clock, so which writes are in flight when the stop is
asked for is decided by the script, and the drain's deadline passes on that clock. After the stop
the journal is reopened as a restart reopens it: every page it lists is re-indexed, none is an
orphan, and each listed slot holds the tokens the stopped tree had there.
"""

from __future__ import annotations

import logging

import pytest

from hiradix.core.controller import TierController
from hiradix.core.plan import TierPlan
from hiradix.core.ledger import Kind, TierBooks
from hiradix.core.node import Tier
from hiradix.core.policy import make_policy
from hiradix.core.prefix_cache import TieredPrefixCache
from hiradix.core.tree import TieredRadixTree
from hiradix.persistence.index import INDEX_FILE_NAME, NvmeIndex, Put, _read_records
from hiradix.persistence.journal import IndexJournal, restore
from hiradix.testing.sim_ports import SimClock, SimDevicePool, SimHostMover, SimIOClient
from tests.helpers.core import serve_request

PS = 2  # tokens per page
FP = {"model": "m", "page_size": str(PS)}
NVME_SLOTS, DRAM_PAGES, HBM_TOKENS = 64, 8, 48
WRITE_S = 0.5  # NVMe write time per page, in (virtual) seconds
STOP_TIMEOUT_S = 10.0


class Server:
    """One TP rank's cache over the data-less ports, with a durable index in ``directory``."""

    def __init__(self, directory, write_s: float = WRITE_S, sync=None, timeout_s: float = STOP_TIMEOUT_S):
        self.clock = SimClock()
        self.tree = TieredRadixTree(PS, make_policy("lru"), clock=self.clock)
        self.books = TierBooks(self.tree, DRAM_PAGES, NVME_SLOTS)
        self.index, pages = NvmeIndex.open(directory, FP, NVME_SLOTS, PS)
        self.restored = restore(self.tree, self.books, pages)
        self.client = SimIOClient(self.clock, read_s_per_page=0.1, write_s_per_page=write_s)
        self.tiers = TierController(self.tree, self.books, SimHostMover(), self.client,
                                    TierPlan.uniform(64, DRAM_PAGES, NVME_SLOTS, stop_timeout_s=timeout_s),
                                    clock=self.clock, sync=sync, journal=IndexJournal(self.index, self.tree))
        self.device = SimDevicePool(HBM_TOKENS, PS)
        self.cache = TieredPrefixCache(self.tree, self.device, self.tiers)

    def serve(self, tokens: list[int]) -> None:
        """A request: its hits loaded back, the rest computed, inserted, finished; then a step."""
        serve_request(self.cache, tokens)
        self.step()

    def step(self, dt_s: float = 0.1) -> None:
        self.clock.advance_to(self.clock() + dt_s)
        self.cache.step()
        self.cache.check_integrity(0, used_tokens=self.device.num_used_tokens())

    def writes(self) -> list:
        return [op for op in self.books.ops.values() if op.kind == Kind.DEMOTE]

    def nvme_pages(self) -> dict[int, tuple[int, ...]]:
        """NVMe slot -> the tokens of the page the tree holds there."""
        out = {}
        for node in self.tree.iter_nodes():
            for k, slot in enumerate(node.ids_in(Tier.NVME) or ()):
                out[slot] = tuple(node.tokens[k * PS : (k + 1) * PS])
        return out


def conversation(s: int, turns: int) -> list[int]:
    """Session s after ``turns`` turns: a shared 2-page system prompt, then 3 pages a turn."""
    return [1, 2, 3, 4] + [100 * s + i for i in range(3 * PS * turns)]


def churn(server: Server) -> None:
    """Six sessions, three turns each, turn by turn: HBM (24 pages) and DRAM (8) overflow to NVMe."""
    for turn in range(1, 4):
        for s in range(6):
            server.serve(conversation(s, turn))


def reopen(directory, caplog) -> tuple[Server, dict[int, tuple[int, ...]]]:
    """The restart: the journal's listed pages (slot -> tokens), re-indexed into a fresh tree."""
    records, _ = _read_records((directory / INDEX_FILE_NAME).read_bytes(), directory / INDEX_FILE_NAME)
    listed: dict[int, tuple[int, ...]] = {}
    for r in records:
        if isinstance(r, Put):
            listed[r.slot] = tuple(r.tokens)
        elif not isinstance(r, Put) and hasattr(r, "slots"):
            for slot in r.slots:
                listed.pop(slot, None)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hiradix.persistence.index"):
        again = Server(directory)
    assert "(0 orphan pages dropped)" in caplog.text, caplog.text
    return again, listed


def test_stop_mid_demotion_keeps_every_write_in_flight_and_the_restart_reads_them_all(tmp_path, caplog):
    server = Server(tmp_path)
    churn(server)
    in_flight = server.writes()
    pages = sum(len(op.src_ids) for op in in_flight)
    assert len(in_flight) >= 2  # the stop comes mid-demotion
    server.tiers.stop.request()  # SIGTERM
    server.step()  # agreed (one rank): no new transfer below DRAM from here on
    assert server.tiers.stop.agreed and len(server.writes()) == len(in_flight)
    with caplog.at_level(logging.INFO, logger="hiradix.core.graceful_stop"):
        report = server.tiers.drain()
    assert "hiradix: stop: NVMe writes in flight" in caplog.text
    assert (report.nvme_jobs, report.nvme_pages, report.nvme_failed) == (len(in_flight), pages, 0)
    assert report.nvme_landed == pages + report.ancestor_pages == report.nvme_kept and report.nvme_lost == 0
    assert not report.timed_out and report.elapsed_s <= STOP_TIMEOUT_S and not server.writes()
    assert server.tiers.drain() is report  # once
    had = server.nvme_pages()
    server.tiers.close()
    assert report.listed_pages == server.index.num_pages
    again, listed = reopen(tmp_path, caplog)
    # every listed page is re-indexed, each slot with the page the stopped tree had there
    assert again.restored == len(listed) == report.listed_pages > 0
    assert again.nvme_pages() == listed and all(had[slot] == tokens for slot, tokens in listed.items())
    again.cache.check_integrity(0, used_tokens=0)


def test_writes_that_do_not_land_within_the_bound_are_lost_and_nothing_is_misread(tmp_path, caplog):
    server = Server(tmp_path, write_s=100.0)  # a disk that takes 100 s a page
    churn(server)
    pages = sum(len(op.src_ids) for op in server.writes())
    assert pages
    server.tiers.stop.request()
    asked_s = server.clock()
    server.step()
    report = server.tiers.drain()
    assert report.timed_out and server.clock() - asked_s <= STOP_TIMEOUT_S + 0.2  # bounded, from the request
    assert report.nvme_kept == 0 and report.nvme_lost == report.nvme_pages + report.ancestor_pages >= pages
    server.tiers.close()
    again, listed = reopen(tmp_path, caplog)
    assert again.restored == len(listed) == report.listed_pages  # what landed before the stop


def test_a_child_landed_before_its_parent_waits_and_the_stop_writes_the_parent_first(tmp_path, caplog):
    server = Server(tmp_path)
    for s in (1, 2):  # two sessions under one system prompt: [1..4] | [10x..]
        server.serve(conversation(s, 1))
    for _ in range(3):  # the write-through backups land: every node in HBM and DRAM
        server.step()
    parent = server.tree.match([1, 2, 3, 4]).nodes[-1]
    children = list(parent.children.values())
    assert parent.tiers() == [Tier.HBM, Tier.DRAM] and len(children) == 2
    for child in children:  # the leaves go down first (as eviction's order sends them)
        server.tiers.nvme.submit_store(server.tiers.placement.prepare(Kind.DEMOTE, [child]))
    server.tiers.stop.request()
    server.step()
    report = server.tiers.drain()
    # the children landed first and waited; the stop wrote their parent, then listed all three
    assert report.nvme_pages == 6 and report.ancestor_pages == 2 and report.nvme_kept == 8 and report.nvme_lost == 0
    server.tiers.close()
    records, _ = _read_records((tmp_path / INDEX_FILE_NAME).read_bytes(), tmp_path)
    puts = [r.tokens for r in records if isinstance(r, Put)]
    assert puts[:2] == [[1, 2], [3, 4]] and len(puts) == 8  # parent pages before any child page
    again, listed = reopen(tmp_path, caplog)
    assert again.restored == 8


def test_sigkill_after_a_child_landed_before_its_parent_leaves_no_orphan(tmp_path, caplog):
    server = Server(tmp_path)
    server.serve(conversation(1, 1))
    server.serve(conversation(2, 1))
    for _ in range(3):
        server.step()
    parent = server.tree.match([1, 2, 3, 4]).nodes[-1]
    child = next(iter(parent.children.values()))
    server.tiers.nvme.submit_store(server.tiers.placement.prepare(Kind.DEMOTE, [child]))
    server.clock.advance_to(server.clock() + 10 * WRITE_S)
    server.cache.step()  # the child landed: in the tree on NVMe, waiting in the index
    assert child.in_tier(Tier.NVME) and not parent.in_tier(Tier.NVME)
    assert server.index.waiting_pages == 3 and server.index.num_pages == 0
    server.index.close()  # SIGKILL now: what is in the file is all a restart sees
    again, listed = reopen(tmp_path, caplog)
    assert again.restored == 0 and listed == {}


def test_a_flush_before_the_stop_leaves_nothing_to_keep(tmp_path, caplog):
    server = Server(tmp_path)
    churn(server)
    assert server.writes()
    server.cache.reset()  # /flush_cache: the writes in flight are quarantined, every slot freed
    server.device = server.cache.device = SimDevicePool(HBM_TOKENS, PS)  # SGLang resets its allocator
    server.tiers.stop.request()
    server.step()
    report = server.tiers.drain()
    assert report.flushed_jobs > 0 and report.nvme_jobs == 0 and report.listed_pages == 0
    server.tiers.close()
    again, listed = reopen(tmp_path, caplog)
    assert again.restored == 0 and listed == {}


@pytest.fixture
def two_ranks(tmp_path):
    from tests.helpers.ranks import ThreadRanks

    group = ThreadRanks(2)
    ranks = []
    for r in range(2):
        (tmp_path / f"rank{r}").mkdir()
        ranks.append(Server(tmp_path / f"rank{r}", sync=group.sync(r)))
    yield ranks, group
    group.close()


def test_a_stop_asked_on_one_tp_rank_drains_every_rank_in_lockstep(two_ranks):
    (r0, r1), group = two_ranks
    for turn in range(1, 4):
        for s in range(6):  # the same requests on both ranks, whose steps agree
            group.run([lambda r=r: r.serve(conversation(s, turn)) for r in (r0, r1)])
    assert r0.writes()
    r0.tiers.stop.request()  # rank 1 did not see SIGTERM (yet)
    group.run([r.step for r in (r0, r1)])
    assert r0.tiers.stop.agreed and r1.tiers.stop.agreed
    reports = group.run([r.tiers.drain for r in (r0, r1)])  # a rank alone in a collective would fail
    assert reports[0].nvme_kept == reports[1].nvme_kept == reports[0].nvme_pages + reports[0].ancestor_pages > 0
    assert r0.nvme_pages() == r1.nvme_pages() and not r0.writes() and not r1.writes()
