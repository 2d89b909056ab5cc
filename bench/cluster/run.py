"""Cluster benchmark: N = 2 SGLang servers behind a router in the client, with and without a
Mooncake Store they share; does a turn routed to the other server still hit?

Systems (every server of every system: the same model, `--max-total-tokens` (the HBM pool,
smaller than the working set), `--page-size 16` and, where there is one, the same DRAM):

    stock     stock RadixAttention: each server only has its own HBM cache (no sharing possible)
    hicache   stock SGLang HiCache + Mooncake Store: host pool `--hicache-ratio` x the HBM pool,
              L3 = the store (`hiradix.testing.mooncake.hicache_mooncake_args`; patch p05 on CPU)
    hiradix   hiradix defaults + `--hiradix-store mooncake`: `--hiradix-dram-ratio` = the same bytes
              as HiCache's host pool (`bench.ab.systems.with_tier_sizes`); no NVMe unless `--nvme-gb`
    stock-aa  stock again, sticky only, run first: the A/A control of this run's noise
    ideal     computed, not run: one infinite cache shared by both servers. Per request: the
              longest prefix its prompt shares with any earlier prompt of the workload, in whole
              pages and below its last token (token ids from the server's `/v1/tokenize`).

Routing, per turn, the same choices for every system (`route`):

    round-robin  turn t of session s -> server (s + t) mod N: every turn moves to the other server
    random       a uniform choice, seeded per (seed, session, turn)
    sticky       every turn of session s -> server s mod N: the limit (all reuse is local)

How it is measured. Two small-model servers take ~2.5 GB each here, so the systems cannot all
be up together on this 24 GiB machine shared with other jobs; they run one after another. Each
(system, routing) cell gets a fresh store (a master + a holder, `MooncakeCluster`) and two fresh
servers, so no system's or routing's objects help another. The cells run in an order rotated
across systems and routings (and across `--repeats`), with the A/A cell first, so a drift over
the run shows up in stock-aa vs stock. In a cell, one request is in flight at a time, turn-major
(turn t of every session before turn t+1, so each server's HBM churns between a session's
turns); without a queue, hiradix's store lookups happen at arrival. TTFT (turns >= 2, 1-based:
every turn that has a history) is reported as medians with 95% bootstrap intervals over the
requests of all repeats; ratios to stock of the same routing are ratios of those medians, with
a bootstrap interval, to be read against the A/A ratio. Deterministic figures (tokens hit per
tier, prefill tokens computed, token-identical outputs vs stock sticky) come next to them.

Outputs under `runs/cluster-<timestamp>/` (or `--out-dir`): `records.json` and `records.csv`
(every request), `summary.json` (cells, targets), `config.json`, `cluster_hits.png`,
`cluster_ttft.png`, and per cell a directory with server and store logs and `/metrics`.

    python -m bench.cluster            # full: models/small, 8 sessions x 4 turns, 10 cells
    python -m bench.cluster --quick    # smoke run: models/tiny, 4 x 3; its TTFTs are noise
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import aiohttp
from tqdm.auto import tqdm

if __package__ in (None, ""):  # run as a file: python bench/cluster/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.ab import run as ab
from bench.cluster import report as cluster_report
from bench.common.conversations import Session, load_sessions
from bench.common.multiturn import RequestRecord, WorkloadConfig, fetch_model_id, send_chat_request
from hiradix.testing.mooncake import MooncakeCluster, hicache_mooncake_args, hicache_mooncake_env
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env

logger = logging.getLogger("bench.cluster.run")

NUM_SERVERS = 2
PAGE_TOKENS = 16
ROUTINGS = ("round-robin", "random", "sticky")
SYSTEMS = ("stock", "hicache", "hiradix")
AA_SYSTEM, AA_ROUTING = "stock-aa", "sticky"
STORE_SYSTEMS = ("hicache", "hiradix")

# The HBM pool holds about two of the ~1,000-token histories of the last turns, while a server
# sees 4 (sticky) to 8 (moving) sessions between two turns of one: its HBM churns. DRAM (2x)
# keeps part of the rest; the store holds everything.
FULL_DEFAULTS = {"model": "models/small", "sessions": 8, "turns": 4, "max_total_tokens": 2048,
                 "max_message_chars": 600, "max_tokens": 8, "store_mib": 1024}
QUICK_DEFAULTS = {"model": "models/tiny", "sessions": 4, "turns": 3, "max_total_tokens": 768,
                  "max_message_chars": 200, "max_tokens": 8, "store_mib": 64}


def route(routing: str, session_index: int, turn_index: int, num_servers: int, seed: int) -> int:
    """The server (0-based) that turn `turn_index` of session `session_index` goes to.

    Raises:
        ValueError: On an unknown routing or `num_servers < 1`.
    """
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    if routing == "sticky":
        return session_index % num_servers
    if routing == "round-robin":
        return (session_index + turn_index) % num_servers
    if routing == "random":  # a str seed is hashed with SHA-512: the same choice in every process
        return random.Random(f"{seed}:{session_index}:{turn_index}").randrange(num_servers)
    raise ValueError(f"unknown routing {routing!r}; known: {', '.join(ROUTINGS)}")


@dataclass
class ClusterRecord(RequestRecord):
    """A `RequestRecord` plus where the router sent it and where its hits came from (tokens)."""

    routing: str = ""
    repeat: int = 0
    cell_index: int = 0  # position of its cell in the run (time order)
    server_index: int = 0
    ideal_cached_tokens: Optional[int] = None  # the `ideal` system's hit for this prompt
    cached_nvme_tokens: Optional[int] = None  # storage hits from local NVMe (hiradix)
    cached_store_tokens: Optional[int] = None  # storage hits from the cluster store


@dataclass(frozen=True)
class Cell:
    """One (system, routing) run: a fresh store and fresh servers."""

    index: int
    system: str
    routing: str
    repeat: int

    @property
    def label(self) -> str:
        return f"{self.index:02d}-{self.system}-{self.routing}"


@dataclass(frozen=True)
class BenchSettings:
    """What every cell shares."""

    model_path: Path
    sessions: tuple[Session, ...]
    workload: WorkloadConfig
    max_total_tokens: int
    dram_ratio: float
    nvme_gb: float
    store_bytes: int
    seed: int
    run_dir: Path
    startup_timeout_s: float


@dataclass
class CellRun:
    """What one cell produced."""

    cell: Cell
    records: list[ClusterRecord]
    startup_s: list[float]  # per server: spawn -> /health
    workload_s: float
    store_keys: Optional[int]  # objects in the cell's store at the end (None: no store)


def plan_cells(systems: Sequence[str], routings: Sequence[str], repeats: int, aa: bool) -> list[Cell]:
    """Cells in run order: the A/A cell first, then per repeat r, routing i (routings rotated
    by r), the systems rotated by i + r, so no system or routing is always first or last."""
    cells: list[Cell] = []
    if aa:
        cells.append(Cell(0, AA_SYSTEM, AA_ROUTING, 0))
    for r in range(repeats):
        for i in range(len(routings)):
            routing = routings[(i + r) % len(routings)]
            for j in range(len(systems)):
                cells.append(Cell(len(cells), systems[(j + i + r) % len(systems)], routing, r))
    return cells


def system_launch(system: str, store: Optional[MooncakeCluster], settings: BenchSettings,
                  cell_dir: Path, server_index: int) -> tuple[list[str], dict[str, str]]:
    """Server flags and environment of one server of `system` (sizes as `bench.ab.run`)."""
    args = cpu_args(settings.max_total_tokens) + ["--page-size", str(PAGE_TOKENS)]
    env = cpu_env()
    if system == "hicache":
        args += hicache_mooncake_args(store.config())
        env.update(hicache_mooncake_env(store.config()))
    elif system == "hiradix":
        args += ["--enable-hiradix", "--hiradix-store", "mooncake", "--hiradix-store-config", store.config_json()]
    device_bytes = settings.max_total_tokens * ab.kv_bytes_per_token(settings.model_path)
    sized = ab.with_tier_sizes([ab.System(f"{system}-{server_index}", tuple(args))], settings.dram_ratio,
                               settings.nvme_gb, device_bytes, cell_dir)  # fmt: skip
    return list(sized[0].server_args), env


def workload_order(sessions: Sequence[Session]) -> list[tuple[int, int]]:
    """(session_index, turn_index) pairs in send order: turn t of every session, then t + 1."""
    turns = max(s.num_turns for s in sessions)
    return [(s, t) for t in range(turns) for s, session in enumerate(sessions) if t < session.num_turns]


def tokenize_prompts(base_url: str, model: str, sessions: Sequence[Session]) -> dict[tuple[int, int], list[int]]:
    """Token ids of every prompt, as the server builds them for a chat completion (`/v1/tokenize`)."""
    out = {}
    for s, t in workload_order(sessions):
        body = {"model": model, "messages": sessions[s].prompt_messages(t)}
        req = urllib.request.Request(base_url + "/v1/tokenize", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=60) as resp:
            out[(s, t)] = [int(x) for x in json.loads(resp.read())["tokens"]]
    return out


def ideal_cached_tokens(prompts: dict[tuple[int, int], list[int]], order: Sequence[tuple[int, int]],
                        page_tokens: int = PAGE_TOKENS) -> dict[tuple[int, int], int]:
    """Per request, what one infinite cache shared by all servers would hit: the longest prefix
    shared with any earlier prompt in `order`, capped below the last token, in whole pages."""
    ideal, seen = {}, []
    for key in order:
        ids = prompts[key]
        best = 0
        for earlier in seen:
            n = 0
            for a, b in zip(ids, earlier):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        ideal[key] = min(best, len(ids) - 1) // page_tokens * page_tokens
        seen.append(ids)
    return ideal


def check_fits(prompts: dict[tuple[int, int], list[int]], max_total_tokens: int, max_tokens: int) -> None:
    """Refuse a workload whose longest prompt cannot run in the HBM pool at all.

    SGLang keeps such a request waiting forever (it never fits the pool); stop instead.

    Raises:
        ValueError: naming `--max-total-tokens` and `--max-message-chars`.
    """
    (s, t), ids = max(prompts.items(), key=lambda kv: len(kv[1]))
    need = len(ids) + max_tokens + PAGE_TOKENS
    if need > max_total_tokens:
        raise ValueError(f"session {s} turn {t} has a {len(ids)}-token prompt: with {max_tokens} new tokens and a "
                         f"page it needs {need} > --max-total-tokens {max_total_tokens}; raise the pool or lower "
                         "--max-message-chars / --turns")  # fmt: skip


async def drive_cell(cell: Cell, urls: Sequence[str], settings: BenchSettings,
                     ideal: dict[tuple[int, int], int]) -> list[ClusterRecord]:
    """Send the workload to the cell's servers, one request at a time, routed per turn."""
    config = settings.workload
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    records: list[ClusterRecord] = []
    order = workload_order(settings.sessions)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        model = config.model or await fetch_model_id(http, urls[0])
        t_start = time.perf_counter()
        for s, t in tqdm(order, desc=cell.label, unit="req", disable=not config.progress):
            session = settings.sessions[s]
            server = route(cell.routing, s, t, len(urls), settings.seed)
            record = ClusterRecord(cell.system, session.session_id, s, t, routing=cell.routing,
                                   repeat=cell.repeat, cell_index=cell.index, server_index=server,
                                   ideal_cached_tokens=ideal.get((s, t)))  # fmt: skip
            record.start_s = time.perf_counter() - t_start
            await send_chat_request(http, urls[server], session.prompt_messages(t), model, config, record)
            record.cached_nvme_tokens, record.cached_store_tokens = cluster_report.split_storage(
                record.cached_storage_tokens, record.cached_storage_backend)
            if record.error:
                logger.warning("[%s] %s turn %d failed: %s", cell.label, session.session_id, t, record.error)
            records.append(record)
    return records


def run_cell(cell: Cell, settings: BenchSettings, prompts: dict) -> CellRun:
    """Start the cell's store and servers, warm up, replay the workload, stop them (by PID).

    `prompts` (token ids per request) is filled from the first cell's server if empty.

    Raises:
        hiradix.testing.ServerStartError, hiradix.testing.mooncake.StoreStartError: a process
            did not come up (the message has its log).
        RuntimeError: a warm-up request failed.
        ValueError: the longest prompt cannot fit the HBM pool (`check_fits`).
    """
    cell_dir = settings.run_dir / "cells" / cell.label
    cell_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        store = None
        if cell.system in STORE_SYSTEMS:
            store = stack.enter_context(MooncakeCluster(num_holders=1, holder_segment_bytes=settings.store_bytes,
                                                        log_dir=cell_dir / "store"))  # fmt: skip
        servers = []
        for i in range(NUM_SERVERS):
            args, env = system_launch(cell.system, store, settings, cell_dir, i)
            server = ServerProcess(str(settings.model_path), extra_args=args, env=env,
                                   log_path=cell_dir / f"server-{i}.log", startup_timeout_s=settings.startup_timeout_s)
            stack.callback(server.stop)
            servers.append(server)
        logger.info("[%s] starting %d servers: %s", cell.label, len(servers), " ".join(servers[0].extra_args))
        for server in servers:
            server.start(wait=False)
        for server in servers:
            server.wait_healthy()
        for server in servers:
            ab.warm_up(server.base_url, settings.workload)
        if not prompts:
            model = asyncio.run(_model_id(servers[0].base_url))
            prompts.update(tokenize_prompts(servers[0].base_url, model, settings.sessions))
            check_fits(prompts, settings.max_total_tokens, settings.workload.max_tokens)
        ideal = ideal_cached_tokens(prompts, workload_order(settings.sessions))
        t0 = time.perf_counter()
        records = asyncio.run(drive_cell(cell, [s.base_url for s in servers], settings, ideal))
        workload_s = time.perf_counter() - t0
        for i, server in enumerate(servers):
            (cell_dir / f"server-{i}.metrics.txt").write_text(ab.fetch_metrics(server.base_url))
        store_keys = store.key_count() if store is not None else None
        startup_s = [s.startup_s or float("nan") for s in servers]
    return CellRun(cell, records, startup_s, workload_s, store_keys)


async def _model_id(base_url: str) -> str:
    async with aiohttp.ClientSession() as http:
        return await fetch_model_id(http, base_url)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description="Two servers behind a client-side router: stock, HiCache + "
                                                 "Mooncake, hiradix + Mooncake; round-robin, random, sticky.")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 4 sessions x 3 turns")
    parser.add_argument("--model", default=None, help=f"model dir (default {FULL_DEFAULTS['model']})")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, from " + ",".join(SYSTEMS))
    parser.add_argument("--routings", default=",".join(ROUTINGS), help="comma-separated, from " + ",".join(ROUTINGS))
    parser.add_argument("--no-aa", dest="aa", action="store_false", help="skip the stock-aa (A/A) cell")
    parser.add_argument("--repeats", type=int, default=1, help="run every cell this many times (rotated order)")
    parser.add_argument("--sessions", type=int, default=None, help="number of sessions")
    parser.add_argument("--turns", type=int, default=None, help="user turns per session")
    parser.add_argument("--seed", type=int, default=0, help="conversation selection and random-routing seed")
    parser.add_argument("--max-message-chars", type=int, default=None, help="cut each message to this")
    parser.add_argument("--source", default="auto", choices=["auto", "sharegpt", "synthetic"])
    parser.add_argument("--max-tokens", type=int, default=None, help="generated tokens per turn")
    parser.add_argument("--max-total-tokens", type=int, default=None, help="HBM KV pool per server, tokens")
    parser.add_argument("--dram-ratio", type=float, default=2.0,
                        help="DRAM of HiCache and hiradix as a multiple of the HBM pool (default 2)")
    parser.add_argument("--nvme-gb", type=float, default=0.0, help="hiradix NVMe tier per server, GB (default 0)")
    parser.add_argument("--store-mib", type=int, default=None, help="the store's holder segment, MiB")
    parser.add_argument("--out-dir", default=None, help="default runs/cluster-<timestamp>")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    return parser


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Parse and check options, filling the `--quick` / full defaults.

    Raises:
        SystemExit: On an unknown system or routing, or a repeat count below 1.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, value in (QUICK_DEFAULTS if args.quick else FULL_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.routings = [r.strip() for r in args.routings.split(",") if r.strip()]
    if not args.systems or any(s not in SYSTEMS for s in args.systems) or len(set(args.systems)) < len(args.systems):
        parser.error(f"--systems wants distinct names from {','.join(SYSTEMS)}, got {','.join(args.systems)}")
    if not args.routings or any(r not in ROUTINGS for r in args.routings) or len(set(args.routings)) < len(args.routings):
        parser.error(f"--routings wants distinct names from {','.join(ROUTINGS)}, got {','.join(args.routings)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark; returns the exit code (1 if any request failed)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")  # fmt: skip
    model_path = Path(args.model)
    if not model_path.is_absolute() and not model_path.exists():
        model_path = ab.REPO_ROOT / model_path
    if not model_path.exists():
        raise SystemExit(f"model {args.model} not found; build it with scripts/make_model.py "
                         f"--preset {'tiny' if args.quick else 'small'} --out {args.model}")  # fmt: skip
    run_dir = Path(args.out_dir) if args.out_dir else ab.REPO_ROOT / "runs" / f"cluster-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    sessions = tuple(load_sessions(args.sessions, args.turns, args.seed, args.max_message_chars, args.source))
    settings = BenchSettings(model_path, sessions, WorkloadConfig(max_tokens=args.max_tokens, seed=args.seed),
                             args.max_total_tokens, args.dram_ratio, args.nvme_gb, args.store_mib << 20, args.seed,
                             run_dir, args.startup_timeout_s)  # fmt: skip
    cells = plan_cells(args.systems, args.routings, args.repeats, args.aa and "stock" in args.systems)
    logger.info("%d sessions x %d turns (%s); %d cells; results in %s%s", len(sessions), args.turns,
                sessions[0].source, len(cells), run_dir, " (--quick: a smoke run)" if args.quick else "")
    t0 = time.perf_counter()
    prompts: dict = {}
    runs = [run_cell(cell, settings, prompts) for cell in cells]
    config = {**vars(args), "model": str(model_path), "num_servers": NUM_SERVERS, "page_tokens": PAGE_TOKENS,
              "session_ids": [s.session_id for s in sessions], "session_source": sessions[0].source,
              "cells": [dataclasses.asdict(c) for c in cells], "total_s": time.perf_counter() - t0,
              "tokenized_prompt_tokens": {f"{s}:{t}": len(ids) for (s, t), ids in prompts.items()}}  # fmt: skip
    report = cluster_report.build_report(runs)
    cluster_report.write_outputs(runs, report, run_dir, config)
    print()
    print(f"model {model_path.name}, {NUM_SERVERS} servers per system, {len(sessions)} sessions x {args.turns} turns "
          f"({sessions[0].source}), max_total_tokens {args.max_total_tokens}, page {PAGE_TOKENS}, dram "
          f"{args.dram_ratio:g}x, nvme {args.nvme_gb:g} GB, max_tokens {args.max_tokens}, repeats {args.repeats}"
          + (" -- a smoke run (--quick): tiny model, tiny prompts; its TTFTs are noise" if args.quick else ""))
    print(cluster_report.format_report(report))
    print(f"\nresults: {run_dir} (records.json, records.csv, summary.json, cluster_hits.png, cluster_ttft.png); "
          f"total {config['total_s']:.0f} s")
    return 1 if any(not r.ok for run in runs for r in run.records) else 0


if __name__ == "__main__":
    sys.exit(main())
