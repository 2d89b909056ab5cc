"""The cluster store: its config parses and its master answers within the timeout.

Uses the launcher's own probe (:func:`hiradix.tiers.store.probe_backend`; for Mooncake:
the wheel imports, a TCP connection to the master opens within ``rpc_timeout_ms``, then a short-lived
client process, killed at the deadline, sets up against the master and answers one lookup).
It starts no holder: the probe client contributes no memory unless ``global_segment_bytes`` asks.
The config itself was parsed with the flags (``--hiradix-store-config``, ``StoreConfig.parse``).
"""

from __future__ import annotations

import time

from hiradix.config import FLAG_OF_FIELD, HiRadixConfig
from hiradix.doctor.report import Check, error, ok


def store_check(config: HiRadixConfig, timeout_s: float) -> Check | None:
    """Whether the configured store answers within ``timeout_s`` seconds (None: no store)."""
    if not config.has_store_tier:
        return None
    from hiradix.tiers.store import StoreConfig, probe_backend

    flag = FLAG_OF_FIELD["store_config"]
    store = StoreConfig.parse(config.store_config, flag)
    master = store.master_server_address
    start = time.monotonic()
    reason = probe_backend(config.store_backend, store, timeout_s)
    took = time.monotonic() - start
    name = f"--hiradix-store {config.store_backend}"
    if reason is None:
        return ok("store", f"{name}: master {master} answered a lookup in {took:.1f} s "
                  f"(rpc_timeout_ms {store.rpc_timeout_ms}, {store.protocol})")
    if "not installed" in reason or "does not import" in reason:
        fix = "install the store's client: .venv/bin/python scripts/store_deps.py (scripts/setup runs it)"
    else:
        fix = (f"start the master (mooncake_master) at {master}, or correct master_server_address in {flag}; "
               "the launcher refuses a store it cannot reach")
    return error("store", f"{name}: {reason} (after {took:.1f} s, timeout {timeout_s:g} s)", fix)
