"""SIGTERM in SGLang's processes (issue 30, item 3): the scheduler's handler and the launcher's watchdog.

* :class:`hiradix.sglang_plugin.stop.SchedulerStop` in this (the test's main) thread, over the
  real tier controller on the data-less ports: a real SIGTERM with no write in flight does at
  once what the previous handler does; with writes in flight it only asks for a stop, the next
  step agrees on it and ``after_step`` drains, closes and then hands over to the previous handler.
* :func:`hiradix.sglang_plugin.stop.around_check_processes` over stand-in processes: SGLang's
  watchdog is skipped only while the launcher stops on SIGTERM, children died of SIGTERM and a
  scheduler still runs.
"""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from hiradix.core.controller import TierController
from hiradix.core.plan import TierPlan
from hiradix.core.ledger import Kind, TierBooks
from hiradix.core.tree import TieredRadixTree
from hiradix.sglang_plugin import stop
from hiradix.testing.sim_ports import SimClock, SimHostMover, SimIOClient

PS = 2


class Cache:
    """What SchedulerStop sees of ``TieredRadixCache``: ``tiers`` and ``release_host_resources``."""

    def __init__(self):
        self.clock = SimClock()
        tree = TieredRadixTree(PS, clock=self.clock)
        self.tiers = TierController(tree, TierBooks(tree, 8, 8), SimHostMover(),
                                    SimIOClient(self.clock, read_s_per_page=0.1, write_s_per_page=1.0),
                                    TierPlan.uniform(64, 8, 8, stop_timeout_s=10.0), clock=self.clock)
        self.released = False

    def release_host_resources(self):
        self.tiers.drain()
        self.tiers.close()
        self.tiers, self.released = None, True

    def write_in_flight(self):
        """A node backed up to DRAM, on its way to NVMe."""
        tiers = self.tiers
        _, node, _ = tiers.tree.insert([1, 2, 3, 4], list(range(4)))
        tiers.backups.after_insert([node])
        tiers.step()  # the backup lands
        op = tiers.placement.prepare(Kind.DEMOTE, [node])
        tiers.nvme.submit_store(op)
        return op


@pytest.fixture
def previous():
    """A SIGTERM handler standing for what was there before (hiradix's shm cleanup, then death)."""
    calls = []
    saved = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    yield calls
    signal.signal(signal.SIGTERM, saved)


def test_sigterm_without_writes_in_flight_hands_over_at_once(previous):
    cache = Cache()
    handler = stop.SchedulerStop(cache)
    os.kill(os.getpid(), signal.SIGTERM)
    assert previous == [signal.SIGTERM] and cache.tiers.stop.requested_s is None
    assert not handler.after_step() and not cache.released


def test_sigterm_with_writes_in_flight_drains_at_the_next_step_then_hands_over(previous):
    cache = Cache()
    handler = stop.SchedulerStop(cache)
    op = cache.write_in_flight()
    os.kill(os.getpid(), signal.SIGTERM)
    assert previous == [] and cache.tiers.stop.requested_s is not None  # asked, not ended
    assert not handler.after_step()  # not agreed before a step
    tiers = cache.tiers
    tiers.step()
    assert tiers.stop.agreed and handler.after_step()
    assert cache.released and previous == [signal.SIGTERM]
    report = tiers.stop.report
    assert (report.nvme_jobs, report.nvme_landed) == (1, len(op.src_ids)) and not report.timed_out


def test_under_tp_sigterm_without_writes_ends_at_the_step_end_not_in_the_handler(previous):
    cache = Cache()
    # two ranks as far as this one can tell (the agreement of one: its own outcomes)
    cache.tiers.sync = SimpleNamespace(size=2, agree=lambda pending, local, expired, *votes: (local, expired, *votes))
    handler = stop.SchedulerStop(cache)
    os.kill(os.getpid(), signal.SIGTERM)
    assert previous == []  # a peer may be in a collective with this rank: not here
    tiers = cache.tiers
    tiers.step()
    assert handler.after_step() and previous == [signal.SIGTERM] and not cache.released
    report = tiers.stop.report  # the stop line, logged with nothing to wait for
    assert report is not None and (report.nvme_jobs, report.put_jobs, report.elapsed_s) == (0, 0, 0.0)


def test_a_second_sigterm_ends_at_once(previous):
    cache = Cache()
    stop.SchedulerStop(cache)
    cache.write_in_flight()
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    assert previous == [signal.SIGTERM] and not cache.released


class Proc:
    def __init__(self, exitcode):
        self.exitcode = exitcode

    def is_alive(self):
        return self.exitcode is None


def watchdog(*codes):
    """SGLang's ``SubprocessWatchdog`` as the hook sees it: the schedulers, then the detokenizer."""
    names = [f"scheduler_{i}" for i in range(len(codes) - 1)] + ["detokenizer"]
    return SimpleNamespace(_processes=[Proc(c) for c in codes], _names=names)


@pytest.mark.parametrize(
    "stopping, codes, skipped",
    [
        (True, (None, -signal.SIGTERM), True),  # the detokenizer died of the group's SIGTERM; the scheduler drains
        (True, (-signal.SIGTERM, -signal.SIGTERM), False),  # the scheduler is done: SGLang cleans up
        (True, (None, 1), False),  # a crash is a crash
        (False, (None, -signal.SIGTERM), False),  # SIGTERM to the detokenizer alone
        (True, (None, None), False),  # nothing ended
    ],
)
def test_the_launcher_watchdog_waits_only_for_schedulers_draining_at_a_stop(monkeypatch, stopping, codes, skipped):
    monkeypatch.setattr(stop, "SIGTERM_RACE_S", 0.01)
    monkeypatch.setattr(stop, "_launcher_stopping", type(stop._launcher_stopping)())
    if stopping:
        stop.after_sigterm_handler(None, None)
    result = stop.around_check_processes(lambda w: "SGLang's check", watchdog(*codes))
    assert result == (False if skipped else "SGLang's check")
