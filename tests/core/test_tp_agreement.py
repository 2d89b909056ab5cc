"""TP agreement on the two rank-local switches (issue 30, item 4), scripted with two simulated ranks.

Two ranks of one TP group, each the real prefix cache, controller, ledger and store tier over
the data-less ports, run the same requests; their steps run at once on two threads and agree
through the real agreement (:class:`hiradix.core.agreement.ReducedAgreement`) over a barrier
(:class:`tests.helpers.ranks.ThreadRanks`). Two rank-local signals try to split them:

* rank 0's I/O worker dies every 6 steps; its fourth death disables its client (rank 1's lives);
* rank 1's clock runs 1.6x as fast as rank 0's, so its wait before trying the switched-off store
  again is over about 11 steps earlier.

Expected: after every step both ranks' books are identical (nodes with their tiers, page and
slot ids, transfers in flight, NVMe and store on/off); NVMe goes off on both in the step rank 0's
client gives up; the store is tried again on both in the step rank 0's wait ends, not rank 1's.
"""

from __future__ import annotations

import pytest

from hiradix.core.controller import TierController
from hiradix.core.plan import TierPlan
from hiradix.core.ledger import TierBooks
from hiradix.core.node import Tier
from hiradix.core.policy import make_policy
from hiradix.core.prefix_cache import TieredPrefixCache
from hiradix.core.store_tier import STORE_RETRY_S
from hiradix.core.tree import TieredRadixTree
from hiradix.testing.sim_ports import SimClock, SimDevicePool, SimHostMover, SimStore
from tests.helpers.ranks import DyingIOClient, ThreadRanks
from tests.helpers.core import serve_request

PS = 2  # tokens per page
TIMEOUT_S = 2.0
IO_S = 0.5  # every I/O job's time per page (and per lookup), in seconds of the rank's clock
CLOCK_RATE = (1.0, 1.6)  # seconds per step on each rank's clock: rank 1's runs ahead
KILL_EVERY = 6  # steps between rank 0's worker deaths
STEPS = 70


class Rank:
    """One TP rank: the prefix cache over data-less ports, its own clock and (dying) I/O client."""

    def __init__(self, rank: int, ranks: ThreadRanks):
        self.clock = SimClock()
        self.tree = TieredRadixTree(PS, make_policy("lookahead"), clock=self.clock)
        books = TierBooks(self.tree, 8, 64)  # DRAM 8 pages, NVMe 64 slots
        self.client = DyingIOClient(self.clock, IO_S, IO_S, SimStore(), IO_S, IO_S, IO_S)
        self.tiers = TierController(self.tree, books, SimHostMover(), self.client,
                                    TierPlan.uniform(64, 8, 64, store_key_prefix=f"rank{rank}/"),
                                    clock=self.clock, sync=ranks.sync(rank))
        self.device = SimDevicePool(48, PS)  # HBM 48 tokens: every few requests evict
        self.cache = TieredPrefixCache(self.tree, self.device, self.tiers, load_timeout_s=TIMEOUT_S)
        self.rate = CLOCK_RATE[rank]

    def step(self, k: int) -> None:
        self.clock.advance_to(k * self.rate)
        self.cache.step()
        self.cache.check_integrity(0, used_tokens=self.device.num_used_tokens())

    def serve(self, tokens: list[int]) -> None:
        """A request: its HBM hit, its DRAM part loaded back, the rest computed; inserted, finished."""
        serve_request(self.cache, tokens)

    def books(self) -> dict:
        """What must be the same on every rank (HBM slots excepted: each rank's device pool)."""
        b, store = self.tiers.books, self.tiers.store
        nodes = sorted((n.id, n.num_tokens, tuple(n.tiers()), tuple(n.dram_pages or ()), tuple(n.nvme_slots or ()))
                       for n in self.tree.iter_nodes())
        return {"nodes": nodes, "tier_tokens": list(self.tree.tier_tokens), "in_flight": sorted(b.pending_ids()),
                "nvme_on": b.nvme_enabled, "store_on": store.enabled, "store_switch_offs": store.counts["switch_offs"]}


def prompt(k: int) -> list[int]:
    """Step k's request: session k % 5, whose history grows by a page a turn (wrapping after 7)."""
    session, turn = k % 5, k // 5
    return [session * 1000 + i for i in range(PS * (2 + turn % 7))]


@pytest.fixture
def ranks():
    group = ThreadRanks(2)
    yield [Rank(0, group), Rank(1, group)], group
    group.close()


def test_worker_deaths_on_one_rank_and_a_clock_ahead_on_another_never_split_the_books(ranks):
    (r0, r1), group = ranks
    history = []
    due_apart = 0  # steps after which rank 1's store wait was over and rank 0's was not
    for k in range(1, STEPS + 1):
        if k % KILL_EVERY == 0 and not r0.client.disabled:
            r0.client.kill()  # deaths 1-3: respawned; death 4 (step 24): rank 0's client gives up
        for r in (r0, r1):
            r.serve(prompt(k))
        group.run([lambda r=r: r.step(k) for r in (r0, r1)])
        books = [r.books() for r in (r0, r1)]
        assert books[0] == books[1], f"step {k}: the ranks' books split"
        history.append(books[0])
        due_apart += r1.tiers.store.retry_due() and not r0.tiers.store.retry_due()
    assert r0.client.deaths == 4 and r0.client.disabled and not r1.client.disabled and r1.client.check_alive()
    # NVMe off on both ranks in the step rank 0's client gave up (its 4th death, step 24)
    assert [h["nvme_on"] for h in history].index(False) == 4 * KILL_EVERY - 1
    assert r0.tiers.nvme.off_reason == "the I/O worker keeps dying"
    assert r1.tiers.nvme.off_reason == "another TP rank's I/O worker keeps dying"
    assert r0.tree.tier_tokens[Tier.NVME] == 0
    # the store: off with the worker, tried again only once rank 0's clock said so
    off = [k for k, h in enumerate(history, 1) if not h["store_on"]]
    retried = [k for k, h in enumerate(history, 1) if h["store_on"] and k > off[0]]
    assert retried, "the store was never tried again"
    # switched off in step off[0]: rank 0's wait ends 30 steps later, rank 1's after 19 steps
    assert retried[0] == off[0] + STORE_RETRY_S / CLOCK_RATE[0]
    assert due_apart >= 10  # steps in which rank 1 alone would have tried the store again
