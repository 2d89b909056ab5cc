"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pytest

from hiradix.testing.mooncake import MooncakeCluster


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A loopback Mooncake Store (master + one 256 MiB holder) for one test module; stopped by PID."""
    with MooncakeCluster(num_holders=1, holder_segment_bytes=256 << 20,
                         log_dir=tmp_path_factory.mktemp("mooncake")) as cluster:  # fmt: skip
        yield cluster
