"""The cluster tier's medium: a KV store shared by the servers (below NVMe).

- ``base``: the :class:`StoreBackend` protocol, the backend registry
  (:func:`register_backend`, :func:`make_backend`, :func:`backend_names`,
  :func:`probe_backend`) and :class:`StoreConfig` (``--hiradix-store-config``).
- ``framing``: an object = page + checksum trailer keyed by a hash of its key.
- ``mooncake``: the Mooncake Store backend (registered here as ``mooncake``; the wheel is
  imported only when a backend is built or probed).
"""

from __future__ import annotations

from typing import Optional

from hiradix.tiers.store.base import (
    StoreBackend,
    StoreConfig,
    StoreConfigError,
    backend_names,
    make_backend,
    probe_backend,
    register_backend,
)


def _make_mooncake(config: StoreConfig) -> StoreBackend:
    from hiradix.tiers.store.mooncake import MooncakeStore

    return MooncakeStore(config)


def _probe_mooncake(config: StoreConfig, timeout_s: float) -> Optional[str]:
    from hiradix.tiers.store.mooncake import probe

    return probe(config, timeout_s)


register_backend("mooncake", _make_mooncake, _probe_mooncake)

__all__ = [
    "StoreBackend",
    "StoreConfig",
    "StoreConfigError",
    "backend_names",
    "make_backend",
    "probe_backend",
    "register_backend",
]
