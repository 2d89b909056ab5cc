"""Helpers of the I/O worker tests: the tiny layout, page fill/compare, waiting on jobs and exits.

The fixtures that build a DRAM pool, an NVMe file, a spec and clients are in ``tests/io/conftest.py``.
"""

from __future__ import annotations

import os
import select
import signal

import torch

from hiradix.dataplane.layout import KVLayout
from hiradix.io.client import IOWorkerClient
from hiradix.io.protocol import JobDone
from hiradix.tiers.dram import DramPool

NUM_DRAM_PAGES = 32
NUM_NVME_SLOTS = 64
WAIT_S = 60.0  # upper bound for any awaited event; a correct run never gets near it
LAYOUT = KVLayout(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)


def wait_exit(pid: int, timeout_s: float = WAIT_S) -> bool:
    """Block until process ``pid`` exits (without reaping it); True if it did in time."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout_s)
        return bool(readable)
    finally:
        os.close(fd)


def fill(pool: DramPool, pages: range, seed: int) -> None:
    """Fill DRAM pages with distinct random values."""
    gen = torch.Generator().manual_seed(seed)
    for p in pages:
        pool.tensor[p] = torch.randn(pool.tensor[p].shape, generator=gen).to(LAYOUT.dtype)


def page_bytes(pool: DramPool, page: int) -> bytes:
    return bytes(pool.page_view(page))


def wait_for(client: IOWorkerClient, job_ids: set[int]) -> dict[int, JobDone]:
    """Collect the JobDone of each job in ``job_ids`` (and fail if any other one shows up)."""
    got: dict[int, JobDone] = {}
    while set(got) != job_ids:
        done = client.wait(WAIT_S)
        assert done, f"no JobDone within {WAIT_S} s; still waiting for {job_ids - set(got)}"
        for d in done:
            assert d.job_id in job_ids and d.job_id not in got, d
            got[d.job_id] = d
    return got


def kill_and_reap(client: IOWorkerClient) -> int:
    """SIGKILL the worker, wait for its exit, let the client notice; returns the old pid."""
    pid = client.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert wait_exit(pid)
    assert client.check_alive() is False  # it was dead -> jobs failed, respawned
    return pid
