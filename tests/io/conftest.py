"""Fixtures of the I/O worker tests: a private base dir, a DRAM pool + NVMe file, a spec, clients."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from hiradix.io.client import IOWorkerClient
from hiradix.io.protocol import WorkerSpec
from hiradix.tiers.dram import DramPool
from hiradix.tiers.nvme import NvmeStore
from tests.helpers.io import LAYOUT, NUM_DRAM_PAGES, NUM_NVME_SLOTS, WAIT_S




@pytest.fixture
def base_dir():
    # Short (ipc paths are limited to 107 bytes), on the temp dir's real disk, private.
    with tempfile.TemporaryDirectory(prefix="hrx") as d:
        yield Path(d)


@pytest.fixture
def pool(base_dir):
    pool = DramPool.create(LAYOUT, NUM_DRAM_PAGES, base_dir / "dram")
    NvmeStore.create(base_dir / "nvme", LAYOUT.page_bytes, NUM_NVME_SLOTS, backend="posix", threads=2).close()
    yield pool
    pool.close()


@pytest.fixture
def spec(base_dir, pool):
    return WorkerSpec(
        dram_path=str(pool.path), layout=LAYOUT.to_json(), num_dram_pages=NUM_DRAM_PAGES,
        nvme_dir=str(base_dir / "nvme"), num_nvme_slots=NUM_NVME_SLOTS, page_bytes=LAYOUT.page_bytes,
        io_backend="posix", socket_dir=str(base_dir / "sock"), threads=2, parent_pid=os.getpid(),
    )


@pytest.fixture
def make_client(spec, monkeypatch):
    clients: list[IOWorkerClient] = []

    def make(faults: str = "", **kwargs) -> IOWorkerClient:
        monkeypatch.setenv("HIRADIX_FAULTS", faults)
        client = IOWorkerClient(spec, ready_timeout_s=WAIT_S, **kwargs)
        clients.append(client)
        client.start()
        return client

    yield make
    for client in clients:
        client.close()  # kills the worker after the timeout even if a test failed
