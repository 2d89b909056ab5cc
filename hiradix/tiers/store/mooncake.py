"""The Mooncake Store backend: pages in and out of a Mooncake cluster store, zero-copy, checked.

Over ``mooncake.store.MooncakeDistributedStore`` (the ``mooncake-transfer-engine`` wheels;
``-non-cuda`` on machines without an NVIDIA GPU). Each object is the page's bytes from the
registered DRAM arena followed by a 40-byte checksum trailer (:mod:`hiradix.tiers.store.framing`)
kept in a small registered staging buffer, moved in one batched call
(``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``): two extents per object,
no copy of the page. A get that returns another length, another key's object or corrupted
bytes is a miss. Every Mooncake error code (< 0) is a False for that key, never an exception.

Deadlines (Mooncake reads them from the environment when the client is set up, so this module
sets them from :class:`StoreConfig` first; they are process-wide): ``MC_RPC_TIMEOUT_MS``
bounds a call to a frozen master, ``MC_TCP_PROGRESS_TIMEOUT_SEC`` / ``MC_TCP_STATUS_TIMEOUT_SEC``
a transfer from a frozen holder (30 s otherwise), ``MC_STORE_CLIENT_SETUP_RETRIES`` the start
against a dead master. A dead master makes each Mooncake call spend ~4.3 s reconnecting,
whatever those say, so after a call finds the master gone, each call first tries a TCP connect
to it (``rpc_timeout_ms``) and fails at once while that is refused.

Facts measured with 0.3.13.post1 on loopback (tests/tiers/test_store_mooncake.py checks them):
master killed -> -900; frozen -> -901 after ``rpc_timeout_ms``; holder killed -> get -800 while
``exists`` still says present for ~10 s (until the master's client TTL lapses); pool full ->
put -200; a put of an existing key succeeds and keeps the first object. A holder frozen past
the master's TTL loses its objects (-704 after it thaws), whichever transport.

The transport: Mooncake's connection lanes (``tcp_connection_pool``, ``MC_TCP_LANES_PER_PEER``
= ``tcp_lanes_per_peer``), at most one key per lane per call (``StoreConfig.keys_per_call``).
Its unpooled path (``tcp_connection_pool`` false) starts each transfer on the caller's thread
(``TcpTransport::startTransferWithSocket`` -> ``ClientSession::writeHeader`` ->
``refreshProgressDeadline`` arms the session's deadline timer) while the transport's own thread
runs the same io_context's timers, and the timer queue gets corrupted. Measured
(``bench/micro/store_stress.py``, cores, py-spy and gdb; bench/RESULTS.md): a segfault in
``asio::detail::timer_queue::get_ready_timers`` on the ``TcpTransport::worker`` thread, a put
blocked for good in ``refreshProgressDeadline`` on asio's ``epoll_reactor`` mutex, and the
transport thread spinning in ``get_ready_timers`` forever (a frozen-holder test: then the
client's ``close`` joins that thread while holding the GIL, and the whole process stops).
``MC_TCP_PROGRESS_TIMEOUT_SEC=0`` still arms the timer. On lanes none was seen; their cost is a
slower failure against a frozen holder (``StoreConfig.stall_s``). Whatever the transport, a
crash ends the I/O worker: its jobs fail (misses) and a fresh worker starts, and every thread's
Python stack is in the server's log (faulthandler). For a wedge,
:meth:`MooncakeStore.call_running_s` says how long the longest running call has taken; the I/O worker
exits past its limit (its process holds the wedged client), and the I/O client fails its jobs
and starts a fresh worker.

PUTs and GETs take one lock (they share the trailer staging buffer); lookups (``exists``, a master
RPC) do not, so a lookup a request waits for does not queue behind a transfer running on another
thread of the I/O worker's store pool.

The ``mooncake`` package is imported inside functions only, so hiradix imports without it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Optional

import numpy as np

from hiradix.tiers.store.base import StoreConfig, buffer_address
from hiradix.tiers.store.framing import (
    OBJECT_OVERHEAD_BYTES,
    check_keys,
    pack_object_trailer,
    verify_object,
)

logger = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 10.0  # MooncakeStore.close waits at most this long for the client teardown

# Mooncake error codes seen with 0.3.13.post1 (its log names them), for messages and counters.
ERROR_NAMES: dict[int, str] = {
    -200: "no space in the store",
    -600: "invalid parameters (object size differs)",
    -703: "replica not ready (another client's put of the key is still running)",
    -704: "object not found",
    -800: "transfer failed (holder unreachable or stalled)",
    -900: "master unreachable",
    -901: "master timed out",
}
MASTER_FAILURES = frozenset({-900, -901})
WHEEL_HINT = ("pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 (no NVIDIA GPU) or "
              "mooncake-transfer-engine==0.3.13.post1 (CUDA); scripts/setup does")  # fmt: skip


def error_name(code: int) -> str:
    """A readable name of a Mooncake result code."""
    return ERROR_NAMES.get(code, f"error {code}")


def mooncake_env(config: StoreConfig) -> dict[str, str]:
    """The ``MC_*`` variables a client of ``config`` needs before ``setup`` (strings)."""
    env = {
        "MC_RPC_TIMEOUT_MS": str(config.rpc_timeout_ms),
        "MC_STORE_CLIENT_SETUP_RETRIES": str(config.setup_retries),
        "MC_TCP_PROGRESS_TIMEOUT_SEC": str(config.transfer_timeout_s),
        "MC_TCP_STATUS_TIMEOUT_SEC": str(config.transfer_timeout_s),
        "MC_TCP_ENABLE_CONNECTION_POOL": "1" if config.tcp_connection_pool else "0",
        "MC_TCP_LANES_PER_PEER": str(config.tcp_lanes_per_peer),
    }
    bind = _bind_address(config.local_hostname)
    if bind is not None:
        env["MC_TCP_BIND_ADDRESS"] = bind
    return env


def _bind_address(hostname: str) -> Optional[str]:
    """The address to bind/advertise: loopback for localhost, an IP literal as is, else None."""
    if hostname == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(hostname.strip("[]")))
    except ValueError:
        return None  # a DNS name: let Mooncake resolve it


def master_unreachable_reason(config: StoreConfig, timeout_s: float) -> Optional[str]:
    """None if a TCP connection to the master opens within ``timeout_s``, else why not."""
    host, port = config.master_host_port
    try:
        with socket.create_connection((host, port), timeout=max(0.05, timeout_s)):
            return None
    except OSError as exc:
        return f"master {config.master_server_address} unreachable: {exc.strerror or exc}"


class MooncakeStore:
    """A Mooncake Store client (one per I/O worker) implementing :class:`StoreBackend`.

    Thread-safe: calls are serialized (the trailer staging buffer is shared).

    Attributes:
        config: the store configuration.
        error_counts: Mooncake result code -> keys that got it, since start (for metrics).
        corrupt_gets: gets whose object read whole but failed its check (wrong key, length
            or checksum).
    """

    name = "mooncake"

    def __init__(self, config: StoreConfig, *, max_batch_keys: Optional[int] = None):
        """Set the ``MC_*`` environment (process-wide), set up the client, register staging.

        Raises:
            ImportError: the Mooncake wheel is missing or does not load (e.g. no libibverbs).
            OSError: ``setup`` failed (master unreachable after ``setup_retries``).
            ValueError: ``max_batch_keys < 1``.

        ``max_batch_keys``: most keys per Mooncake call; None: ``config.keys_per_call``.
        """
        max_batch_keys = config.keys_per_call if max_batch_keys is None else max_batch_keys
        if max_batch_keys < 1:
            raise ValueError(f"max_batch_keys must be >= 1, got {max_batch_keys}")
        self.config = config
        self.max_batch_keys = max_batch_keys
        self.error_counts: dict[int, int] = {}
        self.corrupt_gets = 0
        self._lock = threading.Lock()
        self._regions: list[tuple[int, int]] = []
        self._master_down = False
        # The Mooncake calls running now, by thread: ("batch_put_from_multi_buffers, 12 keys", monotonic start).
        self._running: dict[int, tuple[str, float]] = {}
        os.environ.update(mooncake_env(config))
        from mooncake.store import MooncakeDistributedStore  # lazy: the wheel is optional

        store = MooncakeDistributedStore()
        rc = store.setup(config.local_hostname, config.metadata_server, config.global_segment_bytes,
                         config.local_buffer_bytes, config.protocol, config.device_name,
                         config.master_server_address)  # fmt: skip
        if rc != 0:
            raise OSError(f"Mooncake setup against master {config.master_server_address} failed ({rc})")
        self._store: Any = store
        staging_bytes = -(-max_batch_keys * OBJECT_OVERHEAD_BYTES // mmap.PAGESIZE) * mmap.PAGESIZE
        self._staging_map = mmap.mmap(-1, staging_bytes)
        self._staging = np.frombuffer(self._staging_map, dtype=np.uint8)
        self._staging_ptr = int(self._staging.ctypes.data)
        rc = store.register_buffer(self._staging_ptr, staging_bytes)
        if rc != 0:
            store.close()
            raise OSError(f"Mooncake register_buffer of the trailer staging buffer failed ({rc})")
        logger.info("Mooncake store: master %s, %s, client %s", config.master_server_address, config.protocol,
                    config.local_hostname)

    # ----------------------------------------------------------------------------- public calls

    def register(self, ptr: int, nbytes: int) -> None:
        """Register ``[ptr, ptr + nbytes)`` (the DRAM arena) for zero-copy transfers; once per region.

        Raises:
            ValueError: ``nbytes <= 0``, or an overlap with a region registered before.
            OSError: Mooncake refused the registration, or the client is closed.
        """
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        with self._lock:
            if (ptr, nbytes) in self._regions:
                return
            if any(ptr < end and start < ptr + nbytes for start, end in self._spans()):
                raise ValueError(f"region [{ptr:#x}, +{nbytes}) overlaps a registered one")
            if self._store is None:
                raise OSError("Mooncake store is closed")
            rc = self._store.register_buffer(int(ptr), int(nbytes))
            if rc != 0:
                raise OSError(f"Mooncake register_buffer({ptr:#x}, {nbytes}) failed ({rc})")
            self._regions.append((int(ptr), int(nbytes)))

    def put(self, keys: list[str], pages: list[memoryview]) -> list[bool]:
        """Store each page + its trailer under its key; True iff Mooncake stored it.

        A key already in the store counts as stored (the store keeps the first object).

        Raises:
            ValueError: mismatched lengths, a bad key, or a page outside the registered arena.
        """
        check_keys(keys, len(pages))
        addresses = self._addresses(pages, writable=False)
        return self._batched(keys, lambda lo, hi: self._put_chunk(keys[lo:hi], pages[lo:hi], addresses[lo:hi]))

    def get(self, keys: list[str], pages: list[memoryview]) -> list[bool]:
        """Read each key's object into its page and verify it; True iff whole and verified.

        On False the page's bytes are undefined.

        Raises:
            ValueError: mismatched lengths, a bad key, a read-only page or one outside the
                registered arena.
        """
        check_keys(keys, len(pages))
        addresses = self._addresses(pages, writable=True)
        return self._batched(keys, lambda lo, hi: self._get_chunk(keys[lo:hi], pages[lo:hi], addresses[lo:hi]))

    def exists(self, keys: list[str]) -> list[bool]:
        """Whether the master lists each key (a hint: its holder may be gone).

        Raises:
            ValueError: a bad key.
        """
        check_keys(keys, len(keys))
        # A lookup is a master RPC (no transfer, no staging buffer): it does not wait for a PUT or GET
        # running on another thread (a request waits for its answer at admission).
        return self._batched(keys, lambda lo, hi: self._exists_chunk(keys[lo:hi]), exclusive=False)

    def call_running_s(self) -> float:
        """Seconds the longest Mooncake call running now has taken; 0.0 when none runs.
        Thread-safe (no lock: it is read while a call holds it)."""
        running = self._oldest_call()
        return 0.0 if running is None else max(0.0, time.monotonic() - running[1])

    @property
    def running_call(self) -> str:
        """The longest Mooncake call running now (method and key count), '' when none. Thread-safe."""
        running = self._oldest_call()
        return "" if running is None else running[0]

    def _oldest_call(self) -> Optional[tuple[str, float]]:
        calls = list(self._running.values())  # one C-level copy: safe while other threads add and remove
        return min(calls, key=lambda call: call[1]) if calls else None

    def close(self) -> None:
        """Leave the store (objects in this client's own segment go with it); idempotent.

        Waits at most ``CLOSE_TIMEOUT_S``: Mooncake 0.3.13's teardown joins its TCP transfer
        lanes, and once (under load, after a holder was frozen and thawed) that join never
        returned. Past the deadline the teardown is left running on its daemon thread (one
        warning) and the caller goes on.
        """
        with self._lock:
            store, self._store = self._store, None
        if store is None:
            return

        def teardown() -> None:
            try:
                store.close()
            except Exception:  # noqa: BLE001 - closing must not raise
                logger.exception("Mooncake close failed")

        closer = threading.Thread(target=teardown, name="mooncake-close", daemon=True)
        closer.start()
        closer.join(CLOSE_TIMEOUT_S)
        if closer.is_alive():
            logger.warning("Mooncake client teardown did not finish within %.0f s (a transfer lane still "
                           "joining); left to finish in the background", CLOSE_TIMEOUT_S)

    # ------------------------------------------------------------------------------ internals

    def _spans(self) -> list[tuple[int, int]]:
        return [(start, start + size) for start, size in self._regions]

    def _addresses(self, pages: list[memoryview], writable: bool) -> list[int]:
        spans = self._spans()
        out = []
        for page in pages:
            if writable and page.readonly:
                raise ValueError("a get needs writable pages")
            address, size = buffer_address(page), page.nbytes
            if size == 0 or not any(lo <= address and address + size <= hi for lo, hi in spans):
                raise ValueError(f"page [{address:#x}, +{size}) is not inside a registered arena")
            out.append(address)
        return out

    def _batched(self, keys: list[str], chunk_call, exclusive: bool = True) -> list[bool]:
        """Run ``chunk_call(lo, hi)`` per chunk of ``max_batch_keys``, under the lock if ``exclusive``
        (PUTs and GETs share the trailer staging buffer; lookups do not take it).

        After a chunk that found the master gone or silent, or a holder stalled (a transfer
        failure after ``transfer_timeout_s``), the remaining keys fail without a call, so one
        call never waits for more than one timeout.
        """
        out: list[bool] = []
        with self._lock if exclusive else contextlib.nullcontext():
            for lo in range(0, len(keys), self.max_batch_keys):
                hi = min(len(keys), lo + self.max_batch_keys)
                started = time.monotonic()
                codes = self._master_gate()
                if codes is None:
                    ok, codes = chunk_call(lo, hi)
                    out.extend(ok)
                else:
                    out.extend([False] * (hi - lo))
                stalled = -800 in codes and time.monotonic() - started >= 0.9 * self.config.transfer_timeout_s
                if MASTER_FAILURES & set(codes) or stalled:
                    self._master_down = -900 in codes
                    out.extend([False] * (len(keys) - hi))
                    break
        return out

    def _master_gate(self) -> Optional[list[int]]:
        """None if a call may go to Mooncake now; else the codes to report (closed, master down)."""
        if self._store is None:
            return [-1]
        if self._master_down:
            reason = master_unreachable_reason(self.config, self.config.rpc_timeout_s)
            if reason is not None:
                self._count([-900])
                return [-900]
            self._master_down = False
            logger.info("Mooncake master %s reachable again", self.config.master_server_address)
        return None

    def _call(self, method: str, *args: Any) -> Optional[list[int]]:
        keys = args[0] if args and isinstance(args[0], list) else ()
        thread = threading.get_ident()
        self._running[thread] = (f"{method}, {len(keys)} keys", time.monotonic())
        try:
            return list(getattr(self._store, method)(*args))
        except Exception as exc:  # noqa: BLE001 - a store failure is a miss, never a crash
            logger.warning("Mooncake %s raised %s: %s", method, type(exc).__name__, exc)
            return None
        finally:
            self._running.pop(thread, None)

    def _count(self, codes: list[int]) -> None:
        for code in codes:
            if code < 0:
                if code not in self.error_counts:
                    logger.warning("Mooncake store: %s (%d); such keys are misses", error_name(code), code)
                self.error_counts[code] = self.error_counts.get(code, 0) + 1

    def _put_chunk(self, keys, pages, addresses) -> tuple[list[bool], list[int]]:
        size = OBJECT_OVERHEAD_BYTES
        for i, page in enumerate(pages):
            trailer = pack_object_trailer(np.frombuffer(page, dtype=np.uint8), keys[i])
            self._staging[i * size : (i + 1) * size] = np.frombuffer(trailer, dtype=np.uint8)
        ptrs = [[address, self._staging_ptr + i * size] for i, address in enumerate(addresses)]
        sizes = [[page.nbytes, size] for page in pages]
        codes = self._call("batch_put_from_multi_buffers", keys, ptrs, sizes)
        codes = codes if codes is not None and len(codes) == len(keys) else [-1] * len(keys)
        self._count(codes)
        return [code == 0 for code in codes], codes

    def _get_chunk(self, keys, pages, addresses) -> tuple[list[bool], list[int]]:
        size = OBJECT_OVERHEAD_BYTES
        self._staging[: len(keys) * size] = 0  # no stale trailer can verify a failed read
        ptrs = [[address, self._staging_ptr + i * size] for i, address in enumerate(addresses)]
        sizes = [[page.nbytes, size] for page in pages]
        codes = self._call("batch_get_into_multi_buffers", keys, ptrs, sizes)
        codes = codes if codes is not None and len(codes) == len(keys) else [-1] * len(keys)
        self._count(codes)
        ok = []
        for i, (key, page, code) in enumerate(zip(keys, pages, codes)):
            if code != page.nbytes + size:
                ok.append(False)
                continue
            reason = verify_object(np.frombuffer(page, dtype=np.uint8), self._staging[i * size : (i + 1) * size], key)
            if reason is not None:
                self.corrupt_gets += 1
                logger.warning("Mooncake object %r failed its check (%s); a miss", key[:80], reason)
            ok.append(reason is None)
        return ok, codes

    def _exists_chunk(self, keys) -> tuple[list[bool], list[int]]:
        codes = self._call("batch_is_exist", keys)
        codes = codes if codes is not None and len(codes) == len(keys) else [-1] * len(keys)
        self._count(codes)
        return [code == 1 for code in codes], codes

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------- probe

_LEFT_OPEN: list[MooncakeStore] = []  # probe clients of a process about to exit

_PROBE_CHILD = """
import json, os, sys
from hiradix.tiers.store.base import StoreConfig
from hiradix.tiers.store.mooncake import probe_in_this_process
config = StoreConfig(**json.loads(sys.stdin.read()))
print(json.dumps({"reason": probe_in_this_process(config, close=False)}), flush=True)
os._exit(0)  # leave without Mooncake's ~0.9 s close: the master drops the client at its TTL
"""


def probe(config: StoreConfig, timeout_s: float) -> Optional[str]:
    """Why a Mooncake store at ``config`` is unusable from here, or None; within ``timeout_s``.

    Checks, in order: the wheel is installed; a TCP connection to the master opens; a child
    process (killed at the deadline, by PID) imports the wheel, sets up a client with
    ``config`` and answers one ``exists``. This process's environment and state are untouched.

    Returns:
        None, or one line: an unimportable wheel (with the import error and the install
        command), an unreachable or silent master, a failed client setup.
    """
    deadline = time.monotonic() + timeout_s
    import importlib.util

    if importlib.util.find_spec("mooncake") is None:
        return f"the Mooncake wheel is not installed ({WHEEL_HINT})"
    reason = master_unreachable_reason(config, min(timeout_s, max(config.rpc_timeout_s, 0.5)))
    if reason is not None:
        return reason
    env = {**os.environ, **mooncake_env(config)}
    try:
        proc = subprocess.Popen([sys.executable, "-c", _PROBE_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, text=True, start_new_session=True)  # fmt: skip
    except OSError as exc:
        return f"cannot start the probe process: {exc}"
    try:
        out, err = proc.communicate(config.to_json(), timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return (f"the store at master {config.master_server_address} did not answer within {timeout_s:g} s "
                "(a frozen master?)")
    return _probe_result(proc.returncode, out, err)


def _probe_result(returncode: int, out: str, err: str) -> Optional[str]:
    for line in reversed(out.strip().splitlines()):
        try:
            return json.loads(line)["reason"]
        except (ValueError, KeyError, TypeError):
            continue
    tail = [line for line in err.strip().splitlines() if line.strip()][-3:]
    return f"the probe process exited with {returncode}: {' | '.join(tail) or 'no output'}"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def probe_in_this_process(config: StoreConfig, close: bool = True) -> Optional[str]:
    """The probe's child side: import, set up, one ``exists`` (then close, unless ``close`` is
    False: the process is about to exit). Returns the reason or None."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except ImportError as exc:
        return f"the Mooncake wheel does not import: {exc} ({WHEEL_HINT}; it needs libibverbs.so.1)"
    os.environ.update(mooncake_env(config))
    try:
        store = MooncakeStore(config, max_batch_keys=1)
    except OSError as exc:
        return str(exc)
    try:
        codes = store._call("batch_is_exist", ["hiradix-probe"])
        if codes is None or codes[0] < 0:
            code = -1 if codes is None else codes[0]
            return f"the store at master {config.master_server_address} refused a lookup: {error_name(code)}"
        return None
    finally:
        if close:
            store.close()
        else:
            _LEFT_OPEN.append(store)  # dropping the last reference would close it (~0.9 s)
