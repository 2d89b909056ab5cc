"""The cluster tier's medium: what a KV store shared by the servers must do, its registry, its config.

A backend moves whole pages between the DRAM arena and a store that other servers read too
(CachedAttention / AttentionStore's shared store, USENIX ATC '24 §3; SGLang HiCache's L3
``HiCacheStorage``, ``sglang/srt/mem_cache/hicache_storage.py``, plays the same role there).
Keys are content addresses made by the caller; a page is one contiguous extent of the arena.
Every object is the page's bytes followed by a checksum trailer
(:mod:`hiradix.tiers.store.framing`), so what a get returns is either verified KV or a miss.

Backends are registered by name (:func:`register_backend`) and built with
:func:`make_backend`; ``mooncake`` (:mod:`hiradix.tiers.store.mooncake`) is registered by
:mod:`hiradix.tiers.store`, imported lazily so hiradix imports without the Mooncake wheel.

Data movement only, called from the I/O worker process: which pages exist where, and when to
store or load them, is the core's business.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import numpy as np

PROTOCOLS: tuple[str, ...] = ("tcp", "rdma")
UNPOOLED_KEYS_PER_CALL = 512  # keys per Mooncake call on the unpooled transport (one batched call)


class StoreConfigError(ValueError):
    """A store configuration that cannot be used; the message names the flag and the key."""


@runtime_checkable
class StoreBackend(Protocol):
    """A cluster KV store as the I/O worker uses it.

    Keys are ``str`` content addresses, 1..256 characters (:data:`framing.MAX_KEY_CHARS`). A page
    is one contiguous, writable extent of ``page_bytes`` bytes inside a region given to
    :meth:`register`. Every call returns one result per key, in order, and never raises for a
    store failure (unreachable, timed out, full, lost): that key's result is False. Calls raise
    only for a caller's mistake (``ValueError``: mismatched lengths, a bad key, a page outside
    the registered arena) and return within the backend's configured timeouts.
    """

    name: str

    def register(self, ptr: int, nbytes: int) -> None:
        """Register the DRAM arena ``[ptr, ptr + nbytes)`` once, for zero-copy puts and gets."""
        ...

    def put(self, keys: list[str], pages: list[memoryview]) -> list[bool]:
        """Store ``pages[i]`` (+ checksum trailer) under ``keys[i]``; True iff stored."""
        ...

    def get(self, keys: list[str], pages: list[memoryview]) -> list[bool]:
        """Read ``keys[i]`` into ``pages[i]``; True iff read whole and verified.

        On False the page's bytes are undefined (it may have been partly written).
        """
        ...

    def exists(self, keys: list[str]) -> list[bool]:
        """Whether the store lists ``keys[i]``: a hint only (a later get may still miss)."""
        ...

    def close(self) -> None:
        """Leave the store; idempotent. Later calls return False for every key."""
        ...

    def call_running_s(self) -> float:
        """Seconds the backend call running now has taken (0.0: none), read from another
        thread; the I/O worker gives up on a client whose call runs far past its timeouts."""
        ...


BackendFactory = Callable[["StoreConfig"], StoreBackend]
BackendProbe = Callable[["StoreConfig", float], Optional[str]]


@dataclass(frozen=True)
class _Entry:
    factory: BackendFactory
    probe: Optional[BackendProbe]


_BACKENDS: dict[str, _Entry] = {}


def register_backend(name: str, factory: BackendFactory, probe: Optional[BackendProbe] = None) -> None:
    """Make ``name`` buildable by :func:`make_backend`.

    Args:
        name: the registry name (``--hiradix-store`` value).
        factory: ``factory(config)`` builds a connected backend.
        probe: ``probe(config, timeout_s)`` says why the store is unusable (None: usable),
            within ``timeout_s``, without building a backend in this process.

    Raises:
        ValueError: ``name`` is empty or already registered.
    """
    if not name or not isinstance(name, str):
        raise ValueError(f"store backend name must be a non-empty str, got {name!r}")
    if name in _BACKENDS:
        raise ValueError(f"store backend {name!r} is already registered")
    _BACKENDS[name] = _Entry(factory, probe)


def backend_names() -> list[str]:
    """The registered backend names, sorted."""
    return sorted(_BACKENDS)


def _entry(name: str) -> _Entry:
    entry = _BACKENDS.get(name)
    if entry is None:
        raise ValueError(f"unknown store backend {name!r}; registered: {', '.join(backend_names()) or 'none'}")
    return entry


def make_backend(name: str, config: "StoreConfig") -> StoreBackend:
    """Build the backend registered as ``name`` (connects to the store).

    Raises:
        ValueError: no backend of that name (the message lists the registered ones).
        ImportError: the backend's client library is missing or does not load.
        OSError: the backend cannot set up its client (Mooncake: the master unreachable,
            after ~4.3 s per ``setup_retries``; :func:`probe_backend` says so sooner).
    """
    return _entry(name).factory(config)


def probe_backend(name: str, config: "StoreConfig", timeout_s: float) -> Optional[str]:
    """Why backend ``name`` cannot serve ``config`` (None: usable), decided within ``timeout_s``.

    A backend registered without a probe is taken as usable.

    Raises:
        ValueError: no backend of that name (the message lists the registered ones).
    """
    probe = _entry(name).probe
    return None if probe is None else probe(config, timeout_s)


def buffer_address(view: memoryview) -> int:
    """Address of the first byte of a contiguous buffer (no copy)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


@dataclass(frozen=True)
class StoreConfig:
    """How to reach the cluster store (``--hiradix-store-config``: JSON text or a JSON file).

    The JSON keys are the field names. Defaults suit one machine on loopback; on a cluster set
    ``master_server_address``, ``local_hostname`` (this node's address the others reach) and,
    for RDMA, ``protocol`` and ``device_name``.

    Attributes:
        master_server_address: ``host:port`` of the store's master (``mooncake_master``).
        protocol: transport between clients and segment holders, ``tcp`` or ``rdma``.
        metadata_server: where clients find each other's segments; ``P2PHANDSHAKE`` asks peers.
        local_hostname: this client's address as others see it.
        global_segment_bytes: memory this client contributes to the store, in bytes. 0 (the
            default): it holds no objects; holder processes (``mooncake_client``) do, so the
            KV survives this server's restart.
        local_buffer_bytes: the client's own transfer buffer, in bytes (zero-copy calls
            bypass it).
        rpc_timeout_ms: deadline of one call to the master, in ms; a frozen master fails a
            call after this long.
        transfer_timeout_s: deadline of a transfer without progress, in whole seconds (a
            frozen holder fails a get after this long).
        setup_retries: attempts to reach the master when the client starts.
        device_name: RDMA device names, comma-separated (``""``: auto or TCP).
        tcp_connection_pool: send transfers over Mooncake's connection lanes (per holder, run
            on the transport's own thread). On (the default): measured with 0.3.13.post1, no
            crash or wedge in ~23 client-minutes of two clients putting into a full store, where
            the unpooled path (off) had 9 in ~36 (it starts each transfer on the caller's thread while the
            transport's thread runs the same timers: a segfault, a wedged put, or a transport
            thread spinning forever; ``hiradix.tiers.store.mooncake``). The cost: a frozen
            holder fails a call after up to ``stall_s`` instead of ``transfer_timeout_s``.
        tcp_lanes_per_peer: connection lanes per holder (1..16, Mooncake's ``MC_TCP_LANES_PER_PEER``);
            a call carries at most this many keys, so the keys of one call wait on a stalled
            holder side by side, not in turn (16 keys on 4 lanes: 14 s with a 1 s timeout).
        call_limit_s: a store call running longer than this, in whole seconds, means a wedged
            client (Mooncake's TCP transport can deadlock inside a put): the I/O worker exits,
            its jobs fail (misses; their DRAM pages are released) and a fresh worker starts.
            0 (the default): ``max(10, 4 * call_deadline_s)`` (28 s with the defaults). Raise it
            when one call of ``keys_per_call`` pages may honestly take longer (big pages, slow link).
    """

    master_server_address: str
    protocol: str = "tcp"
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    global_segment_bytes: int = 0
    local_buffer_bytes: int = 16 << 20
    rpc_timeout_ms: int = 1000
    transfer_timeout_s: int = 2
    setup_retries: int = 1
    device_name: str = ""
    tcp_connection_pool: bool = True
    tcp_lanes_per_peer: int = 16
    call_limit_s: int = 0

    @property
    def master_host_port(self) -> tuple[str, int]:
        """``master_server_address`` split into ``(host, port)``."""
        host, _, port = self.master_server_address.rpartition(":")
        return host.strip("[]"), int(port)

    @property
    def rpc_timeout_s(self) -> float:
        """``rpc_timeout_ms`` in seconds."""
        return self.rpc_timeout_ms / 1000.0

    @property
    def stall_s(self) -> float:
        """Longest a call of at most ``keys_per_call`` keys waits on a frozen holder, in seconds.
        Unpooled: ``transfer_timeout_s``. Pooled, measured with 0.3.13.post1 on loopback (16 keys
        on 16 lanes; 4 keys): 3.0 and 4.0 s for two calls with a 1 s timeout, 5.0 and 6.0 s (2.0
        and 3.0 s) with 2 s: the lane's progress and status deadlines in turn, and up to 2 s more."""
        tto = float(self.transfer_timeout_s)
        return 2 * tto + 2.0 if self.tcp_connection_pool else tto

    @property
    def keys_per_call(self) -> int:
        """Most keys one Mooncake call carries: one per lane when pooled, else ``UNPOOLED_KEYS_PER_CALL``."""
        return self.tcp_lanes_per_peer if self.tcp_connection_pool else UNPOOLED_KEYS_PER_CALL

    @property
    def call_deadline_s(self) -> float:
        """Longest one backend call may take, in seconds: a master RPC or a stalled transfer."""
        return max(self.rpc_timeout_s, self.stall_s) + self.rpc_timeout_s

    def to_json(self) -> str:
        """The config as JSON text, accepted by :meth:`parse`."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def parse(cls, text: str, flag: str) -> StoreConfig:
        """Parse JSON text (starts with ``{``) or the path of a JSON file.

        Args:
            text: the flag's value.
            flag: the flag's name for messages (``FlagSpec.flag`` in :mod:`hiradix.config`).

        Raises:
            StoreConfigError: unreadable file, invalid JSON, an unknown or missing key, or a
                value of the wrong type or range; the message names ``flag`` and the key.
        """
        raw = _load_json(text, flag)
        if not isinstance(raw, dict):
            raise StoreConfigError(f"{flag} must be a JSON object, got {type(raw).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise StoreConfigError(f"{flag}: unknown key {unknown[0]!r}; known keys: {', '.join(fields)}")
        if "master_server_address" not in raw:
            raise StoreConfigError(f"{flag}: missing key 'master_server_address' (host:port of the store's master)")
        for key, value in raw.items():
            _check_type(flag, key, value, fields[key].type)
        config = cls(**raw)
        config.validate(flag)
        return config

    def validate(self, flag: str) -> None:
        """Check ranges and formats.

        Raises:
            StoreConfigError: naming ``flag`` and the bad key.
        """
        def bad(key: str, why: str) -> StoreConfigError:
            return StoreConfigError(f"{flag}: {key} {why}, got {getattr(self, key)!r}")

        host, sep, port = self.master_server_address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise bad("master_server_address", "must be host:port with a port in 1..65535")
        if self.protocol not in PROTOCOLS:
            raise bad("protocol", f"must be one of {', '.join(PROTOCOLS)}")
        for key in ("metadata_server", "local_hostname"):
            if not getattr(self, key).strip():
                raise bad(key, "must not be empty")
        for key in ("global_segment_bytes", "local_buffer_bytes"):
            if getattr(self, key) < 0:
                raise bad(key, "must be >= 0 bytes")
        if not 0 < self.rpc_timeout_ms <= 600_000:
            raise bad("rpc_timeout_ms", "must be in 1..600000 ms")
        if not 0 < self.transfer_timeout_s <= 600:
            raise bad("transfer_timeout_s", "must be in 1..600 s")
        if not 0 < self.setup_retries <= 100:
            raise bad("setup_retries", "must be in 1..100")
        if not 1 <= self.tcp_lanes_per_peer <= 16:
            raise bad("tcp_lanes_per_peer", "must be in 1..16 (Mooncake's MC_TCP_LANES_PER_PEER)")
        if not 0 <= self.call_limit_s <= 3600:
            raise bad("call_limit_s", "must be in 0..3600 s (0: derived from the deadlines)")


def _load_json(text: str, flag: str) -> Any:
    text = str(text).strip()
    if not text:
        raise StoreConfigError(f"{flag} must not be empty (JSON text or the path of a JSON file)")
    if not text.startswith(("{", "[")):
        path = Path(text).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise StoreConfigError(f"{flag}: cannot read {path}: {exc.strerror or exc}") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise StoreConfigError(f"{flag}: invalid JSON: {exc}") from exc


_TYPES = {"str": (str, "string"), "int": (int, "integer"), "bool": (bool, "boolean (true or false)")}


def _check_type(flag: str, key: str, value: Any, annotation: Any) -> None:
    want, json_name = _TYPES[annotation if isinstance(annotation, str) else annotation.__name__]
    if want is int and isinstance(value, float) and math.isfinite(value) and value.is_integer():
        raise StoreConfigError(f"{flag}: {key} must be an integer, got {value!r} (write {int(value)})")
    if not isinstance(value, want) or (want is int and isinstance(value, bool)):
        raise StoreConfigError(f"{flag}: {key} must be a JSON {json_name}, got {value!r}")
