"""Run a Mooncake Store on loopback for tests and benchmarks: one master plus N holder processes.

Example:
    >>> from hiradix.testing.mooncake import MooncakeCluster
    >>> with MooncakeCluster(num_holders=1, holder_segment_bytes=256 << 20) as cluster:
    ...     cluster.master_address        # '127.0.0.1:33041'
    ...     cluster.config_json()         # a StoreConfig for clients (global_segment_bytes 0)
    >>> # the master and the holders are gone here (stopped by PID)

What it starts, each in its own process session, with stdout and stderr in a log file:
    * ``mooncake_master --rpc_address=127.0.0.1 --rpc_port=P --metrics_host=127.0.0.1
      --metrics_port=M``; ready when ``GET http://127.0.0.1:M/health`` says ``service_ready``;
    * per holder, ``mooncake_client --global_segment_size=<bytes> --host=127.0.0.1 --port=Q
      --protocol=tcp --master_server_address=127.0.0.1:P --metadata_server=P2PHANDSHAKE`` with
      ``MC_TCP_BIND_ADDRESS=127.0.0.1``; ready when the master's ``master_total_capacity_bytes``
      (``/metrics``) counts its segment. The holders hold the objects: a client with
      ``global_segment_bytes`` 0 only moves them.

Both checks poll the master's HTTP endpoint every few ms until a deadline; a process that
exits first fails the start with its log tail (:class:`StoreStartError`), and everything
started so far is stopped. Fault methods (:meth:`kill_master`, :meth:`freeze_master`,
:meth:`thaw_master`, :meth:`restart_master`, :meth:`kill_holder`, :meth:`freeze_holder`,
:meth:`thaw_holder`, :meth:`start_holder`) act by PID.

The binaries come with the Mooncake wheel (next to its ``mooncake`` package, or on this
interpreter's ``bin/``); ports come from :func:`hiradix.testing.server.pick_free_port`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional, Sequence

from hiradix.testing import diagnose
from hiradix.testing.server import freeze_process, launch_env, pick_free_port
from hiradix.tiers.store.base import StoreConfig

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
MIN_SEGMENT_BYTES = 16 << 20  # mooncake_client refuses a smaller segment (0.3.13)


class StoreStartError(RuntimeError):
    """A master or holder exited, or was not ready in time; the message has the log tail."""


def find_binary(name: str) -> Path:
    """Path of a Mooncake executable (``mooncake_master``, ``mooncake_client``).

    Looks next to the installed ``mooncake`` package (the real binary), then in this
    interpreter's ``bin/`` and on ``PATH`` (the wheel's launchers, which exec it).

    Raises:
        FileNotFoundError: the wheel is not installed (the message says how to install it).
    """
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    for directory in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(directory) / name
        if candidate.is_file():
            if not os.access(candidate, os.X_OK):
                candidate.chmod(candidate.stat().st_mode | 0o111)
            return candidate
    for candidate in (Path(sys.executable).parent / name, shutil.which(name)):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise FileNotFoundError(
        f"{name} not found: install the Mooncake wheel (scripts/setup does: "
        "mooncake-transfer-engine-non-cuda==0.3.13.post1 without an NVIDIA GPU)"
    )


class _Proc:
    """One started binary: its command, Popen and log file."""

    def __init__(self, label: str, cmd: list[str], log_path: Path, env: dict[str, str]):
        self.label, self.cmd, self.log_path = label, cmd, log_path
        with open(log_path, "ab") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            self.popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True)  # fmt: skip
        diagnose.watch(self)
        logger.info("started %s pid=%d (log %s)", label, self.popen.pid, log_path)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def pids(self) -> list[int]:
        """Its PID while it runs (for ``hiradix.testing.diagnose``)."""
        return [self.popen.pid] if self.alive() else []

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.popen.pid, sig)

    def freeze(self, timeout_s: float = 10.0) -> None:
        """SIGSTOP, then wait until every thread is stopped (:func:`freeze_process`).

        Raises:
            TimeoutError: a thread was not stopped within ``timeout_s``.
        """
        if self.alive():
            freeze_process(self.pid, timeout_s)

    def stop(self, grace_s: float) -> Optional[int]:
        """SIGCONT (a frozen one cannot act on SIGTERM), SIGTERM, wait, then SIGKILL; by PID."""
        if self.alive():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s pid=%d ignored SIGTERM; SIGKILL", self.label, self.pid)
                self.signal(signal.SIGKILL)
        code = self.popen.wait()
        diagnose.unwatch(self)
        return code

    def kill(self) -> int:
        self.signal(signal.SIGKILL)
        code = self.popen.wait()
        diagnose.unwatch(self)
        return code

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            text = self.log_path.read_bytes().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-num_lines:])


class MooncakeCluster:
    """A Mooncake master and ``num_holders`` holder processes on loopback; a context manager.

    Attributes:
        num_holders: holder processes started by :meth:`start`.
        holder_segment_bytes: memory each holder contributes to the store, in bytes.
        log_dir: where ``master.log`` and ``holder-<i>.log`` are written.
        rpc_port, metrics_port: the master's RPC and HTTP ports.
        holder_ports: each holder's service port.
    """

    def __init__(
        self,
        num_holders: int = 1,
        holder_segment_bytes: int = 256 << 20,
        log_dir: str | os.PathLike | None = None,
        *,
        master_args: Sequence[str] = (),
        startup_timeout_s: float = 30.0,
        stop_grace_s: float = 5.0,
        rpc_timeout_ms: int = 1000,
        transfer_timeout_s: int = 2,
    ) -> None:
        """Describe the cluster; nothing starts until :meth:`start` or ``with``.

        Args:
            num_holders: holder processes (``>= 0``; 0 = a master alone).
            holder_segment_bytes: segment per holder, in bytes (``>= MIN_SEGMENT_BYTES``).
            log_dir: directory for the logs; None makes a temporary one (kept).
            master_args: more ``mooncake_master`` flags (e.g. ``--client_ttl=2``).
            startup_timeout_s: how long a process may take to be ready.
            stop_grace_s: SIGTERM -> SIGKILL delay when stopping.
            rpc_timeout_ms, transfer_timeout_s: put in :meth:`config` for clients.

        Raises:
            ValueError: a negative holder count or a segment below 16 MiB.
        """
        if num_holders < 0 or holder_segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"need num_holders >= 0 and holder_segment_bytes >= {MIN_SEGMENT_BYTES} (Mooncake's "
                             f"minimum), got {num_holders}, {holder_segment_bytes}")  # fmt: skip
        self.num_holders = num_holders
        self.holder_segment_bytes = int(holder_segment_bytes)
        self.log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="mooncake-"))
        self.master_args = list(master_args)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.rpc_timeout_ms = rpc_timeout_ms
        self.transfer_timeout_s = transfer_timeout_s
        self.rpc_port = pick_free_port()
        self.metrics_port = pick_free_port()
        self.holder_ports = [pick_free_port() for _ in range(num_holders)]
        self._master: Optional[_Proc] = None
        self._holders: list[Optional[_Proc]] = [None] * num_holders
        self._env = launch_env({"MC_TCP_BIND_ADDRESS": LOOPBACK})
        self.startup_s: dict[str, float] = {}  # label -> seconds from spawn to ready

    # ---------------------------------------------------------------------------- addresses

    @property
    def master_address(self) -> str:
        """``127.0.0.1:<rpc_port>``, the clients' ``master_server_address``."""
        return f"{LOOPBACK}:{self.rpc_port}"

    @property
    def master_pid(self) -> Optional[int]:
        """PID of the running master (None if stopped or dead)."""
        return self._master.pid if self._master is not None and self._master.alive() else None

    @property
    def holder_pids(self) -> list[Optional[int]]:
        """PID of each holder (None where stopped or dead)."""
        return [p.pid if p is not None and p.alive() else None for p in self._holders]

    def config(self, **overrides: Any) -> StoreConfig:
        """A :class:`StoreConfig` for a client of this store (``global_segment_bytes`` 0)."""
        fields = dict(master_server_address=self.master_address, protocol="tcp", metadata_server="P2PHANDSHAKE",
                      local_hostname=LOOPBACK, global_segment_bytes=0, rpc_timeout_ms=self.rpc_timeout_ms,
                      transfer_timeout_s=self.transfer_timeout_s)  # fmt: skip
        fields.update(overrides)
        return StoreConfig(**fields)

    def config_json(self, **overrides: Any) -> str:
        """:meth:`config` as JSON text, for ``--hiradix-store-config``."""
        return self.config(**overrides).to_json()

    # -------------------------------------------------------------------------- start, stop

    def start(self) -> MooncakeCluster:
        """Start the master, then the holders, each waited for; on failure stop all, re-raise.

        Raises:
            RuntimeError: already started.
            FileNotFoundError: the Mooncake binaries are missing.
            StoreStartError: a process exited or was not ready within ``startup_timeout_s``.
        """
        if self._master is not None:
            raise RuntimeError("cluster already started")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.start_master()
            for index in range(self.num_holders):
                self.start_holder(index)
        except BaseException:
            self.stop()
            raise
        return self

    def start_master(self) -> None:
        """Start (or restart) the master on its ports and wait until it serves."""
        if self._master is not None and self._master.alive():
            raise RuntimeError(f"master already running (pid {self._master.pid})")
        cmd = [str(find_binary("mooncake_master")), f"--rpc_address={LOOPBACK}", f"--rpc_port={self.rpc_port}",
               f"--metrics_host={LOOPBACK}", f"--metrics_port={self.metrics_port}", *self.master_args]  # fmt: skip
        spawned = time.monotonic()
        self._master = _Proc("mooncake_master", cmd, self.log_dir / "master.log", self._env)
        self._wait(self._master, self._master_serving)
        self.startup_s["master"] = time.monotonic() - spawned

    def start_holder(self, index: int) -> None:
        """Start (or restart) holder ``index`` and wait until the master counts its segment."""
        if self._holders[index] is not None and self._holders[index].alive():
            raise RuntimeError(f"holder {index} already running (pid {self._holders[index].pid})")
        before = self.capacity_bytes()
        cmd = [str(find_binary("mooncake_client")), f"--global_segment_size={self.holder_segment_bytes}",
               f"--host={LOOPBACK}", f"--port={self.holder_ports[index]}", "--protocol=tcp",
               f"--master_server_address={self.master_address}", "--metadata_server=P2PHANDSHAKE"]  # fmt: skip
        spawned = time.monotonic()
        holder = _Proc(f"mooncake_client[{index}]", cmd, self.log_dir / f"holder-{index}.log", self._env)
        self._holders[index] = holder
        self._wait(holder, lambda: self.capacity_bytes() >= before + self.holder_segment_bytes)
        self.startup_s[f"holder-{index}"] = time.monotonic() - spawned

    def stop(self) -> None:
        """Stop every holder, then the master (by PID: SIGCONT, SIGTERM, SIGKILL); idempotent."""
        if self._master is not None:
            self._master.signal(signal.SIGCONT)  # holders leaving talk to it
        for holder in self._holders:
            if holder is not None:
                holder.stop(self.stop_grace_s)
        if self._master is not None:
            self._master.stop(self.stop_grace_s)

    def __enter__(self) -> MooncakeCluster:
        if self._master is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # --------------------------------------------------------------------------------- faults

    def kill_master(self) -> None:
        """SIGKILL the master and reap it (its index of objects is lost)."""
        self._require_master().kill()

    def freeze_master(self) -> None:
        """SIGSTOP the master and wait until all its threads are stopped: it keeps its sockets but
        answers nothing."""
        self._require_master().freeze()

    def thaw_master(self) -> None:
        """SIGCONT the master."""
        self._require_master().signal(signal.SIGCONT)

    def restart_master(self, wait_holders: bool = True) -> None:
        """Start a fresh master on the same ports (killing a live one first).

        Args:
            wait_holders: also wait until every live holder has re-mounted its segment
                (they re-register by themselves within about a second).
        """
        if self._master is not None and self._master.alive():
            self._master.kill()
        self._master = None
        self.start_master()
        if wait_holders:
            expected = self.holder_segment_bytes * sum(pid is not None for pid in self.holder_pids)
            self._wait(self._master, lambda: self.capacity_bytes() >= expected)

    def freeze_holder(self, index: int) -> None:
        """SIGSTOP holder ``index`` (thaw it within the master's client TTL, 10 s by default,
        or the master unmounts its segment); returns once all its threads are stopped."""
        self._require_holder(index).freeze()

    def thaw_holder(self, index: int) -> None:
        """SIGCONT holder ``index``."""
        self._require_holder(index).signal(signal.SIGCONT)

    def kill_holder(self, index: int) -> None:
        """SIGKILL holder ``index`` and reap it (the objects in its segment are gone)."""
        self._require_holder(index).kill()

    # ------------------------------------------------------------------------------- queries

    def health(self) -> Optional[dict]:
        """The master's ``/health`` JSON, or None if it does not answer."""
        try:
            with urllib.request.urlopen(f"http://{LOOPBACK}:{self.metrics_port}/health", timeout=2) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def metrics(self) -> dict[str, float]:
        """The master's Prometheus gauges and counters (unlabelled ones), or {} if silent."""
        try:
            with urllib.request.urlopen(f"http://{LOOPBACK}:{self.metrics_port}/metrics", timeout=2) as resp:
                text = resp.read().decode()
        except (urllib.error.URLError, OSError):
            return {}
        out = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if line and not line.startswith("#") and "{" not in name:
                try:
                    out[name] = float(value)
                except ValueError:
                    continue
        return out

    def capacity_bytes(self) -> int:
        """Memory the master has mounted from holders, in bytes (0 if it does not answer)."""
        return int(self.metrics().get("master_total_capacity_bytes", 0))

    def key_count(self) -> int:
        """Objects the master lists (0 if it does not answer)."""
        return int(self.metrics().get("master_key_count", 0))

    # ------------------------------------------------------------------------------ helpers

    def _require_master(self) -> _Proc:
        if self._master is None:
            raise RuntimeError("master not started")
        return self._master

    def _require_holder(self, index: int) -> _Proc:
        holder = self._holders[index]
        if holder is None:
            raise RuntimeError(f"holder {index} was never started")
        return holder

    def _master_serving(self) -> bool:
        health = self.health()
        return bool(health and health.get("service_ready"))

    def _wait(self, proc: _Proc, ready, poll_s: float = 0.01) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while not ready():
            if not proc.alive():
                raise StoreStartError(f"{proc.label} exited with {proc.popen.returncode} before it was ready; "
                                      f"log {proc.log_path}:\n{proc.log_tail()}")  # fmt: skip
            if time.monotonic() > deadline:
                raise StoreStartError(f"{proc.label} not ready after {self.startup_timeout_s:g} s; "
                                      f"log {proc.log_path}:\n{proc.log_tail()}")  # fmt: skip
            time.sleep(poll_s)


def hicache_mooncake_args(config: StoreConfig, *, prefetch_policy: str = "wait_complete") -> list[str]:
    """``launch_server`` flags for stock SGLang HiCache with ``config``'s Mooncake store (L3).

    Direct I/O with the ``page_first_direct`` host layout (SGLang switches to it for Mooncake
    anyway; on CPU it needs patches/p05), the store given as ``extra_config`` with
    ``global_segment_size`` 0 (the holders keep the objects), and ``prefetch_policy``
    (``wait_complete``: a request waits for its storage prefetch, so its hits are deterministic).
    Pass ``--page-size`` yourself. With :func:`hicache_mooncake_env`.
    """
    extra = {"master_server_address": config.master_server_address, "metadata_server": config.metadata_server,
             "protocol": config.protocol, "device_name": config.device_name, "local_hostname": config.local_hostname,
             "global_segment_size": config.global_segment_bytes}  # fmt: skip
    return [
        "--enable-hierarchical-cache",
        "--hicache-io-backend", "direct",
        "--hicache-mem-layout", "page_first_direct",
        "--hicache-storage-backend", "mooncake",
        "--hicache-storage-backend-extra-config", json.dumps(extra),
        "--hicache-storage-prefetch-policy", prefetch_policy,
    ]  # fmt: skip


def hicache_mooncake_env(config: StoreConfig) -> dict[str, str]:
    """Environment for a stock HiCache + Mooncake server on CPU: the client deadlines and
    loopback binding of ``config`` (:func:`hiradix.tiers.store.mooncake.mooncake_env`) and
    ``SGLANG_HICACHE_MOONCAKE_REUSE_TE=0`` (else SGLang builds its shared Mooncake transfer
    engine for a GPU)."""
    from hiradix.tiers.store.mooncake import mooncake_env

    return {**mooncake_env(config), "SGLANG_HICACHE_MOONCAKE_REUSE_TE": "0"}
