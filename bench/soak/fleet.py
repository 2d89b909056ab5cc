"""Fleet soak: skewed multi-turn chat through SGLang's router across two hiradix servers that share
one Mooncake Store, with a store holder and one server restarted during it; then prove that every
answer was right and nothing leaked.

The fleet (all on loopback, stopped by PID): a Mooncake master and `holders` holders
(`MooncakeCluster`); hiradix servers `a` and `b` (tiny model, all tiers small so they churn:
HBM `--max-total-tokens`, DRAM, NVMe in a private directory, the store;
`HIRADIX_CHECK_INTEGRITY=1`: the tree proves its invariants after every scheduler step;
`--served-model-name default`); SGLang's router (`RouterProcess`, `--policy`, round_robin by
default, its worker overload protection off: see `FleetConfig.router_overload_protection`) in
front of them; and one stock SGLang server, not behind the router, as the reference.

The load (`bench.soak.fleet_load`): a few long hot sessions and many short ones; every turn goes
to the router and to the stock server, and the answers must be equal (greedy). What failure is
allowed, and how it is counted, is said there: only routed requests in flight during the server
restart may fail, each is retried once, and the retry must answer.

Timeline (t from the start of the load; `duration_s` in all):
    0            warm-up (`warmup_s`), drain, baselines of both servers (`bench.soak.observe.Snapshot`)
    duration/3   holder 0 killed (SIGKILL), restarted once the master dropped its segment
    2*duration/3 server b stopped (SIGTERM) and started again on its port; the router lists it
                 healthy again; after a warm-up, drain and a new baseline for b
    duration     drain, `/flush_cache` on both servers, end checks
Every `check_interval_s`: RSS and open fds of each server's process tree, the router's RSS, the
store's object count; error lines of the server logs.

End checks (each failure is a violation; exit status 1):
    * the load's (`FleetLoadStats.violations`);
    * per server: the tiers' gauges and its DRAM pages / NVMe slots are 0 after the flush;
      processes, fds, sockets, /dev/shm entries, NVMe and socket directories equal its (last)
      baseline (the socket directory holds exactly the live I/O worker's two sockets, whichever
      incarnation it is; a changed fd count is named by process and kind; the I/O worker's pooled
      connections to the store's processes are not compared but bounded: at most
      `tcp_lanes_per_peer` per store port); RSS at the end within
      `rss_bound_bytes` of that baseline; no error line in its log outside the restart;
    * reported, not judged: the I/O worker's exits and respawns (a Mooncake client wedge ends a
      worker, `hiradix/tiers/store/mooncake.py`; a fresh one takes over);
    * flat series, per server life (b's before and after its restart separately): RSS within
      `rss_bound_bytes`, fds within `fd_slack`; the router's RSS within `router_rss_slack_bytes`;
      the store never holds more objects than its holders' capacity in pages;
    * after the stops: no process of any server left, each scheduler's /dev/shm directory gone.

Output: `<out_dir>/soak_report.json` (`FleetReport`), `<out_dir>/resources.png`, the logs.
CLI: `python -m bench.soak.fleet --duration-s 1800` (scripts/soak-fleet wraps it).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import shutil
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import aiohttp
import msgspec
import psutil

if __package__ in (None, ""):  # run as a file: python bench/soak/fleet.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.soak.fleet_checks import MIB, Flatness, Sample, flat_violations, flatness, page_bytes
from bench.soak.fleet_load import MODEL, FleetLoad, RetryWindow, SkewedLoad
from bench.soak.fleet_plot import plot_resources
from bench.soak.fleet_ttft import phase_line, ttft_by_phase
from bench.soak.observe import (
    LogScanner, Snapshot, flush_and_check, integrity_checking_on, process_alive, quiet_snapshot, server_usage, settled_snapshot,
    snapshot_diffs, store_connection_kinds, store_connection_problems, worker_respawns, worker_socket_dir,
    listening_ports,
)  # fmt: skip
from bench.common.multiturn import http_connector
from bench.soak.run import DRAM_MAPPERS
from hiradix.testing.mooncake import MooncakeCluster
from hiradix.testing.router import RouterProcess
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env, stop_all

logger = logging.getLogger(__name__)

# A baseline is taken once a server's processes, fds, sockets and directories stayed unchanged
# this long (> SGLang's 5 s HTTP keep-alive, so the connections the load left open have closed).
QUIET_S = 8.0


@dataclass(frozen=True)
class FleetConfig:
    """What to run and how long (times in seconds, sizes in GB = 1e9 bytes unless named)."""

    out_dir: Path
    model: str = "models/tiny"
    duration_s: float = 1800.0  # load time, warm-up included
    warmup_s: float | None = None  # None: min(60, duration_s / 8)
    policy: str = "round_robin"  # the router's --policy
    # The router's overload protection (on by default in smg: a worker with >= 8 waiting requests is
    # skipped). Off here: while b restarts, a carries the whole load, is skipped, and the router
    # answers 503 no_available_workers (first 30-minute run: 1,509 such failures in 57 s, 1,487 of
    # their retries failed too). --router-overload-protection turns it back on.
    router_overload_protection: bool = False
    load: SkewedLoad = SkewedLoad()
    max_running_requests: int = 4
    max_total_tokens: int = 2048  # HBM of each hiradix server, tokens
    page_tokens: int = 16
    dram_gb: float = 0.004  # ~120 pages of the tiny model
    nvme_gb: float = 0.02  # ~600 slots
    holders: int = 2
    holder_segment_mb: int = 64
    check_interval_s: float = 10.0
    settle_timeout_s: float = 60.0
    restart_grace_s: float = 15.0  # the retry window stays open this long after b is listed healthy
    rss_slack_bytes: int = 96 * MIB
    fd_slack: int = 24  # open fds a server tree may gain (HTTP connections come and go)
    router_rss_slack_bytes: int = 64 * MIB
    startup_timeout_s: float = 300.0

    @property
    def warmup(self) -> float:
        return self.warmup_s if self.warmup_s is not None else min(60.0, self.duration_s / 8)

    def validate(self) -> None:
        """Raises: ValueError: a value out of range (names the option)."""
        self.load.validate()
        if self.duration_s <= 0 or not 0 <= 3 * self.warmup < self.duration_s:
            raise ValueError(f"--duration-s must exceed 3 x --warmup-s, got {self.duration_s}, {self.warmup}")
        if self.holders < 1 or self.check_interval_s <= 0 or self.settle_timeout_s <= 0:
            raise ValueError("--holders >= 1, --check-interval-s and --settle-timeout-s > 0")

    def rss_bound_bytes(self, baseline_rss_bytes: int) -> int:
        """Allowed RSS growth of a server tree (as `bench.soak.run.SoakConfig.rss_bound_bytes`):
        the DRAM tier touched by each process that maps it, plus max(slack, 5% of the baseline)."""
        return int(DRAM_MAPPERS * self.dram_gb * 1e9 + max(self.rss_slack_bytes, 0.05 * baseline_rss_bytes))


class Life(msgspec.Struct):
    """One life of a server (b has two: before and after its restart)."""

    started_t_s: float
    baseline_t_s: float | None = None  # when its baseline was taken; its series start there
    baseline: Snapshot | None = None
    end: Snapshot | None = None
    ended_by: str = ""  # "restart" or "end"
    integrity_checking: bool = False
    rss: Flatness | None = None
    fds: Flatness | None = None
    rss_end_growth_bytes: int = 0
    worker_respawns: int | None = None  # I/O worker restarts between baseline and end (None: not judged)


class ServerResult(msgspec.Struct):
    log: str
    lives: list[Life] = msgspec.field(default_factory=list)
    tier_tokens_after_flush: dict[str, float] = msgspec.field(default_factory=dict)
    summary_after_flush: dict[str, int] = msgspec.field(default_factory=dict)
    log_errors: list[str] = msgspec.field(default_factory=list)
    restart_log_lines: list[str] = msgspec.field(default_factory=list)  # error lines logged while stopping
    # The I/O worker's exits (its last error line, the scheduler's "died with" line): reported,
    # not violations (a fresh worker takes over; the Mooncake client wedge, tiers/store/mooncake.py)
    worker_exits: list[str] = msgspec.field(default_factory=list)


class FleetReport(msgspec.Struct):
    """The JSON report (`soak_report.json`). Times in seconds, memory in bytes."""

    config: dict[str, Any]
    ok: bool = False
    violations: list[str] = msgspec.field(default_factory=list)
    wall_s: float = 0.0
    events: list[tuple[str, float, float]] = msgspec.field(default_factory=list)  # (name, t_s, seconds taken)
    load: dict[str, Any] = msgspec.field(default_factory=dict)  # FleetLoadStats
    router_requests_per_worker: dict[str, float] = msgspec.field(default_factory=dict)
    router_worker_retries: float = 0.0  # smg_worker_retries_total
    servers: dict[str, ServerResult] = msgspec.field(default_factory=dict)
    router_rss: Flatness | None = None
    store_objects: Flatness | None = None
    store_object_bound: int = 0  # objects the holders can hold (capacity / page bytes)
    store_objects_max: int = 0
    samples: list[Sample] = msgspec.field(default_factory=list)
    ttft_by_phase: list[dict[str, Any]] = msgspec.field(default_factory=list)  # bench.soak.fleet_ttft


@dataclass
class Member:
    """A hiradix server of the fleet and what the soak tracks about it."""

    name: str
    server: ServerProcess
    nvme_rank_dir: Path
    result: ServerResult
    scanner: LogScanner
    restarting: bool = False
    socket_dirs: set[str] = field(default_factory=set)  # every scheduler's /dev/shm directory seen

    @property
    def life(self) -> Life:
        return self.result.lives[-1]


@dataclass
class Fleet:
    config: FleetConfig
    cluster: MooncakeCluster
    members: list[Member]
    stock: ServerProcess
    router: RouterProcess
    report: FleetReport
    t0: float = 0.0

    def store_ports(self) -> frozenset[int]:
        """The listening ports of the store's master and holders now (a restarted holder gets new ones)."""
        return listening_ports([self.cluster.master_pid, *self.cluster.holder_pids])

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 1)


# ---------------------------------------------------------------------------------- setup


def hiradix_args(config: FleetConfig, nvme_root: Path, store_json: str) -> list[str]:
    return cpu_args(config.max_total_tokens) + [
        "--page-size", str(config.page_tokens), "--max-running-requests", str(config.max_running_requests),
        "--served-model-name", MODEL, "--enable-hiradix",
        "--hiradix-dram-gb", str(config.dram_gb), "--hiradix-nvme-path", str(nvme_root),
        "--hiradix-nvme-gb", str(config.nvme_gb), "--hiradix-load-timeout-s", "2",
        "--hiradix-store", "mooncake", "--hiradix-store-config", store_json,
    ]  # fmt: skip


def build_fleet(config: FleetConfig, report: FleetReport) -> Fleet:
    """Describe every process (nothing started)."""
    out = config.out_dir
    cluster = MooncakeCluster(config.holders, config.holder_segment_mb << 20, out / "mooncake")
    env = {**cpu_env(), "HIRADIX_CHECK_INTEGRITY": "1", "HIRADIX_STORE_RETRY_S": "3",
           "NO_PROXY": "127.0.0.1,localhost"}  # fmt: skip
    members = []
    for name in ("a", "b"):
        nvme_root = out / f"nvme-{name}"
        shutil.rmtree(nvme_root, ignore_errors=True)
        nvme_root.mkdir(mode=0o700)
        log = out / f"server-{name}.log"
        server = ServerProcess(config.model, extra_args=hiradix_args(config, nvme_root, cluster.config_json()), env=env,
                               log_path=log, startup_timeout_s=config.startup_timeout_s)  # fmt: skip
        result = ServerResult(log=str(log))
        report.servers[name] = result
        members.append(Member(name, server, nvme_root / "hiradix-rank0", result, LogScanner(log)))
    stock = ServerProcess(config.model, env={**cpu_env(), "NO_PROXY": "127.0.0.1,localhost"},
                          extra_args=cpu_args(32768) + ["--max-running-requests", str(config.max_running_requests),
                                                        "--served-model-name", MODEL],
                          log_path=out / "stock.log", startup_timeout_s=config.startup_timeout_s)  # fmt: skip
    overload = [] if config.router_overload_protection else ["--disable-worker-overload-protection"]
    router = RouterProcess(out / "router.log", worker_urls=[m.server.base_url for m in members], policy=config.policy,
                           extra_args=overload)  # fmt: skip
    return Fleet(config, cluster, members, stock, router, report)


def router_pid(router: RouterProcess) -> int | None:
    """PID of the process listening on the router's port (RouterProcess keeps its Popen private)."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == router.port:
            return conn.pid
    return None


# ------------------------------------------------------------------------------ sampling


def rss_of(pid: int | None) -> int | None:
    try:
        return psutil.Process(pid).memory_info().rss if pid else None
    except psutil.NoSuchProcess:
        return None


def sample(fleet: Fleet, router_pid_: int | None) -> Sample:
    """Resources now (blocking: reads /proc and the master's metrics)."""
    rss: dict[str, int | None] = {}
    fds: dict[str, int | None] = {}
    ports = fleet.store_ports()
    for m in fleet.members:
        usage = None if m.restarting else server_usage(m.server)
        pooled = sum(store_connection_kinds(usage, ports).values()) if usage else 0
        rss[m.name], fds[m.name] = (usage.rss_bytes, usage.num_fds - pooled) if usage else (None, None)
        sock = None if m.restarting else worker_socket_dir(m.server)
        if sock:
            m.socket_dirs.add(str(sock.parent))  # /dev/shm/hiradix-<uid>-<scheduler pid>-rank0
    metrics = fleet.cluster.metrics()
    return Sample(fleet.now(), rss, fds, rss_of(router_pid_), int(metrics.get("master_key_count", 0)),
                  int(metrics.get("master_allocated_bytes", 0)))  # fmt: skip


async def sampler(fleet: Fleet, stop: asyncio.Event) -> None:
    pid = router_pid(fleet.router)
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), fleet.config.check_interval_s)
            return
        except asyncio.TimeoutError:
            pass
        fleet.report.samples.append(await asyncio.to_thread(sample, fleet, pid))
        for m in fleet.members:
            if not m.restarting:
                m.scanner.read_new()
            if not process_alive(m.server.pid) and not m.restarting:
                fleet.report.violations.append(f"t={fleet.now()}s: server {m.name} exited")
                stop.set()


# ------------------------------------------------------------------------------- phases


async def take_baselines(fleet: Fleet, load: FleetLoad, members: Sequence[Member]) -> None:
    """Drain the load, take each member's baseline (a new life), resume."""
    await load.drain()
    for m in members:
        m.life.baseline = await asyncio.to_thread(quiet_snapshot, m.server, m.nvme_rank_dir, QUIET_S,
                                                  fleet.config.settle_timeout_s, fleet.store_ports())  # fmt: skip
        m.life.integrity_checking = await asyncio.to_thread(integrity_checking_on, m.server)
        m.life.baseline_t_s = fleet.now()
    load.resume()


async def restart_holder(fleet: Fleet) -> None:
    """Kill holder 0; once the master has dropped its segment (or after 60 s), start it again."""
    c, t, started = fleet.cluster, fleet.now(), time.monotonic()
    full = c.capacity_bytes()
    await asyncio.to_thread(c.kill_holder, 0)
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(c.capacity_bytes) >= full and time.monotonic() < deadline:
        await asyncio.sleep(0.5)  # polls the master: it unmounts a dead client's segment on its own
    await asyncio.to_thread(c.start_holder, 0)
    fleet.report.events.append(("holder 0 restart", t, round(time.monotonic() - started, 1)))


async def restart_server(fleet: Fleet, load: FleetLoad, window: RetryWindow, m: Member) -> None:
    """Stop `m` under load and start it again on its port; check its stopped life left nothing;
    after a warm-up, a new baseline (a new life)."""
    t, started = fleet.now(), time.monotonic()
    m.scanner.read_new()
    window.open()
    m.restarting = True
    m.life.ended_by = "restart"
    await asyncio.to_thread(m.server.stop)
    fleet.report.violations += [f"server {m.name} stopped: {p}" for p in leftovers(m)]
    m.result.lives.append(Life(started_t_s=fleet.now()))
    await asyncio.to_thread(m.server.start)
    await asyncio.to_thread(fleet.router.wait_workers, len(fleet.members), 120.0)
    fleet.report.events.append((f"server {m.name} restart", t, round(time.monotonic() - started, 1)))
    errors_before = len(m.scanner.errors)
    m.scanner.read_new()
    m.result.restart_log_lines = m.scanner.errors[errors_before:]
    del m.scanner.errors[errors_before:]  # logged while it was stopped: reported, not violations
    m.restarting = False
    await asyncio.sleep(fleet.config.restart_grace_s)
    window.close()
    await asyncio.sleep(fleet.config.warmup)
    await take_baselines(fleet, load, [m])


async def sleep_until(fleet: Fleet, t_s: float, stop: asyncio.Event) -> bool:
    """Wait until `t_s` after the start; False if `stop` was set first."""
    try:
        await asyncio.wait_for(stop.wait(), max(0.0, t_s - (time.monotonic() - fleet.t0)))
        return False
    except asyncio.TimeoutError:
        return True


async def timeline(fleet: Fleet, load: FleetLoad, window: RetryWindow, stop: asyncio.Event) -> None:
    c = fleet.config
    if await sleep_until(fleet, c.warmup, stop):
        await take_baselines(fleet, load, fleet.members)
    if await sleep_until(fleet, c.duration_s / 3, stop):
        await restart_holder(fleet)
    if await sleep_until(fleet, 2 * c.duration_s / 3, stop):
        await restart_server(fleet, load, window, fleet.members[1])
    await sleep_until(fleet, c.duration_s, stop)
    stop.set()


async def soak(fleet: Fleet) -> FleetLoad:
    """The load, the sampler and the timeline until `duration_s`; the load drained at the end."""
    window = RetryWindow()
    load = FleetLoad(fleet.router.base_url, fleet.stock.base_url, fleet.config.load, window)
    stop = asyncio.Event()
    connector = http_connector(2 * (load.load.hot_slots + load.load.short_slots) + 4)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600), connector=connector) as http:
        fleet.t0 = time.monotonic()
        running = asyncio.create_task(load.run(http))
        watch = asyncio.create_task(sampler(fleet, stop))
        try:
            await timeline(fleet, load, window, stop)
        finally:
            stop.set()
            load.stop.set()
            load.resume()
            await asyncio.gather(running, watch)
    return load


# ----------------------------------------------------------------------------- end checks


def leftovers(m: Member) -> list[str]:
    """What a stopped server left: live processes of its group, its schedulers' /dev/shm directories."""
    found = [f"process {p.pid} still alive" for p in m.server.descendants()]
    return found + [f"{d} still exists" for d in sorted(m.socket_dirs) if Path(d).exists()]


def judge_life(config: FleetConfig, name: str, life: Life, samples: Sequence[Sample], until_s: float,
               store_lanes: int) -> list[str]:
    """Flat series of one life (the samples from its baseline until `until_s`), its end snapshot
    (`store_lanes`: the servers' `tcp_lanes_per_peer`, the bound of their store connections per port)."""
    if life.baseline is None or life.baseline_t_s is None:
        return [f"server {name}: no baseline for its life from t={life.started_t_s}s"]
    base_t = life.baseline_t_s
    mine = [s for s in samples if base_t <= s.t_s < until_s and s.rss_bytes.get(name) is not None]
    rss_bound = config.rss_bound_bytes(life.baseline.usage.rss_bytes)
    life.rss = flatness(f"server {name} RSS (life from t={base_t}s)", [s.rss_bytes[name] for s in mine], rss_bound)
    life.fds = flatness(f"server {name} fds (life from t={base_t}s)", [s.fds[name] for s in mine], config.fd_slack)
    problems = flat_violations([f for f in (life.rss, life.fds) if f is not None])
    if not life.integrity_checking:
        problems.append(f"server {name}: HIRADIX_CHECK_INTEGRITY=1 not seen in the scheduler's environment")
    if life.end is not None:
        problems += [f"server {name}: {p}" for p in snapshot_diffs(life.baseline, life.end)]
        problems += [f"server {name}: {p}" for p in store_connection_problems(life.end, store_lanes)]
        life.worker_respawns = worker_respawns(life.baseline, life.end)
        life.rss_end_growth_bytes = life.end.usage.rss_bytes - life.baseline.usage.rss_bytes
        if life.rss_end_growth_bytes > rss_bound:
            problems.append(f"server {name}: RSS grew by {life.rss_end_growth_bytes / MIB:.1f} MiB from its "
                            f"baseline, bound {rss_bound / MIB:.1f} MiB")  # fmt: skip
    return problems


async def end_of_run(fleet: Fleet) -> None:
    """Flush both servers, then their end snapshots (against their last baselines)."""
    for m in fleet.members:
        if not process_alive(m.server.pid):
            fleet.report.violations.append(f"server {m.name} not running at the end; its end checks skipped")
            continue
        flushed = await flush_and_check(m.server.base_url, fleet.config.settle_timeout_s, m.scanner)
        m.result.tier_tokens_after_flush, m.result.summary_after_flush = flushed.tier_tokens, flushed.summary
        fleet.report.violations += [f"server {m.name}: {v}" for v in flushed.violations]
        m.life.ended_by = "end"
        if m.life.baseline is not None:
            m.life.end = await asyncio.to_thread(settled_snapshot, m.server, m.nvme_rank_dir,
                                                 fleet.config.settle_timeout_s, m.life.baseline,
                                                 fleet.store_ports())  # fmt: skip


def store_checks(fleet: Fleet) -> list[str]:
    """The store's object count: flat beyond its fill-up is not expected (a full store evicts), so
    the check is that it never holds more objects than its holders' capacity in pages."""
    r, c = fleet.report, fleet.config
    counts = [s.store_objects for s in r.samples]
    r.store_objects_max = max(counts, default=0)
    r.store_objects = flatness("store objects", counts, float("inf"))
    metrics = ""
    try:
        with urllib.request.urlopen(fleet.members[0].server.base_url + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
    except OSError:
        pass
    size = page_bytes(metrics, c.page_tokens)
    if size is None:
        return ["could not read a server's page size in bytes (sglang:hiradix_tier_capacity_bytes)"]
    r.store_object_bound = int(c.holders * (c.holder_segment_mb << 20) / size)
    if r.store_objects_max > r.store_object_bound:
        return [f"the store held {r.store_objects_max} objects, more than its holders fit ({r.store_object_bound})"]
    return []


def judge(fleet: Fleet, load: FleetLoad) -> None:
    """All end checks into `fleet.report` (the servers still running)."""
    r, c = fleet.report, fleet.config
    r.load = dataclasses.asdict(load.stats)
    r.ttft_by_phase = ttft_by_phase(load.ttft, r.events, fleet.t0)
    r.violations += load.stats.violations()
    r.router_requests_per_worker = fleet.router.requests_per_worker()
    r.router_worker_retries = sum(v for _, v in fleet.router.samples("smg_worker_retries_total"))
    for m in fleet.members:
        m.scanner.read_new()
        m.result.log_errors = list(m.scanner.errors)
        m.result.worker_exits = list(m.scanner.worker_exits)
        r.violations += [f"server {m.name} log: {line[:300]}" for line in m.scanner.errors]
        ends = [life.started_t_s for life in m.result.lives[1:]] + [float("inf")]
        for life, until_s in zip(m.result.lives, ends):
            r.violations += judge_life(c, m.name, life, r.samples, until_s, fleet.cluster.config().tcp_lanes_per_peer)
    router_rss = [s.router_rss_bytes for s in r.samples if s.router_rss_bytes is not None]
    r.router_rss = flatness("router RSS", router_rss, c.router_rss_slack_bytes)
    r.violations += flat_violations([r.router_rss] if r.router_rss else [])
    r.violations += store_checks(fleet)


def run_fleet_soak(config: FleetConfig) -> FleetReport:
    """Start the fleet, soak it, stop it, check what it left; write the report and the PNG.

    Returns:
        The report (`ok` False when any check failed; `violations` says which).

    Raises:
        ValueError: a config value out of range.
    """
    config.validate()
    config.out_dir.mkdir(parents=True, exist_ok=True)
    config_dict = msgspec.to_builtins({k: str(v) if isinstance(v, Path) else v
                                       for k, v in dataclasses.asdict(config).items()})  # fmt: skip
    report = FleetReport(config=config_dict)
    started = time.monotonic()
    fleet = build_fleet(config, report)
    try:
        start_fleet(fleet)
        load = asyncio.run(soak(fleet))
        asyncio.run(end_of_run(fleet))
        judge(fleet, load)
    except Exception as exc:  # a crash of the soak itself is a failed soak, reported like the others
        logger.exception("fleet soak aborted")
        report.violations.append(f"soak aborted: {type(exc).__name__}: {str(exc)[:2000]}")
    finally:
        fleet.router.stop()
        stop_all([m.server for m in fleet.members] + [fleet.stock])
        fleet.cluster.stop()
        for m in fleet.members:
            report.violations += [f"server {m.name} after the final stop: {p}" for p in leftovers(m)]
            shutil.rmtree(m.nvme_rank_dir.parent, ignore_errors=True)
    report.wall_s = round(time.monotonic() - started, 1)
    report.ok = not report.violations
    (config.out_dir / "soak_report.json").write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    if report.samples:
        plot_resources(report.samples, [(name, t) for name, t, _ in report.events], config.out_dir / "resources.png")
    return report


def start_fleet(fleet: Fleet) -> None:
    """The store, then the three servers (started together), then the router."""
    fleet.cluster.start()
    servers = [m.server for m in fleet.members] + [fleet.stock]
    for server in servers:
        server.start(wait=False)
    for server in servers:
        server.wait_healthy()
    fleet.router.start(timeout_s=180)
    for m in fleet.members:
        m.result.lives.append(Life(started_t_s=0.0))


# ------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    d, dl = FleetConfig(out_dir=Path(".")), SkewedLoad()
    p = argparse.ArgumentParser(prog="python -m bench.soak.fleet", description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=d.duration_s, help="load time incl. warm-up (default 1800)")
    p.add_argument("--warmup-s", type=float, default=None, help="warm-up before a baseline (default min(60, duration/8))")
    p.add_argument("--model", default=d.model)
    p.add_argument("--policy", default=d.policy, help="the router's --policy (default round_robin)")
    p.add_argument("--router-overload-protection", action="store_true",
                   help="keep smg's worker overload protection on (see FleetConfig.router_overload_protection)")
    for name in ("hot_slots", "hot_turns", "short_slots", "short_turns", "max_tokens", "max_message_chars", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(dl, name))
    p.add_argument("--source", choices=["synthetic", "sharegpt", "auto"], default=dl.source)
    for name in ("max_running_requests", "max_total_tokens", "page_tokens", "holders", "holder_segment_mb", "fd_slack"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("dram_gb", "nvme_gb", "check_interval_s", "settle_timeout_s", "restart_grace_s"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--rss-slack-mb", type=float, default=d.rss_slack_bytes / MIB, help="see FleetConfig.rss_bound_bytes")
    p.add_argument("--out-dir", type=Path, default=None, help="default runs/soak-fleet-<timestamp>")
    return p


def config_from_args(args: argparse.Namespace) -> FleetConfig:
    values = vars(args)
    load = SkewedLoad(**{f.name: values[f.name] for f in dataclasses.fields(SkewedLoad)})
    names = {f.name for f in dataclasses.fields(FleetConfig)} - {"out_dir", "load", "rss_slack_bytes"}
    out_dir = args.out_dir or Path("runs") / time.strftime("soak-fleet-%Y%m%d-%H%M%S")
    return FleetConfig(out_dir=out_dir, load=load, rss_slack_bytes=int(args.rss_slack_mb * MIB),
                       **{k: v for k, v in values.items() if k in names})  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 1 violations)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    try:
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    r = run_fleet_soak(config)
    s = r.load
    print(f"[soak-fleet] {s.get('turns', 0)} turns ({s.get('hot_sessions', 0)} hot + {s.get('short_sessions', 0)} "
          f"short sessions), {s.get('mismatches', 0)} mismatches, {s.get('first_try_failures', 0)} first-try "
          f"failures ({s.get('allowed_failures', 0)} allowed), {s.get('unanswered', 0)} unanswered; "
          f"per worker {r.router_requests_per_worker}; events {r.events}")  # fmt: skip
    for name, result in r.servers.items():
        for life in result.lives:
            if life.rss:
                print(f"[soak-fleet] server {name} life from t={life.started_t_s}s: RSS first/last quarter "
                      f"{life.rss.first_quarter_median / MIB:.1f}/{life.rss.last_quarter_median / MIB:.1f} MiB, "
                      f"I/O worker respawns after the baseline {life.worker_respawns}")
        for line in result.worker_exits:
            print(f"[soak-fleet] server {name} I/O worker exit: {line[:200]}")
    for row in r.ttft_by_phase:
        print(f"[soak-fleet] {phase_line(row)}")
    for violation in r.violations:
        print(f"[soak-fleet] VIOLATION: {violation}")
    print(f"[soak-fleet] {'ok' if r.ok else 'FAILED'} in {r.wall_s} s; report {config.out_dir / 'soak_report.json'}")
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
