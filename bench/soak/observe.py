"""What a soak observes on a hiradix server: its log's error lines, its process tree's resources
and private directories (`Snapshot`), the tiers after `/flush_cache`, and how an end snapshot
differs from a baseline. Shared by `bench.soak.run` (one server) and `bench.soak.fleet` (a fleet
behind SGLang's router).
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import psutil

from hiradix.runtime.metrics import TIERS as METRIC_TIERS
from hiradix.testing.resources import TreeUsage, dir_modes, private_mode_problems, tree_usage
from hiradix.testing.server import ServerProcess
from hiradix.tiers.files import default_shm_dir

# Lines that mean the server is broken (tree invariant, scheduler crash, SGLang's leak check).
ERROR_MARKERS = ("IntegrityError", "Scheduler hit an exception", "memory leak", "Traceback (most recent", "SIGQUIT")
SUMMARY_RE = re.compile(
    r"tokens per tier HBM/DRAM/NVMe=\[(\d+), (\d+), (\d+)\] DRAM pages=(\d+)/(\d+) NVMe slots=(\d+)/(\d+)"
)
WORKER_EXIT_RE = re.compile(r"io-worker\[\d+\] ERROR|I/O worker pid \d+ died")
GENERATION_RE = re.compile(r"-(\d+)\.(?:jobs|acks)$")
TIER_GAUGE_RE = re.compile(r'^sglang:hiradix_tier_used_tokens\{[^}]*tier="([^"]+)"[^}]*\}\s+(\S+)', re.M)


class Snapshot(msgspec.Struct):
    """Resources of the server at one point: the process tree and the two private directories."""

    usage: TreeUsage
    nvme_dir: dict[str, str]  # dir_modes of <nvme path>/hiradix-rank0
    socket_dir: dict[str, str]  # dir_modes of the worker's socket directory
    worker_sockets: list[str] = []  # names of the live I/O worker's two sockets (from its command line)
    # fd_kinds entries of the I/O worker's TCP connections to the store's processes (master, holders):
    # Mooncake's client pools them (RPC connections that close when idle, up to tcp_lanes_per_peer lanes
    # per holder), so they are bounded (`store_connection_problems`), not compared with the baseline.
    store_connections: dict[str, int] = {}

    def own_fds(self) -> tuple[int, int]:
        """(fds, sockets) without the store connections."""
        pooled = sum(self.store_connections.values())
        return self.usage.num_fds - pooled, self.usage.num_sockets - pooled

    def socket_dir_shape(self) -> dict[str, str]:
        """`socket_dir` with the live worker's sockets named by role ("live worker.jobs"), so a
        respawned worker (its sockets carry a new generation) compares equal; the sockets of
        any other incarnation keep their names and so differ."""
        live = set(self.worker_sockets)
        return {("live worker" + Path(name).suffix if name in live else name): mode
                for name, mode in self.socket_dir.items()}

    def worker_generation(self) -> int | None:
        """The live worker's incarnation number (`<instance>-<generation>.jobs`), if seen."""
        found = [int(m.group(1)) for name in self.worker_sockets if (m := GENERATION_RE.search(name))]
        return max(found) if found else None

    def comparable(self) -> tuple:
        """What must be equal to the baseline at the end (not memory)."""
        u = self.usage
        return (u.num_processes, *self.own_fds(), u.shm_paths, self.nvme_dir, self.socket_dir_shape())


class LogScanner:
    """Reads a growing log file; keeps the lines holding an error marker, and the I/O worker's
    exits (its own last error line and the scheduler's "died with" line)."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.errors: list[str] = []
        self.worker_exits: list[str] = []

    def read_new(self) -> str:
        """Whole lines appended since the last call (new error-marker lines are kept); a line
        still being written is left for the next call."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        data = data[: data.rfind(b"\n") + 1]
        self.offset += len(data)
        text = data.decode("utf-8", errors="replace")
        self.errors += [line for line in text.splitlines() if any(m in line for m in ERROR_MARKERS)][:50]
        self.worker_exits += [line[:400] for line in text.splitlines() if WORKER_EXIT_RE.search(line)][:50]
        return text


def worker_socket_dir(server: ServerProcess) -> Path | None:
    """`/dev/shm/hiradix-<uid>-<scheduler pid>-rank0/sock` of the server's scheduler, if any
    (`hiradix.tiers.dram.default_shm_dir` names it after the scheduler's pid)."""
    base = default_shm_dir().parent
    for process in server.descendants():
        candidate = base / f"hiradix-{os.geteuid()}-{process.pid}-rank0" / "sock"
        if candidate.is_dir():
            return candidate
    return None


def live_worker_sockets(server: ServerProcess) -> list[str]:
    """Names of the socket files the server's live I/O worker was started with (`--jobs`,
    `--acks` on its command line), sorted."""
    names = []
    for process in server.descendants():
        try:
            args = process.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if "hiradix.io.worker" in args:
            names += [Path(args[i + 1]).name for i, a in enumerate(args[:-1]) if a in ("--jobs", "--acks")]
    return sorted(names)


def server_usage(server: ServerProcess) -> TreeUsage:
    """`tree_usage` of the launcher and all its descendants."""
    launcher = [psutil.Process(server.pid)] if process_alive(server.pid) else []
    return tree_usage(launcher + server.descendants())


def listening_ports(pids: list[int | None]) -> frozenset[int]:
    """TCP ports the given processes listen on (a store's master and holders); dead ones skipped."""
    ports = set()
    for pid in filter(None, pids):
        try:
            ports |= {c.laddr.port for c in psutil.Process(pid).net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN}
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return frozenset(ports)


def store_connection_kinds(usage: TreeUsage, store_ports: frozenset[int]) -> dict[str, int]:
    """The `fd_kinds` entries of the I/O worker's connections to one of `store_ports`."""
    prefix = "hiradix.io.worker tcp out :"
    return {kind: n for kind, n in usage.fd_kinds.items()
            if kind.startswith(prefix) and int(kind.removeprefix(prefix)) in store_ports}


def snapshot(server: ServerProcess, nvme_rank_dir: Path, store_ports: frozenset[int] = frozenset()) -> Snapshot:
    """Measure the server tree and its two private directories now (`store_ports`: the store's
    processes' listening ports, whose connections are pooled: `Snapshot.store_connections`)."""
    sock = worker_socket_dir(server)
    usage = server_usage(server)
    return Snapshot(usage, dir_modes(nvme_rank_dir), dir_modes(sock) if sock else {},
                    live_worker_sockets(server), store_connection_kinds(usage, store_ports))


def store_connection_problems(e: Snapshot, per_port_bound: int) -> list[str]:
    """Pooled store connections over their bound: more than `per_port_bound` to one store port."""
    return [f"{n} connections of the I/O worker to store port {kind.rsplit(':', 1)[1]}, more than "
            f"its pool's {per_port_bound}" for kind, n in e.store_connections.items() if n > per_port_bound]


def settled_snapshot(server: ServerProcess, nvme_rank_dir: Path, timeout_s: float,
                     target: Snapshot | None = None, store_ports: frozenset[int] = frozenset()) -> Snapshot:
    """A snapshot once two reads 0.5 s apart agree (or equal `target`); the last one on timeout."""
    deadline = time.monotonic() + timeout_s
    previous = snapshot(server, nvme_rank_dir, store_ports)
    while time.monotonic() < deadline:
        if target is not None and previous.comparable() == target.comparable():
            return previous
        time.sleep(0.5)
        current = snapshot(server, nvme_rank_dir, store_ports)
        if target is None and current.comparable() == previous.comparable():
            return current
        previous = current
    return previous


def quiet_snapshot(server: ServerProcess, nvme_rank_dir: Path, quiet_s: float, timeout_s: float,
                   store_ports: frozenset[int] = frozenset()) -> Snapshot:
    """A snapshot once its comparable part has not changed for `quiet_s` seconds; the last one on
    timeout. For a baseline taken right after a load: the connections the load left open close
    only after SGLang's HTTP keep-alive timeout (`SGLANG_TIMEOUT_KEEP_ALIVE`, 5 s)."""
    deadline = time.monotonic() + timeout_s
    current, since = snapshot(server, nvme_rank_dir, store_ports), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
        time.sleep(0.5)
        new = snapshot(server, nvme_rank_dir, store_ports)
        if new.comparable() != current.comparable():
            since = time.monotonic()
        current = new
    return current


def integrity_checking_on(server: ServerProcess) -> bool:
    """Whether the scheduler runs with HIRADIX_CHECK_INTEGRITY=1, read from its child, the I/O
    worker, which inherits its environment (the scheduler's own /proc environ is overwritten by
    its process title)."""
    for process in server.descendants():
        try:
            if "hiradix.io.worker" in process.cmdline():
                return process.environ().get("HIRADIX_CHECK_INTEGRITY") == "1"
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return False


def parse_tier_tokens(metrics_text: str) -> dict[str, float]:
    """`{tier: tokens}` from the `sglang:hiradix_tier_used_tokens` gauges of a /metrics page (summed over ranks)."""
    found: dict[str, float] = {}
    for tier, value in TIER_GAUGE_RE.findall(metrics_text):
        found[tier] = found.get(tier, 0.0) + float(value)
    return found


def process_alive(pid: int | None) -> bool:
    """Whether `pid` is a live, non-zombie process."""
    try:
        return pid is not None and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def http_request(http: aiohttp.ClientSession, method: str, url: str, timeout_s: float = 60.0) -> tuple[int, str]:
    """`(status, body)`; status 0 when the server could not be reached or timed out."""
    try:
        async with http.request(method, url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return resp.status, await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"



@dataclass
class FlushResult:
    """What a server's tiers hold after `/flush_cache` (see `flush_and_check`)."""

    tier_tokens: dict[str, float] = field(default_factory=dict)  # sglang:hiradix_tier_used_tokens by tier
    summary: dict[str, int] = field(default_factory=dict)  # the tiers' summary line, parsed
    violations: list[str] = field(default_factory=list)


async def flush_and_check(base_url: str, settle_timeout_s: float, scanner: LogScanner) -> FlushResult:
    """Flush the cache (retrying while requests finish, up to `settle_timeout_s`), then read the
    tiers' gauges and their next summary line (each `/health_generate` runs one scheduler step;
    the summary is logged at most every 10 s). Violations: a gauge or a used DRAM page / NVMe
    slot that is not 0, a missing gauge or summary line, a flush that kept failing."""
    report = FlushResult()
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + settle_timeout_s
        while (status := (await http_request(http, "POST", base_url + "/flush_cache"))[0]) != 200:
            if time.monotonic() > deadline:
                report.violations.append(f"/flush_cache kept failing (last status {status})")
                return report
            await asyncio.sleep(0.5)  # polls a state: the server finishing its last requests
        scanner.read_new()  # what was logged before the flush
        summary: tuple | None = None
        deadline = time.monotonic() + 30.0
        while summary is None and time.monotonic() < deadline:
            await http_request(http, "GET", base_url + "/health_generate")
            found = SUMMARY_RE.findall(scanner.read_new())
            summary = found[-1] if found else None
            if summary is None:
                await asyncio.sleep(1.0)
        report.tier_tokens = parse_tier_tokens((await http_request(http, "GET", base_url + "/metrics"))[1])
    if summary is None:
        report.violations.append("no tiers summary line within 30 s after /flush_cache")
    else:
        keys = ("hbm_tokens", "dram_tokens", "nvme_tokens", "dram_pages_used", "dram_pages", "nvme_slots_used", "nvme_slots")
        report.summary = dict(zip(keys, map(int, summary)))
    for key in ("dram_pages_used", "nvme_slots_used"):
        if report.summary.get(key, 0) != 0:
            report.violations.append(f"after /flush_cache {key} = {report.summary[key]}, expected 0")
    if set(report.tier_tokens) != set(METRIC_TIERS):
        report.violations.append(f"sglang:hiradix_tier_used_tokens gauges missing: {report.tier_tokens}")
    for tier, tokens in report.tier_tokens.items():
        if tokens != 0:
            report.violations.append(f"after /flush_cache sglang:hiradix_tier_used_tokens{{tier={tier}}} = {tokens:g}, expected 0")
    return report


def _diff(name: str, before: Any, after: Any) -> list[str]:
    if before == after:
        return []
    if isinstance(before, dict):
        added = {k: after[k] for k in sorted(after.keys() - before.keys())}
        removed = {k: before[k] for k in sorted(before.keys() - after.keys())}
        changed = {k: (before[k], after[k]) for k in sorted(before.keys() & after.keys()) if before[k] != after[k]}
        return [f"{name} differs from the baseline: added {added}, removed {removed}, changed {changed}"]
    if isinstance(before, list):
        return [f"{name} differs from the baseline: added {sorted(set(after) - set(before))}, "
                f"removed {sorted(set(before) - set(after))}"]
    return [f"{name}: {before} at the baseline, {after} at the end"]


def worker_respawns(b: Snapshot, e: Snapshot) -> int | None:
    """How many times the I/O worker was started again between `b` and `e` (None: unknown)."""
    first, last = b.worker_generation(), e.worker_generation()
    return None if first is None or last is None else last - first


def snapshot_diffs(b: Snapshot, e: Snapshot) -> list[str]:
    """What differs between a baseline `b` and an end `e` (processes, fds and sockets other than
    the pooled store connections, /dev/shm entries, both directories; the worker socket directory must hold exactly the live worker's
    two sockets, whichever incarnation it is: see `worker_respawns`), and the directories' modes
    that are not private."""
    problems = []
    for name, before, after in (
        ("processes", b.usage.num_processes, e.usage.num_processes),
        ("open fds", b.own_fds()[0], e.own_fds()[0]),
        ("sockets", b.own_fds()[1], e.own_fds()[1]),
        ("/dev/shm entries held", b.usage.shm_paths, e.usage.shm_paths),
        ("NVMe directory", b.nvme_dir, e.nvme_dir),
        ("worker socket directory", b.socket_dir_shape(), e.socket_dir_shape()),
    ):
        problems += _diff(name, before, after)
    if len(e.worker_sockets) != 2:
        problems.append(f"the live I/O worker's sockets not found at the end: {e.worker_sockets}")
    if b.own_fds() != e.own_fds():
        own = [{k: n for k, n in x.usage.fd_kinds.items() if k not in x.store_connections} for x in (b, e)]
        problems += _diff("open fds by process and kind", *own)
    if not b.nvme_dir or not b.socket_dir:
        problems.append(f"NVMe or socket directory not found at the baseline: {b.nvme_dir}, {b.socket_dir}")
    for name, modes in (("NVMe directory", b.nvme_dir), ("worker socket directory", b.socket_dir)):
        problems += [f"{name} not private: {p}" for p in private_mode_problems(modes)]
    return problems
