"""Histories larger than DRAM, streamed through it (:mod:`hiradix.core.dram_stream`), scripted.

A read lands whole in DRAM before its promotion to HBM, so a history on NVMe larger than DRAM
used to wait its whole load timeout for a read that never started, then recompute everything.
Now the leading nodes that fit are read; once they land, the request's next admission attempt
promotes them to HBM (the request still waits), which frees DRAM for the next ones.

The loop is SGLang's admission per scheduler step on the simulated server (NVMe reads 0.05 s per
page here): ``step``, then per queued request ``match`` (starts reads, streams), ``should_wait`` with
the request's own :class:`QueuedKey`, and admission when it does not wait.
"""

from __future__ import annotations

import itertools

from hiradix.core.ledger import Kind
from hiradix.core.lookahead import QueuedKey
from hiradix.core.node import Tier
from tests.helpers.sim_server import PS, TIMEOUT_S, SimServer

STEP_S = 0.05
READ_S = 0.05  # per page


def server(hbm_tokens: int = 128) -> SimServer:
    return SimServer(dram_pages=4, nvme_slots=64, hbm_tokens=hbm_tokens, read_s=READ_S)


def history_on_nvme(s: SimServer, tag: int, turns: list[int], t: float) -> tuple[list[int], float]:
    """``s.history_on_nvme``, checked: all of it on NVMe only."""
    history, t = s.history_on_nvme(tag, turns, t)
    m = s.tree.match(history, split=False, touch=False)
    assert (m.hbm_len, m.dram_len, m.nvme_len) == (0, 0, len(history))
    return history, t


def admit(s: SimServer, requests: dict[str, list[int]], t0: float, serve: bool = True) -> dict[str, tuple[float, int]]:
    """SGLang's admission loop until every request is admitted (and served, if ``serve``):
    name -> (seconds held, tokens it found cached in HBM or DRAM at admission)."""
    keys = {name: QueuedKey(tokens) for name, tokens in requests.items()}
    queue, out = list(requests), {}
    for i in itertools.count():
        t = t0 + i * STEP_S
        assert t < t0 + 30.0, ("never admitted", queue)
        if not queue:
            return out
        s.at(t)
        for name in list(queue):
            m = s.cache.match(requests[name])
            if s.cache.should_wait(keys[name]):
                continue
            out[name] = (t - t0, m.hbm_len + m.dram_len)
            if serve:
                s.serve(requests[name])
            queue.remove(name)
    return out


def test_a_history_three_times_dram_is_streamed_into_hbm_and_served_whole():
    s = server()
    history, t = history_on_nvme(s, 1, [3, 3, 3], 0.0)  # 9 pages on NVMe, DRAM holds 4
    before = s.tiers.stats.streamed_tokens
    got = admit(s, {"a": history}, t)
    held_s, cached = got["a"]
    assert cached == len(history), got  # all 9 pages: none recomputed (before: 0 cached, 2 s held)
    assert held_s <= TIMEOUT_S, got
    assert s.tiers.stats.streamed_tokens - before == 6 * PS  # two turns promoted while it waited
    s.check()


def test_without_hbm_room_the_request_waits_only_its_timeout_and_keeps_what_dram_holds():
    s = server(hbm_tokens=24)  # 12 pages
    history, t = history_on_nvme(s, 1, [3, 3, 3], 0.0)
    s.clock.advance_to(t)
    running = s.compute([7] * 10 * PS)  # a running request holds 10 of them
    s.cache.lock(running)
    got = admit(s, {"a": history}, t, serve=False)
    held_s, cached = got["a"]
    # the first turn's read lands; its promotion needs 3 HBM pages, 2 are free, none evictable: it
    # cannot stream further, and is admitted at its deadline with the part DRAM holds
    assert s.tiers.stats.streamed_tokens == 0 and cached == 3 * PS, got
    assert TIMEOUT_S - STEP_S <= held_s <= TIMEOUT_S + STEP_S, got
    s.cache.unlock(running)
    s.check()


def test_two_requests_larger_than_dram_together_are_both_served_whole():
    s = server()
    a, t = history_on_nvme(s, 1, [2, 2, 2], 0.0)
    b, t = history_on_nvme(s, 2, [3, 3], t)
    got = admit(s, {"a": a, "b": b}, t)
    assert got["a"][1] == len(a) and got["b"][1] == len(b), got
    assert max(held for held, _ in got.values()) <= TIMEOUT_S, got
    assert not s.tiers.books.in_flight(Kind.PREFETCH)
    s.check()


def test_later_dram_copies_that_fill_dram_make_room_for_the_first_node_on_nvme():
    """A break-it review's case: the history's first turn is on NVMe only, its later turns are in
    DRAM (and on NVMe) and fill DRAM. The request's own DRAM copies were all held, so the read of
    its first turn found no room: it waited its whole timeout, then recomputed all of it. Copies
    beyond the first DRAM's worth of its history that NVMe also holds may go now."""
    s = server()
    history, t = history_on_nvme(s, 1, [2, 2, 2], 0.0)  # 6 pages, DRAM 4
    nodes = s.tree.match(history, split=False, touch=False).nodes
    s.tiers.prefetch(list(nodes[1:]), TIMEOUT_S, ahead=True)  # the later turns back in DRAM
    s.at(t + 1.0)
    assert [n.tiers() for n in nodes] == [[Tier.NVME], [Tier.DRAM, Tier.NVME], [Tier.DRAM, Tier.NVME]]
    assert s.tiers.books.dram.num_free == 0
    got = admit(s, {"a": history}, t + 1.0)
    held_s, cached = got["a"]
    assert cached == len(history) and held_s < TIMEOUT_S, got  # before: 0 cached after 2.0 s held
    s.check()
