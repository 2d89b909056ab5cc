"""Soak: churned multi-turn chat against a real hiradix server, then prove that nothing leaked.

The server: `sglang.launch_server` with hiradix and tiers small enough that all three churn
(HBM `--max-total-tokens`, DRAM `--hiradix-dram-gb`, NVMe `--hiradix-nvme-gb` in a private
directory under `out_dir`), `--max-running-requests` below the client concurrency (a queue
forms, so the look-ahead window has work), and `HIRADIX_CHECK_INTEGRITY=1`: after every
scheduler step, busy or idle, the tree and the tier books prove their invariants
(`TieredRadixCache.check_integrity`); a violation raises `IntegrityError` in the scheduler, which
SGLang logs ("Scheduler hit an exception") before it takes the whole server down.

The load: `concurrency` client slots, each replaying multi-turn sessions
(`bench.common.conversations`) through `bench.common.multiturn.send_chat_request` (streaming, greedy). When
a session ends its slot starts a new one, so histories keep arriving, aging, falling through
the tiers and being dropped.

Phases and checks (each failure is a violation; a broken server or a failed request ends the
load early, the end checks still run):
    1. Warm-up load (`warmup_s`), drain, then the baseline, once two reads agree: the server
       tree's processes, RSS, fds, sockets and /dev/shm entries (`hiradix.testing.resources`),
       and the entries and modes of the NVMe directory and of the I/O worker's socket directory.
    2. Soak load until `duration_s` (warm-up included). Every `check_interval_s`: the launcher is
       alive, `/health_generate` answers 200, the log has no error marker; RSS is sampled.
    3. Drain, `/flush_cache`, then: every `sglang:hiradix_tier_used_tokens` gauge is 0, the tiers' summary
       line reports 0 used DRAM pages and 0 used NVMe slots, processes, fds, sockets, /dev/shm
       entries and both directories are back to the baseline (within `settle_timeout_s`),
       RSS growth is within `rss_bound_bytes`, no request failed, directories are private.

Output: `<out_dir>/soak_report.json` (`SoakReport`), `<out_dir>/server.log`. CLI (exit 1 on any
violation; scripts/soak wraps it): `python -m bench.soak --duration-s 1800 --out-dir runs/soak`
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import aiohttp
import msgspec
from tqdm.auto import tqdm

if __package__ in (None, ""):  # run as a file: python bench/soak/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.conversations import Session, load_sessions
from bench.common.multiturn import RequestRecord, WorkloadConfig, fetch_model_id, http_connector, send_chat_request
from bench.soak.observe import (  # noqa: F401 (SUMMARY_RE, parse_tier_tokens: used by the tests through this module)
    SUMMARY_RE, LogScanner, Snapshot, flush_and_check, http_request, integrity_checking_on, parse_tier_tokens,
    process_alive, server_usage, settled_snapshot, snapshot_diffs, worker_respawns,
)
from hiradix.testing.resources import TreeUsage
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env

logger = logging.getLogger(__name__)

MIB = 1 << 20
# Processes that map the DRAM tier (the scheduler writes it, the I/O worker reads it).
DRAM_MAPPERS = 2


@dataclass(frozen=True)
class SoakConfig:
    """What to run and how long (times in seconds, sizes in GB = 1e9 bytes unless named)."""

    out_dir: Path
    model: str = "models/tiny"
    duration_s: float = 1800.0  # load time, warm-up included
    warmup_s: float | None = None  # None: min(60, duration_s / 8)
    concurrency: int = 8  # client session slots (> max_running_requests)
    max_running_requests: int = 4  # SGLang's batch size limit
    max_total_tokens: int = 4096  # HBM (device KV pool), tokens
    dram_gb: float = 0.006  # ~180 pages of the tiny model
    nvme_gb: float = 0.02  # ~540 slots of the tiny model
    policy: str = "lookahead"
    turns: int = 4  # user turns per session
    max_tokens: int = 8  # generated tokens per turn
    max_message_chars: int = 400
    source: str = "synthetic"  # bench.common.conversations source
    seed: int = 0
    check_interval_s: float = 10.0
    settle_timeout_s: float = 60.0  # how long resources may take to return to the baseline
    rss_slack_bytes: int = 96 * MIB  # see rss_bound_bytes
    startup_timeout_s: float = 300.0
    progress: bool = True

    @property
    def warmup(self) -> float:
        """Warm-up load, seconds."""
        return self.warmup_s if self.warmup_s is not None else min(60.0, self.duration_s / 8)

    def validate(self) -> None:
        """Raises: ValueError: a value out of range (names the option)."""
        if self.duration_s <= 0 or not 0 <= self.warmup < self.duration_s:
            raise ValueError(f"--duration-s must be > 0 and > --warmup-s, got {self.duration_s}, {self.warmup}")
        if self.concurrency <= self.max_running_requests:
            raise ValueError(f"--concurrency {self.concurrency} must exceed --max-running-requests {self.max_running_requests}")
        if min(self.turns, self.max_tokens, self.max_message_chars, self.max_running_requests) < 1:
            raise ValueError("--turns, --max-tokens, --max-message-chars, --max-running-requests must be >= 1")
        if self.dram_gb <= 0 or self.nvme_gb <= 0 or self.check_interval_s <= 0 or self.settle_timeout_s <= 0:
            raise ValueError("--dram-gb, --nvme-gb, --check-interval-s and --settle-timeout-s must be > 0")

    def server_args(self, nvme_dir: Path) -> list[str]:
        """`launch_server` flags (CPU settings + hiradix with all three tiers)."""
        return cpu_args(self.max_total_tokens) + [
            "--max-running-requests", str(self.max_running_requests),
            "--enable-hiradix",
            "--hiradix-dram-gb", str(self.dram_gb),
            "--hiradix-nvme-path", str(nvme_dir),
            "--hiradix-nvme-gb", str(self.nvme_gb),
            "--hiradix-policy", self.policy,
        ]  # fmt: skip

    def rss_bound_bytes(self, baseline: TreeUsage) -> int:
        """Allowed RSS growth of the server tree from the baseline to the end, in bytes.

        `DRAM_MAPPERS x dram bytes`: the DRAM tier is shared memory touched lazily, so pages
        first used after the baseline add up to its size to each process that maps it.
        Plus `max(rss_slack_bytes, 5% of the baseline RSS)`: allocator high-water marks (glibc
        arenas, PyTorch's CPU allocator, pymalloc) grow with the largest batch seen and are
        not given back; the warm-up runs the same load, so little is left to reach. A real
        leak grows with the requests served: the tiny model serves ~10 requests/s on 2 CPU
        cores, so in the default 30 minutes (~18,000 requests) a leak of ~6 KB per request
        passes the default bound (the 2-minute test catches ~75 KB per request).
        """
        return int(DRAM_MAPPERS * self.dram_gb * 1e9 + max(self.rss_slack_bytes, 0.05 * baseline.rss_bytes))


class SoakReport(msgspec.Struct):
    """The JSON report (`soak_report.json`). Times in seconds, memory in bytes."""

    config: dict[str, Any]
    ok: bool = False
    violations: list[str] = msgspec.field(default_factory=list)
    wall_s: float = 0.0
    server_log: str = ""
    integrity_checking: bool = False  # HIRADIX_CHECK_INTEGRITY=1 in the scheduler's environment
    requests: int = 0
    failed_requests: int = 0
    error_samples: list[str] = msgspec.field(default_factory=list)
    sessions_started: int = 0
    prompt_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = msgspec.field(default_factory=dict)  # device/host/storage
    periodic_checks: int = 0
    rss_samples: list[tuple[float, int, int]] = msgspec.field(default_factory=list)  # (s, rss, anon)
    baseline: Snapshot | None = None
    end: Snapshot | None = None
    rss_growth_bytes: int = 0
    rss_bound_bytes: int = 0
    tier_tokens_after_flush: dict[str, float] = msgspec.field(default_factory=dict)
    summary_after_flush: dict[str, int] = msgspec.field(default_factory=dict)
    log_errors: list[str] = msgspec.field(default_factory=list)


# ----------------------------------------------------------------------------- load


class SessionFeed:
    """An endless supply of sessions of `turns` user turns: synthetic ones are new forever
    (seed + block number); other sources cycle through one pool of 256 sessions (a repeat is a
    returning user). Messages are cut to `max_message_chars` characters."""

    def __init__(self, turns: int, max_message_chars: int, source: str = "synthetic", seed: int = 0, block: int = 64):
        self.turns, self.max_message_chars, self.source, self.seed = turns, max_message_chars, source, seed
        self.block = block
        self._blocks = 0
        self._queue: list[Session] = []
        self._pool: list[Session] | None = None
        self.started = 0

    @classmethod
    def for_config(cls, config: SoakConfig) -> SessionFeed:
        """The feed of `config`'s turns, message length, source and seed."""
        return cls(config.turns, config.max_message_chars, config.source, config.seed)

    def next(self) -> Session:
        """The next session to replay."""
        if not self._queue:
            if self.source == "synthetic":
                self._queue = load_sessions(self.block, self.turns, self.seed + self._blocks, self.max_message_chars,
                                            "synthetic")  # fmt: skip
            else:
                self._pool = self._pool or load_sessions(256, self.turns, self.seed, self.max_message_chars, self.source)
                self._queue = list(self._pool)
            self._blocks += 1
        self.started += 1
        return self._queue.pop(0)


@dataclass
class LoadStats:
    """Totals of the requests sent (tokens)."""

    requests: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})

    def add(self, record: RequestRecord) -> None:
        """Count one finished request."""
        self.requests += 1
        if not record.ok:
            self.failed += 1
            if len(self.errors) < 10:
                self.errors.append(f"{record.session_id} turn {record.turn_index}: {record.error}")
            return
        self.prompt_tokens += record.prompt_tokens or 0
        for tier, value in (("device", record.cached_device_tokens), ("host", record.cached_host_tokens),
                            ("storage", record.cached_storage_tokens)):  # fmt: skip
            self.cached_by_tier[tier] += value or 0


async def run_load(http: aiohttp.ClientSession, base_url: str, feed: SessionFeed, config: SoakConfig,
                   stats: LoadStats, stop: asyncio.Event) -> None:
    """Keep `config.concurrency` sessions in flight until `stop` is set, then finish the
    requests in flight (no new turn starts after `stop`)."""
    model = await fetch_model_id(http, base_url)
    workload = WorkloadConfig(max_tokens=config.max_tokens, model=model, system="soak", progress=False)

    async def slot(index: int) -> None:
        while not stop.is_set():
            session = feed.next()
            for turn in range(session.num_turns):
                if stop.is_set():
                    return
                record = RequestRecord("soak", session.session_id, index, turn)
                await send_chat_request(http, base_url, session.prompt_messages(turn), model, workload, record)
                stats.add(record)
                if not record.ok:
                    stop.set()  # a failed request is a violation already; stop loading a broken server

    await asyncio.gather(*(slot(i) for i in range(config.concurrency)))


async def load_for(base_url: str, feed: SessionFeed, config: SoakConfig, stats: LoadStats, seconds: float,
                   watch: Any = None) -> None:
    """Run the load for `seconds` in a fresh HTTP client (closed on return, so no connection
    stays open); `watch(stop)` runs alongside and may set `stop` early."""
    stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=http_connector(config.concurrency + 4)) as http:
        timer = asyncio.get_running_loop().call_later(seconds, stop.set)
        tasks = [run_load(http, base_url, feed, config, stats, stop)]
        if watch is not None:
            tasks.append(watch(http, stop))
        try:
            await asyncio.gather(*tasks)
        finally:
            timer.cancel()


def make_watcher(server: ServerProcess, config: SoakConfig, scanner: LogScanner, report: SoakReport, bar: Any):
    """The periodic check run alongside the soak load (see the module docstring, phase 2)."""
    t0 = time.monotonic()

    async def watch(http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), config.check_interval_s)
                return
            except asyncio.TimeoutError:
                pass
            t = round(time.monotonic() - t0, 1)
            problems = [] if process_alive(server.pid) else [f"t={t}s: the server process exited"]
            status, body = await http_request(http, "GET", server.base_url + "/health_generate")
            if status != 200:
                problems.append(f"t={t}s: /health_generate answered {status}: {body[:300]}")
            known = len(scanner.errors)
            scanner.read_new()  # error lines become violations at the end
            usage = server_usage(server)
            report.rss_samples.append((t, usage.rss_bytes, usage.rss_anon_bytes))
            report.periodic_checks += 1
            bar.update(min(config.check_interval_s, bar.total - bar.n))
            report.violations += problems
            if problems or len(scanner.errors) > known:
                stop.set()  # the server is broken: stop loading it, go on to the end checks

    return watch


async def flush_and_read(base_url: str, config: SoakConfig, scanner: LogScanner, report: SoakReport) -> None:
    """`flush_and_check` into `report`."""
    result = await flush_and_check(base_url, config.settle_timeout_s, scanner)
    report.tier_tokens_after_flush, report.summary_after_flush = result.tier_tokens, result.summary
    report.violations += result.violations


def end_checks(report: SoakReport, config: SoakConfig) -> list[str]:
    """Compare the end snapshot with the baseline; return the violations."""
    b, e = report.baseline, report.end
    assert b is not None and e is not None
    problems = snapshot_diffs(b, e)
    if respawns := worker_respawns(b, e):  # nothing here fails the worker: a respawn is a fault
        problems.append(f"the I/O worker was started again {respawns} time(s) (generation "
                        f"{b.worker_generation()} at the baseline, {e.worker_generation()} at the end)")
    report.rss_growth_bytes = e.usage.rss_bytes - b.usage.rss_bytes
    report.rss_bound_bytes = config.rss_bound_bytes(b.usage)
    if report.rss_growth_bytes > report.rss_bound_bytes:
        problems.append(f"RSS grew by {report.rss_growth_bytes / MIB:.1f} MiB, bound {report.rss_bound_bytes / MIB:.1f} MiB")
    if report.requests == 0 or report.failed_requests:
        problems.append(f"{report.failed_requests} of {report.requests} requests failed: {report.error_samples[:3]}")
    if not report.integrity_checking:
        problems.append("HIRADIX_CHECK_INTEGRITY=1 not seen in the scheduler's environment")
    return problems


# ----------------------------------------------------------------------------- driver


def _soak(server: ServerProcess, config: SoakConfig, nvme_rank_dir: Path, report: SoakReport) -> None:
    """Phases 1-3 against a started server (fills `report`)."""
    scanner = LogScanner(server.log_path)
    feed, stats = SessionFeed.for_config(config), LoadStats()
    report.integrity_checking = integrity_checking_on(server)
    logger.info("soak: warm-up %.0f s on %s", config.warmup, server.base_url)
    asyncio.run(load_for(server.base_url, feed, config, stats, config.warmup))
    report.baseline = settled_snapshot(server, nvme_rank_dir, config.settle_timeout_s)
    load_s = config.duration_s - config.warmup
    with tqdm(total=load_s, unit="s", desc="soak", disable=not config.progress) as bar:
        watch = make_watcher(server, config, scanner, report, bar)
        asyncio.run(load_for(server.base_url, feed, config, stats, load_s, watch))
        bar.set_postfix(requests=stats.requests, failed=stats.failed)
    report.requests, report.failed_requests, report.error_samples = stats.requests, stats.failed, stats.errors
    report.sessions_started, report.prompt_tokens = feed.started, stats.prompt_tokens
    report.cached_tokens_by_tier = stats.cached_by_tier
    alive = process_alive(server.pid)
    if alive:
        asyncio.run(flush_and_read(server.base_url, config, scanner, report))
        report.end = settled_snapshot(server, nvme_rank_dir, config.settle_timeout_s, target=report.baseline)
        report.violations += end_checks(report, config)
    scanner.read_new()
    report.log_errors = scanner.errors
    report.violations += [f"log: {line[:300]}" for line in scanner.errors]
    if not alive:
        report.violations.append("the server died during the soak (see log:); end checks skipped")


def run_soak(config: SoakConfig) -> SoakReport:
    """Start the server, run the soak, stop the server, write `<out_dir>/soak_report.json`.

    Returns:
        The report (`ok` is False when any check failed; `violations` says which).

    Raises:
        ValueError: a config value out of range.
    """
    config.validate()
    config.out_dir.mkdir(parents=True, exist_ok=True)
    config_dict = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(config).items()}
    report = SoakReport(config=config_dict, server_log=str(config.out_dir / "server.log"))
    nvme_root = config.out_dir / "nvme"
    shutil.rmtree(nvme_root, ignore_errors=True)
    nvme_root.mkdir(mode=0o700)
    t0 = time.monotonic()
    env = {**cpu_env(), "HIRADIX_CHECK_INTEGRITY": "1"}
    server = ServerProcess(config.model, extra_args=config.server_args(nvme_root), env=env,
                           log_path=config.out_dir / "server.log", startup_timeout_s=config.startup_timeout_s)
    try:
        with server:
            _soak(server, config, nvme_root / "hiradix-rank0", report)
    except Exception as exc:  # a crash of the soak itself is a failed soak, reported like the others
        logger.exception("soak aborted")
        report.violations.append(f"soak aborted: {type(exc).__name__}: {str(exc)[:2000]}")
    finally:
        shutil.rmtree(nvme_root, ignore_errors=True)
    report.wall_s = round(time.monotonic() - t0, 1)
    report.ok = not report.violations
    (config.out_dir / "soak_report.json").write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    return report


def build_parser() -> argparse.ArgumentParser:
    d = SoakConfig(out_dir=Path("."))
    p = argparse.ArgumentParser(prog="python -m bench.soak", description="Soak a hiradix server with churned multi-turn chat; check for leaks.")
    p.add_argument("--duration-s", type=float, default=d.duration_s, help="load time incl. warm-up (default 1800)")
    p.add_argument("--warmup-s", type=float, default=None, help="warm-up before the baseline (default min(60, duration/8))")
    p.add_argument("--model", default=d.model, help="model directory (default models/tiny)")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="client sessions in flight")
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests, help="server batch limit")
    p.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens, help="HBM pool, tokens")
    p.add_argument("--dram-gb", type=float, default=d.dram_gb, help="--hiradix-dram-gb")
    p.add_argument("--nvme-gb", type=float, default=d.nvme_gb, help="--hiradix-nvme-gb")
    p.add_argument("--policy", choices=["lookahead", "lru"], default=d.policy, help="--hiradix-policy")
    p.add_argument("--turns", type=int, default=d.turns, help="user turns per session")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="generated tokens per turn")
    p.add_argument("--max-message-chars", type=int, default=d.max_message_chars)
    p.add_argument("--source", choices=["synthetic", "sharegpt", "auto"], default=d.source)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--check-interval-s", type=float, default=d.check_interval_s)
    p.add_argument("--settle-timeout-s", type=float, default=d.settle_timeout_s)
    p.add_argument("--rss-slack-mb", type=float, default=d.rss_slack_bytes / MIB, help="see SoakConfig.rss_bound_bytes")
    p.add_argument("--out-dir", type=Path, default=None, help="default runs/soak-<timestamp>")
    p.add_argument("--no-progress", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    out_dir = args.out_dir or Path("runs") / time.strftime("soak-%Y%m%d-%H%M%S")
    names = {f.name for f in dataclasses.fields(SoakConfig)}
    values = {k: v for k, v in vars(args).items() if k in names and k != "out_dir"}
    return SoakConfig(out_dir=out_dir, rss_slack_bytes=int(args.rss_slack_mb * MIB), progress=not args.no_progress, **values)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 1 violations)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    try:
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    report = run_soak(config)
    print(f"[soak] {report.requests} requests ({report.failed_requests} failed), "
          f"{report.sessions_started} sessions, cached tokens by tier {report.cached_tokens_by_tier}, "
          f"RSS growth {report.rss_growth_bytes / MIB:.1f} MiB (bound {report.rss_bound_bytes / MIB:.1f})")
    for violation in report.violations:
        print(f"[soak] VIOLATION: {violation}")
    print(f"[soak] {'ok' if report.ok else 'FAILED'}; report {config.out_dir / 'soak_report.json'}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
