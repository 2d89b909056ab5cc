"""Fault injection (``HIRADIX_FAULTS``, :mod:`hiradix.io.faults`) and what the tiers do about it.

* Worker level: a real worker process per test; each injected fault goes through the store's
  real error path (the worker's own warning names the reason: ENOSPC, short read, checksum
  mismatch, truncated file) and comes back as failed pages, never as wrong bytes in DRAM.
* Controller level: :class:`hiradix.core.controller.TierController` over the data-less stand-ins with
  an I/O client whose jobs fail: ``MAX_NVME_FAILURES_IN_ROW`` failed writes or reads in a row
  switch the NVMe tier off with one warning; a success in between resets the count.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest

from hiradix.io.faults import CRASH_LOG_NAME, Faults
from hiradix.io.protocol import JobDone, LoadPages, StorePages
from hiradix.testing.sim_ports import SimClock, SimIOClient, simulated_controller
from hiradix.core.nvme_link import MAX_NVME_FAILURES_IN_ROW
from hiradix.tiers.nvme import NVME_FILE_NAME, slot_bytes_for
from hiradix.core.node import Tier
from hiradix.core.tree import TieredRadixTree
from tests.helpers.io import LAYOUT, NUM_NVME_SLOTS, fill, page_bytes, wait_exit, wait_for

# ---- the switch -----------------------------------------------------------------------------


def test_fault_switch_new_keys():
    text = "enospc_on_store=2,short_read=3,corrupt_read=4,truncate_on_job=5,truncate_keep=0.1,crash_mid_load=1,crash_limit=2"
    assert Faults.parse(text) == Faults(
        enospc_on_store=2, short_read=3, corrupt_read=4, truncate_on_job=5, truncate_keep=0.1,
        crash_mid_load=1, crash_limit=2,
    )
    assert not Faults().touches_files and Faults(corrupt_read=1).touches_files
    for bad in ("truncate_keep=1", "truncate_keep=-0.5", "short_read=0.5", "enospc_on_store=-2"):
        with pytest.raises(ValueError, match="HIRADIX_FAULTS"):
            Faults.parse(bad)
    assert Faults.parse("store_hold_path=/tmp/h,store_delay_s=1").store_hold_path == "/tmp/h"


def test_sigterm_leaves_a_held_write_to_land_until_the_scheduler_shuts_the_worker_down(spec, pool, base_dir,
                                                                                       monkeypatch):
    """Issue 30: a server stopped as a process group SIGTERMs the worker with its scheduler, which
    drains the writes in flight: the worker answers them, and exits on the scheduler's Shutdown."""
    import msgspec
    import os
    import signal

    from hiradix.io.client import IOWorkerClient
    from tests.helpers.io import WAIT_S

    hold = base_dir / "hold"
    hold.touch()
    monkeypatch.setenv("HIRADIX_FAULTS", f"store_hold_path={hold}")
    client = IOWorkerClient(msgspec.structs.replace(spec, stop_timeout_s=5.0), ready_timeout_s=WAIT_S)
    client.start()
    try:
        fill(pool, range(2), seed=3)
        client.submit(StorePages(job_id=1, dram_pages=[0, 1], nvme_slots=[0, 1]))  # held
        proc = client._worker.proc
        os.kill(proc.pid, signal.SIGTERM)
        assert client.ping(WAIT_S) and proc.poll() is None  # still serving
        hold.unlink()  # the write lands now
        assert wait_for(client, {1})[1].ok == [True, True]
    finally:
        client.close()
    assert proc.returncode == 0  # Shutdown, not the signal


# ---- a real worker --------------------------------------------------------------------------


def store(client, job_id: int, dram: list[int], slots: list[int]) -> list[bool]:
    client.submit(StorePages(job_id=job_id, dram_pages=dram, nvme_slots=slots))
    done = wait_for(client, {job_id})[job_id]
    assert done.error == "", done  # page-level outcome: the job itself ran
    return done.ok


def load(client, job_id: int, slots: list[int], dram: list[int]) -> list[bool]:
    client.submit(LoadPages(job_id=job_id, nvme_slots=slots, dram_pages=dram))
    done = wait_for(client, {job_id})[job_id]
    assert done.error == "", done
    return done.ok


def test_enospc_fails_the_nth_store_and_every_later_one(make_client, pool, capfd):
    client = make_client(faults="enospc_on_store=2")
    fill(pool, range(6), seed=9)
    assert store(client, 1, [0, 1], [0, 1]) == [True, True]  # store #1 is clean
    assert store(client, 2, [2, 3], [2, 3]) == [False, False]  # store #2: ENOSPC
    assert load(client, 3, [0, 1, 2], [16, 17, 18]) == [True, True, False]  # loads unaffected; slot 2 never written
    assert [page_bytes(pool, 16), page_bytes(pool, 17)] == [page_bytes(pool, 0), page_bytes(pool, 1)]
    assert store(client, 4, [4], [4]) == [False]  # and every later store
    assert client.check_alive() is True
    assert "No space left on device" in capfd.readouterr().err  # the store's own write-error path


@pytest.mark.parametrize("faults, reason", [("short_read=2", "short read"), ("corrupt_read=2", "checksum mismatch")])
def test_bad_reads_from_the_nth_load_on_are_misses(make_client, pool, capfd, faults, reason):
    client = make_client(faults=faults)
    fill(pool, range(4), seed=7)
    assert store(client, 1, [0, 1, 2, 3], [8, 9, 10, 11]) == [True] * 4
    assert load(client, 2, [8, 9], [16, 17]) == [True, True]  # load #1 is clean
    assert page_bytes(pool, 16) == page_bytes(pool, 0)
    pool.tensor[18].fill_(3.0)
    before = page_bytes(pool, 18)
    assert load(client, 3, [10, 11], [18, 19]) == [False, False]  # load #2: faulted -> misses
    assert page_bytes(pool, 18) == before  # a miss leaves the page untouched: no wrong KV
    assert load(client, 4, [8], [20]) == [False]  # every later load too (slot 8 read fine before)
    assert reason in capfd.readouterr().err  # caught by the store's length / trailer checks


def test_truncated_file_reads_as_misses(make_client, pool, base_dir, capfd):
    client = make_client(faults="truncate_on_job=3,truncate_keep=0.25")
    path = base_dir / "nvme" / NVME_FILE_NAME
    size = path.stat().st_size
    assert size == NUM_NVME_SLOTS * slot_bytes_for(LAYOUT.page_bytes)
    fill(pool, range(4), seed=11)
    assert store(client, 1, [0, 1], [0, 1]) == [True, True]  # low slots: kept by the cut
    assert store(client, 2, [2, 3], [60, 61]) == [True, True]  # high slots: cut away
    # job #3 truncates the file to a quarter when it arrives, then runs
    assert load(client, 3, [0, 1, 60, 61], [16, 17, 18, 19]) == [True, True, False, False]
    assert path.stat().st_size == size // 4
    assert [page_bytes(pool, 16), page_bytes(pool, 17)] == [page_bytes(pool, 0), page_bytes(pool, 1)]
    assert not any(page_bytes(pool, 18)) and not any(page_bytes(pool, 19))  # untouched zeros
    assert "file truncated?" in capfd.readouterr().err


def test_crash_mid_load_once_then_the_successor_serves(make_client, pool, spec):
    client = make_client(faults="crash_mid_load=1,crash_limit=1")  # the switch stays set for respawns
    fill(pool, range(4), seed=13)
    assert store(client, 1, [0, 1, 2, 3], [0, 1, 2, 3]) == [True] * 4  # stores do not count
    pid = client.pid
    client.submit(LoadPages(job_id=2, nvme_slots=[0, 1, 2, 3], dram_pages=[16, 17, 18, 19]))
    assert wait_exit(pid)  # load #1 reads 2 of its 4 pages, then exits
    assert client.check_alive() is False
    assert client.poll() == [JobDone(job_id=2, ok=[False] * 4, error="worker died")]
    assert client.respawns == 1 and client.pid != pid
    # the successor's load #1 would crash too, but crash_limit=1 is used up
    assert load(client, 3, [0, 1, 2, 3], [20, 21, 22, 23]) == [True] * 4
    assert [page_bytes(pool, 20 + i) for i in range(4)] == [page_bytes(pool, i) for i in range(4)]
    assert client.check_alive() is True
    assert len((Path(spec.socket_dir) / CRASH_LOG_NAME).read_text().splitlines()) == 1


def test_a_worker_killed_by_a_segfault_leaves_its_stacks_and_is_named_by_its_signal(make_client, pool, capfd, caplog):
    # Mooncake's store.so segfaults under load inside a get (measured: asio's timer queue); the
    # worker's faulthandler prints every thread's Python stack (which store call) before it dies.
    client = make_client()
    fill(pool, range(2), seed=3)
    assert store(client, 1, [0, 1], [0, 1]) == [True, True]
    pid = client.pid
    os.kill(pid, signal.SIGSEGV)
    assert wait_exit(pid)
    with caplog.at_level(logging.WARNING, logger="hiradix.io.client"):
        assert client.check_alive() is False
    assert f"I/O worker pid {pid} died with signal SIGSEGV (11)" in caplog.text
    err = capfd.readouterr().err
    assert "Fatal Python error: Segmentation fault" in err
    assert "in serve" in err  # the main thread's frame, waiting for jobs
    assert load(client, 2, [0, 1], [4, 5]) == [True, True]  # the successor serves


# ---- the controller -------------------------------------------------------------------------

PS = 2  # tokens per page


class FailingIO(SimIOClient):
    """SimIOClient whose jobs of the kinds in ``fail`` come back with every page failed."""

    def __init__(self, clock: SimClock):
        super().__init__(clock, read_s_per_page=0.0, write_s_per_page=0.0)
        self.fail: tuple[type, ...] = ()
        self.kinds: dict[int, type] = {}  # job id -> LoadPages / StorePages
        self.submitted = 0

    def submit(self, job):
        self.kinds[job.job_id] = type(job)
        self.submitted += 1
        super().submit(job)

    def poll(self):
        return [JobDone(job_id=d.job_id, ok=[False] * len(d.ok)) if self.kinds[d.job_id] in self.fail else d
                for d in super().poll()]


def controller(dram_pages: int = 32, nvme_slots: int = 32):
    clock = SimClock()
    tree = TieredRadixTree(PS, clock=clock)
    tiers = simulated_controller(tree, dram_pages, nvme_slots, page_bytes=64, write_through=True, clock=clock,
                                 client=FailingIO(clock))
    return tree, tiers, tiers.client


def dram_only(tree, tiers, keys: list[list[int]]) -> list:
    """Insert ``keys`` (HBM), back them up to DRAM, evict them from HBM: DRAM-only nodes."""
    nodes, slot = [], 0
    for key in keys:
        _, node, new = tree.insert(key, list(range(slot, slot + len(key))))
        slot += len(key)
        tiers.backups.after_insert(new)
        nodes.append(node)
    tiers.step()  # backups land
    tiers.evict_hbm(slot)  # -> DRAM only; demotions start
    assert all(n.tiers() == [Tier.DRAM] for n in nodes)
    return nodes


def switched_off(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "NVMe tier switched off" in r.getMessage()]


def test_failed_writes_in_a_row_switch_nvme_off_once(caplog):
    tree, tiers, io = controller()
    io.fail = (StorePages,)  # a disk that refuses every write (ENOSPC)
    caplog.set_level(logging.WARNING, logger="hiradix.core.nvme_link")
    (node,) = dram_only(tree, tiers, [[1, 1, 2, 2]])
    for _ in range(MAX_NVME_FAILURES_IN_ROW - 1):
        tiers.step()  # a failed store: rolled back, and retried
        assert tiers.books.nvme_enabled and node.tiers() == [Tier.DRAM]
    tiers.step()  # the 5th failure in a row -> off
    assert not tiers.books.nvme_enabled
    assert switched_off(caplog) == [
        f"hiradix: NVMe tier switched off: {MAX_NVME_FAILURES_IN_ROW} NVMe writes in a row failed "
        "(see the I/O worker's warnings); 0 pages forgotten, serving from HBM and DRAM"
    ]
    submitted = io.submitted
    for _ in range(3):
        tiers.step()
    assert io.submitted == submitted and len(switched_off(caplog)) == 1  # no more jobs, no more warnings
    assert node.alive and node.tiers() == [Tier.DRAM]  # still served from DRAM
    assert tiers.stats.transfers_failed["DEMOTE"] == MAX_NVME_FAILURES_IN_ROW
    tiers.books.check_integrity()


def test_failed_reads_in_a_row_switch_nvme_off_and_a_late_store_is_not_kept(caplog):
    tree, tiers, io = controller()
    caplog.set_level(logging.WARNING, logger="hiradix.core.nvme_link")
    nodes = dram_only(tree, tiers, [[k, k] for k in range(1, 12)])
    tiers.step()  # demotions land (the disk still works)
    for node in nodes:
        tiers.books.drop_copy(node, Tier.DRAM)  # NVMe only now
    assert all(n.tiers() == [Tier.NVME] for n in nodes)
    io.fail = (LoadPages,)  # a disk whose reads fail (short reads, bad checksums)

    def read(node) -> None:
        assert tiers.prefetch([node], timeout_s=1.0)
        tiers.step()

    for node in nodes[: MAX_NVME_FAILURES_IN_ROW - 1]:
        read(node)  # a failed read is a miss: the bad copy is dropped
        assert not node.alive
    io.fail = ()
    read(nodes[4])  # one good read resets the count
    assert nodes[4].tiers() == [Tier.DRAM, Tier.NVME]
    io.fail = (LoadPages,)
    for node in nodes[5:9]:
        read(node)
    assert tiers.books.nvme_enabled and not switched_off(caplog)  # 4 in a row: still on
    # a store is in flight (slow) when the 5th failed read in a row switches the tier off
    io.s_per_page["nvme_write"] = 10.0
    (late,) = dram_only(tree, tiers, [[50, 50]])
    assert tiers.books.in_flight()
    read(nodes[9])
    assert not tiers.books.nvme_enabled and len(switched_off(caplog)) == 1
    assert "5 NVMe reads in a row failed" in switched_off(caplog)[0]
    assert nodes[4].tiers() == [Tier.DRAM] and not nodes[10].alive  # every NVMe copy forgotten
    io.clock.advance_to(100.0)
    tiers.step()  # the store lands after the switch-off: not attached, its slots freed
    assert late.tiers() == [Tier.DRAM] and tiers.books.nvme.num_used == 0
    assert tree.tier_tokens[Tier.NVME] == 0 and len(switched_off(caplog)) == 1
    tiers.books.check_integrity()


def test_only_rank_scopes_the_faults_to_one_tp_rank():
    faults = Faults.parse("load_delay_s=0.3,only_rank=1")
    assert faults.for_rank(1).load_delay_s == 0.3
    assert faults.for_rank(0) == Faults()
    assert Faults.parse("delay_s=0.1").for_rank(5).delay_s == 0.1  # default: every rank
