"""Eager write-back of DRAM's last copies to a full NVMe tier, on a simulated server.

A CI run of the MLA TP 2 restart test waited 120 s for "no transfer in flight" on an idle server:
one NVMe store was always in flight. With NVMe full of pages DRAM also held, each store of a
DRAM last copy made its room by dropping another node's NVMe copy, which made that node's DRAM
copy a last copy, stored at the next step by dropping the first one's: two nodes displaced each
other at every step, forever. Here 8 requests of 2 pages pass through HBM of 4 pages, DRAM of 16
and NVMe of 4 (NVMe writes 0.1 s per page); then the server idles for 100 s.
"""

from __future__ import annotations

import pytest

from hiradix.core.node import Tier
from tests.helpers.sim_server import SimServer, keys

IDLE_STEPS = 200  # one step every 0.5 s


def run(dram_free_low_pages: int):
    """The scenario; returns the server, the request nodes, and the start times of the NVMe
    stores while busy and while idle (from t = 1 s)."""
    s = SimServer(dram_pages=16, nvme_slots=4, hbm_tokens=8, write_s=0.1, read_s=0.1,
                  dram_free_low_pages=dram_free_low_pages)
    t, busy, idle = 0.0, [], []
    submit = s.io.submit_store

    def spy(job_id, dram_pages, nvme_slots):
        (idle if t >= 1.0 else busy).append(t)
        submit(job_id, dram_pages, nvme_slots)

    s.io.submit_store = spy
    nodes = []
    for tag in range(1, 9):
        nodes.append(s.compute(keys(tag, 2)))
        t += 0.05
        s.at(t)
    t = 1.0
    for _ in range(IDLE_STEPS):
        s.at(t)
        t += 0.5
    return s, nodes, busy, idle


@pytest.mark.parametrize("dram_free_low_pages", [0, 4])  # DRAM never short / the default 25%
def test_an_idle_server_stops_writing_once_nvme_is_full_of_pages_dram_also_holds(dram_free_low_pages):
    s, nodes, busy, idle = run(dram_free_low_pages)
    assert s.tiers.books.nvme.num_free == 0 and busy  # NVMe filled while busy
    # what the last busy steps left lands in the first idle second, then nothing; before the
    # fix: 400 stores in 100 s, two nodes swapping places to the end
    assert len(idle) <= 1 and all(t < 2.0 for t in idle), idle
    assert not s.tiers.books.in_flight()
    # the pages DRAM holds alone stay there, and NVMe holds pages DRAM also holds
    sole_dram = [n for n in nodes if n.alive and n.tiers() == [Tier.DRAM]]
    both = [n for n in nodes if n.alive and n.tiers() == [Tier.DRAM, Tier.NVME]]
    assert len(sole_dram) >= 2 and len(both) == 2, [n.tiers() for n in nodes]


def test_a_short_dram_still_moves_its_last_copies_down_a_full_nvme():
    # DRAM always short: every landed store leaves DRAM, so a full NVMe drops its own least
    # valuable pages for DRAM's (AttentionStore's chain down the tiers), and then it is done.
    s, nodes, _, idle = run(dram_free_low_pages=16)
    assert len(idle) == 3 and max(idle) < 2.0, idle  # the stores the last busy steps left, then none
    assert not s.tiers.books.in_flight()
    assert [n.tiers() for n in nodes if n.alive] == [[Tier.NVME], [Tier.NVME], [Tier.HBM, Tier.DRAM],
                                                      [Tier.HBM, Tier.DRAM]]
    assert [n.alive for n in nodes] == [False] * 4 + [True] * 4  # the least recent went
