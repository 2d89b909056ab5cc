"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pytest

from hiradix.testing.mooncake import MooncakeCluster
from hiradix.tiers.store.base import make_backend


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A loopback Mooncake Store (master + one 256 MiB holder) for one test module; stopped by PID."""
    with MooncakeCluster(num_holders=1, holder_segment_bytes=256 << 20,
                         log_dir=tmp_path_factory.mktemp("mooncake")) as cluster:  # fmt: skip
        yield cluster


@pytest.fixture(scope="module")
def store_reader(store):
    """A client of the module's store in the test process (checks which pages servers PUT). Its
    ``MC_*`` settings, which a Mooncake client sets process-wide, never reach a process the
    testing helpers start (``hiradix.testing.server.launch_env``)."""
    with make_backend("mooncake", store.config()) as reader:
        yield reader
