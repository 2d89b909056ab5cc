"""Reads about to land are waited for before a prefill batch forms (:mod:`hiradix.core.read_landing`).

The simulated server's NVMe reads take ``read_s`` per page on its virtual clock; admission is
SGLang's: ``match`` (starts the read), ``should_wait`` with the request's :class:`QueuedKey`.
"""

from __future__ import annotations

import pytest

from hiradix.core.ledger import Kind
from hiradix.core.lookahead import QueuedKey
from hiradix.core.read_landing import LAND_WAIT_S, MAX_WAITED_IDS, MIN_LANDED_SHARE, PROBE_EVERY, ReadLanding
from tests.helpers.sim_server import SimServer


def held_on_nvme(read_s: float) -> tuple[SimServer, list[int], QueuedKey]:
    """A server whose next request's 2-page history is on NVMe only, its read just started."""
    s = SimServer(dram_pages=8, nvme_slots=32, read_s=read_s)
    history, t = s.history_on_nvme(1, [2], 0.0)
    s.at(t)
    prompt = history + [7, 7]
    key = QueuedKey(prompt)
    s.cache.match(prompt)  # admission: the read into DRAM starts
    assert s.cache.should_wait(key) and s.tiers.books.in_flight(Kind.PREFETCH)  # (its peek fills key.nodes)
    return s, prompt, key


def test_a_read_about_to_land_joins_this_batch():
    s, prompt, key = held_on_nvme(read_s=0.004)  # 2 pages: lands 8 ms later
    t0 = s.clock()
    assert s.cache.land_queued_reads([key], LAND_WAIT_S)
    assert s.clock() - t0 == pytest.approx(0.008)  # waited for the read, not the whole bound
    assert not s.cache.should_wait(key)
    m = s.cache.match(prompt)
    assert (m.hbm_len, m.dram_len) == (0, 4)  # the history is in DRAM for this batch's load-back
    s.check()


def test_a_slow_read_is_waited_for_once_at_most_the_bound_then_held_as_before():
    s, prompt, key = held_on_nvme(read_s=0.5)  # lands after 1 s
    t0 = s.clock()
    assert s.cache.land_queued_reads([key], LAND_WAIT_S)
    assert s.clock() - t0 == pytest.approx(LAND_WAIT_S)
    assert s.cache.should_wait(key)  # not landed: held, the batch goes without it
    t1 = s.clock()
    assert not s.cache.land_queued_reads([key], LAND_WAIT_S) and s.clock() == t1  # never waited for twice
    s.at(t0 + 1.01)
    assert not s.cache.should_wait(key)


def test_only_the_queue_heads_reads_are_waited_for():
    s, prompt, key = held_on_nvme(read_s=0.004)
    other = QueuedKey([5, 5, 5, 5])  # a request at the head that waits for no read
    t0 = s.clock()
    assert not s.cache.land_queued_reads([other], LAND_WAIT_S) and s.clock() == t0  # not its read: no wait, no step
    assert s.cache.should_wait(key)
    assert s.cache.land_queued_reads([other, key], LAND_WAIT_S)
    assert not s.cache.should_wait(key)


def test_where_waits_keep_timing_out_a_rank_stops_waiting_but_probes():
    landing = ReadLanding()
    assert landing.worth_waiting()
    for _ in range(10):
        landing.note(0, 1)  # every read waited for missed the bound
    assert landing.landed_share < MIN_LANDED_SHARE
    choices = [landing.worth_waiting() for _ in range(2 * PROBE_EVERY)]
    assert choices.count(True) == 2 and choices[PROBE_EVERY - 1] and choices[-1]  # one probe in PROBE_EVERY
    for _ in range(10):
        landing.note(1, 1)  # reads land in time again
    assert landing.worth_waiting()


def test_a_slow_server_steps_without_waiting_once_waits_stop_paying():
    s, prompt, key = held_on_nvme(read_s=0.5)
    s.tiers.landing.landed_share = 0.0  # its reads have kept missing the bound
    t0 = s.clock()
    assert s.cache.land_queued_reads([key], LAND_WAIT_S)  # it still steps (agreed), but does not block
    assert s.clock() == t0 and s.cache.should_wait(key)


def test_nothing_in_flight_waits_nothing_and_background_reads_are_not_waited_for():
    s = SimServer()
    t0 = s.clock()
    assert not s.cache.land_queued_reads([QueuedKey([1, 2, 3, 4])], LAND_WAIT_S) and s.clock() == t0

    class Op:
        def __init__(self, op_id, kind):
            self.op_id, self.kind = op_id, kind

    class Node:
        ops = {1, 2, 3, 4, 5}

    landing = ReadLanding()
    ops = {op.op_id: op for op in (Op(1, Kind.PREFETCH), Op(2, Kind.GET), Op(3, Kind.PREFETCH), Op(4, Kind.BACKUP),
                                   Op(5, Kind.PUT), Op(6, Kind.PREFETCH))}
    assert landing.to_wait_for([Node()], ops, background={3}) == {1, 2}  # the head's reads into DRAM, not background
    assert landing.to_wait_for([Node()], ops, background={3}) == set()  # each once

    class Each:
        def __init__(self, i):
            self.ops = {i}

    for i in range(10, 10 + MAX_WAITED_IDS + 5):
        landing.to_wait_for([Each(i)], {i: Op(i, Kind.PREFETCH)}, ())
    assert len(landing._waited) == MAX_WAITED_IDS  # bounded memory
