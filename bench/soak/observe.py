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
TIER_GAUGE_RE = re.compile(r'^sglang:hiradix_tier_used_tokens\{[^}]*tier="([^"]+)"[^}]*\}\s+(\S+)', re.M)


class Snapshot(msgspec.Struct):
    """Resources of the server at one point: the process tree and the two private directories."""

    usage: TreeUsage
    nvme_dir: dict[str, str]  # dir_modes of <nvme path>/hiradix-rank0
    socket_dir: dict[str, str]  # dir_modes of the worker's socket directory

    def comparable(self) -> tuple:
        """What must be equal to the baseline at the end (not memory)."""
        u = self.usage
        return (u.num_processes, u.num_fds, u.num_sockets, u.shm_paths, self.nvme_dir, self.socket_dir)


class LogScanner:
    """Reads a growing log file; keeps the lines holding an error marker."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.errors: list[str] = []

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


def server_usage(server: ServerProcess) -> TreeUsage:
    """`tree_usage` of the launcher and all its descendants."""
    launcher = [psutil.Process(server.pid)] if process_alive(server.pid) else []
    return tree_usage(launcher + server.descendants())


def snapshot(server: ServerProcess, nvme_rank_dir: Path) -> Snapshot:
    """Measure the server tree and its two private directories now."""
    sock = worker_socket_dir(server)
    return Snapshot(server_usage(server), dir_modes(nvme_rank_dir), dir_modes(sock) if sock else {})


def settled_snapshot(server: ServerProcess, nvme_rank_dir: Path, timeout_s: float,
                     target: Snapshot | None = None) -> Snapshot:
    """A snapshot once two reads 0.5 s apart agree (or equal `target`); the last one on timeout."""
    deadline = time.monotonic() + timeout_s
    previous = snapshot(server, nvme_rank_dir)
    while time.monotonic() < deadline:
        if target is not None and previous.comparable() == target.comparable():
            return previous
        time.sleep(0.5)
        current = snapshot(server, nvme_rank_dir)
        if target is None and current.comparable() == previous.comparable():
            return current
        previous = current
    return previous


def quiet_snapshot(server: ServerProcess, nvme_rank_dir: Path, quiet_s: float, timeout_s: float) -> Snapshot:
    """A snapshot once its comparable part has not changed for `quiet_s` seconds; the last one on
    timeout. For a baseline taken right after a load: the connections the load left open close
    only after SGLang's HTTP keep-alive timeout (`SGLANG_TIMEOUT_KEEP_ALIVE`, 5 s)."""
    deadline = time.monotonic() + timeout_s
    current, since = snapshot(server, nvme_rank_dir), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
        time.sleep(0.5)
        new = snapshot(server, nvme_rank_dir)
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
        added = {k: after[k] for k in after.keys() - before.keys()}
        removed = {k: before[k] for k in before.keys() - after.keys()}
        changed = {k: (before[k], after[k]) for k in before.keys() & after.keys() if before[k] != after[k]}
        return [f"{name} differs from the baseline: added {added}, removed {removed}, changed {changed}"]
    if isinstance(before, list):
        return [f"{name} differs from the baseline: added {sorted(set(after) - set(before))}, "
                f"removed {sorted(set(before) - set(after))}"]
    return [f"{name}: {before} at the baseline, {after} at the end"]


def snapshot_diffs(b: Snapshot, e: Snapshot) -> list[str]:
    """What differs between a baseline `b` and an end `e` (processes, fds, sockets, /dev/shm
    entries, both directories), and the directories' modes that are not private."""
    problems = []
    for name, before, after in (
        ("processes", b.usage.num_processes, e.usage.num_processes),
        ("open fds", b.usage.num_fds, e.usage.num_fds),
        ("sockets", b.usage.num_sockets, e.usage.num_sockets),
        ("/dev/shm entries held", b.usage.shm_paths, e.usage.shm_paths),
        ("NVMe directory", b.nvme_dir, e.nvme_dir),
        ("worker socket directory", b.socket_dir, e.socket_dir),
    ):
        problems += _diff(name, before, after)
    if not b.nvme_dir or not b.socket_dir:
        problems.append(f"NVMe or socket directory not found at the baseline: {b.nvme_dir}, {b.socket_dir}")
    for name, modes in (("NVMe directory", b.nvme_dir), ("worker socket directory", b.socket_dir)):
        problems += [f"{name} not private: {p}" for p in private_mode_problems(modes)]
    return problems
