"""How long admission held each request, by cause (:mod:`hiradix.core.hold_times`), on the
simulated server (NVMe reads 0.5 s per page): SGLang's admission loop, one attempt per step."""

from __future__ import annotations

from hiradix.core.hold_times import HoldTimes
from hiradix.core.lookahead import QueuedKey
from hiradix.core.node import Tier
from tests.helpers.sim_server import SimServer, keys


def on_nvme(s: SimServer, tokens: list[int], stored_s: float = 5.0) -> None:
    s.compute(tokens)
    s.at(0.0)  # the backup lands in DRAM
    s.drop_hbm()
    s.at(stored_s)  # stored to NVMe
    s.tiers.placement.make_room(Tier.DRAM, s.tiers.books.dram.capacity)
    assert s.tree.match(tokens, split=False, touch=False).nvme_len == len(tokens)


def admit(s: SimServer, tokens: list[int], t0: float, step_s: float = 0.25) -> float:
    """Attempts every ``step_s`` from ``t0`` until admitted; returns when."""
    key, t = QueuedKey(tokens), t0
    while True:
        s.at(t)
        s.cache.match(tokens)
        if not s.cache.should_wait(key):
            return t
        t += step_s


def test_a_request_waiting_for_its_nvme_read_is_charged_to_nvme_read():
    s = SimServer(dram_pages=8)
    tokens = keys(1, pages=3)
    on_nvme(s, tokens)
    admitted_s = admit(s, tokens, 10.0)  # a 3-page read: 1.5 s
    assert admitted_s == 11.5
    assert s.tiers.stats.admission_wait_s == {"nvme_read": 1.5, "store_read": 0.0, "dram_room": 0.0, "store_lookup": 0.0}
    assert s.tiers.stats.held_requests == 1


def test_a_request_whose_read_finds_no_dram_room_is_charged_to_dram_room():
    s = SimServer(dram_pages=2, write_s=10.0)  # stores to NVMe take 10 s per page
    tokens = keys(1, pages=1)
    on_nvme(s, tokens, stored_s=15.0)
    s.clock.advance_to(20.0)
    for tag in (2, 3):  # DRAM fills with two last copies on their way to NVMe (pinned until t = 30)
        s.compute(keys(tag, pages=1))
    s.at(20.0)
    s.drop_hbm()
    assert s.tiers.books.dram.num_free == 0
    admitted_s = admit(s, tokens, 21.0)  # no room for the read: held until its load timeout (2 s)
    assert admitted_s == 23.0
    assert s.tiers.stats.admission_wait_s == {"nvme_read": 0.0, "store_read": 0.0, "dram_room": 2.0, "store_lookup": 0.0}
    assert s.tiers.stats.held_requests == 1


def test_hold_times_charge_each_interval_to_the_cause_that_started_it():
    h = HoldTimes()
    assert h.attempt(1.0, "store_lookup") == (None, 0.0, True)
    assert h.attempt(1.5, "nvme_read") == ("store_lookup", 0.5, False)
    assert h.attempt(2.5, None) == ("nvme_read", 1.0, False)  # admitted
    assert h.attempt(3.0, None) == (None, 0.0, False)
    assert h.attempt(4.0, "nvme_read")[2]  # held again (e.g. after a retraction): a new hold
