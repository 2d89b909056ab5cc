"""Helpers of the cluster-store tests: the wheel check, a DRAM arena, a raw Mooncake client,
and the body of a second client process (spawned, so it is a fresh interpreter)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import time
from typing import Callable, Optional, Sequence

import pytest
import torch

from hiradix.core.decode_offload import page_keys
from hiradix.dataplane.layout import KVLayout
from hiradix.tiers.dram import DramPool
from hiradix.tiers.store.base import StoreConfig

MOONCAKE_MISSING = importlib.util.find_spec("mooncake") is None
# Skipped only where the wheel is absent and this is not CI; CI installs it (scripts/setup).
requires_mooncake = pytest.mark.skipif(
    MOONCAKE_MISSING and not os.environ.get("CI"),
    reason="the Mooncake wheel is not installed (scripts/setup installs mooncake-transfer-engine-non-cuda)",
)

# 2 layers x [2, 16, 2, 64] float32 = 32 KiB per page.
LAYOUT = KVLayout(num_layers=2, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32)


def make_arena(num_pages: int, seed: int = 0, layout: KVLayout = LAYOUT) -> DramPool:
    """An anonymous DRAM pool of ``num_pages`` pages filled with seeded random floats."""
    pool = DramPool.create_anonymous(layout, num_pages)
    gen = torch.Generator().manual_seed(seed)
    pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=gen))
    return pool


def page_digest(pool: DramPool, page_id: int) -> str:
    return hashlib.sha256(pool.page_view(page_id)).hexdigest()


def raw_client(config: StoreConfig):
    """A plain ``MooncakeDistributedStore`` (no trailer, no checks), to plant objects."""
    from mooncake.store import MooncakeDistributedStore

    from hiradix.tiers.store.mooncake import mooncake_env

    os.environ.update(mooncake_env(config))
    raw = MooncakeDistributedStore()
    rc = raw.setup(config.local_hostname, config.metadata_server, 0, 16 << 20, "tcp", "", config.master_server_address)
    assert rc == 0, f"raw Mooncake setup failed ({rc})"
    return raw


def timed(call: Callable[[], object]) -> tuple[object, float]:
    """``(call(), seconds it took)``."""
    start = time.monotonic()
    result = call()
    return result, time.monotonic() - start


def second_client(config_json: str, get_keys: list[str], put_keys: list[str], seed: int, conn) -> None:
    """Runs in a spawned process: its own arena and client; reads ``get_keys`` and puts
    ``put_keys`` (pages of a ``seed`` arena); sends back (get results, digests, put results)."""
    from hiradix.tiers.store import make_backend

    config = StoreConfig.parse(config_json, "--hiradix-store-config")
    pool = make_arena(len(get_keys) + len(put_keys), seed=seed)
    backend = make_backend("mooncake", config)
    try:
        backend.register(pool.tensor.data_ptr(), pool.dram_bytes)
        got = backend.get(get_keys, [pool.page_view(i) for i in range(len(get_keys))])
        digests = [page_digest(pool, i) for i in range(len(get_keys))]
        first = len(get_keys)
        put = backend.put(put_keys, [pool.page_view(first + i) for i in range(len(put_keys))])
        put_digests = [page_digest(pool, first + i) for i in range(len(put_keys))]
        conn.send((got, digests, put, put_digests))
    finally:
        backend.close()
        conn.close()


def logged_key_prefix(log_text: str) -> str:
    """The store key prefix (the KV fingerprint) a hiradix server logs at start: ``(keys <prefix>*)``."""
    logged = re.search(r"\(keys (\S+)\*\)", log_text)
    assert logged, log_text[-3000:]
    return logged.group(1)


def wait_until_stored(reader, key_prefix: str, token_ids: Sequence[int], page_size: int,
                      namespace: Optional[tuple] = None, timeout_s: float = 60.0) -> None:
    """Wait until the store lists every whole page of ``token_ids`` (PUTs are asynchronous);
    ``reader`` is a store client (``make_backend``), ``namespace`` ``(extra_key, cache_salt)``.

    Raises:
        AssertionError: a page was still missing after ``timeout_s``.
    """
    keys = page_keys(key_prefix, token_ids, namespace, page_size, 0)
    deadline = time.monotonic() + timeout_s
    present = reader.exists(keys)
    while not all(present) and time.monotonic() < deadline:
        time.sleep(0.2)
        present = reader.exists(keys)
    assert all(present), f"{present.count(False)} of {len(keys)} pages never reached the store"
