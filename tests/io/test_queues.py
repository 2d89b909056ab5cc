"""The I/O worker's priority pool (hiradix.io.queues) and its use for NVMe jobs (issue 12).

The pool's order is proved with events (a job parks the only thread until released); the
worker's with a slow-write fault: a read sent after two writes lands before the second.
"""

from __future__ import annotations

import threading

import msgspec
import pytest

from hiradix.io.client import IOWorkerClient
from hiradix.io.protocol import (PRIORITY_ADMISSION, PRIORITY_BACKGROUND, PRIORITY_QUEUED, GetStore, PutStore,
                                 QueryStore, StorePages, validate_job)
from hiradix.io.queues import PriorityExecutor
from hiradix.io.worker import store_priority
from tests.helpers.io import WAIT_S, fill, wait_for


def test_waiting_jobs_run_most_urgent_first_fifo_among_equals():
    pool = PriorityExecutor(1, thread_name_prefix="test")
    started, release, order = threading.Event(), threading.Event(), []

    def park():
        started.set()
        assert release.wait(WAIT_S)
        return "parked"

    first = pool.submit(PRIORITY_BACKGROUND, park)
    assert started.wait(WAIT_S)  # the only thread is busy: everything below waits
    futures = [pool.submit(prio, order.append, name) for prio, name in (
        (PRIORITY_BACKGROUND, "write 1"), (PRIORITY_BACKGROUND, "write 2"), (PRIORITY_QUEUED, "queued read"),
        (PRIORITY_ADMISSION, "admission read"), (PRIORITY_QUEUED, "queued read 2"))]
    release.set()
    assert first.result(WAIT_S) == "parked"
    for f in futures:
        f.result(WAIT_S)
    assert order == ["admission read", "queued read", "queued read 2", "write 1", "write 2"]
    pool.shutdown()


def test_shutdown_cancels_waiting_jobs_and_lets_the_running_one_finish():
    pool = PriorityExecutor(1)
    started, release = threading.Event(), threading.Event()
    running = pool.submit(0, lambda: (started.set(), release.wait(WAIT_S))[1])
    assert started.wait(WAIT_S)
    waiting = pool.submit(0, lambda: "never")
    cancelled = []
    waiting.add_done_callback(lambda f: cancelled.append(f.cancelled()))
    pool.shutdown(wait=False, cancel_futures=True)
    assert cancelled == [True]  # its done-callback ran: the worker answers it as a failure
    release.set()
    assert running.result(WAIT_S) is True
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(0, print)
    pool.shutdown(wait=True)


def test_exceptions_reach_the_future():
    pool = PriorityExecutor(2)
    with pytest.raises(ZeroDivisionError):
        pool.submit(0, lambda: 1 / 0).result(WAIT_S)
    with pytest.raises(ValueError, match="threads"):
        PriorityExecutor(0)
    pool.shutdown()


def test_worker_runs_a_read_before_queued_writes(spec, pool, monkeypatch):
    # One NVMe thread; every write waits 1 s first (a slow disk). Slot 5 is written beforehand.
    # Then write 1, write 2 and a read a request waits for are sent together: whichever job the
    # thread took first, the read does not wait behind write 2 (nor behind write 1 unless write 1
    # was already running: jobs are never interrupted).
    monkeypatch.setenv("HIRADIX_FAULTS", "store_delay_s=1")
    client = IOWorkerClient(msgspec.structs.replace(spec, threads=1), ready_timeout_s=WAIT_S)
    try:
        client.start()
        fill(pool, range(4), seed=5)
        client.submit(StorePages(job_id=9, dram_pages=[3], nvme_slots=[5]))
        assert wait_for(client, {9})[9].ok == [True]
        client.submit(StorePages(job_id=1, dram_pages=[0], nvme_slots=[0]))
        client.submit(StorePages(job_id=2, dram_pages=[1], nvme_slots=[1]))
        client.submit_load(3, [5], [2], priority=PRIORITY_ADMISSION)
        assert client.ping(WAIT_S)  # all three are in the worker
        order = []
        while len(order) < 3:
            done = client.wait(WAIT_S)
            assert done, "no JobDone in time"
            order += [(d.job_id, d.ok) for d in done]
        jobs = [job for job, _ in order]
        assert jobs in ([1, 3, 2], [3, 1, 2]), order
        assert all(ok == [True] for _, ok in order)
    finally:
        client.close()


def test_the_store_pool_runs_lookups_then_gets_by_priority_then_puts():
    """Issue 31: a lookup or a GET a request waits for never queues behind PUTs (one FIFO pool
    before); GETs carry the read's priority, and a priority outside the range is refused."""
    jobs = [PutStore(1, [0], ["p"]), GetStore(2, ["b"], [1], priority=PRIORITY_BACKGROUND),
            GetStore(3, ["q"], [2], priority=PRIORITY_QUEUED), QueryStore(4, ["x"]), GetStore(5, ["a"], [3])]
    assert [job.job_id for job in sorted(jobs, key=store_priority)] == [4, 5, 3, 2, 1]
    assert validate_job(GetStore(6, ["a"], [0], priority=PRIORITY_BACKGROUND + 1), 8, 8, True).startswith("priority")
    assert validate_job(GetStore(6, ["a"], [0], priority=PRIORITY_QUEUED), 8, 8, True) == ""
