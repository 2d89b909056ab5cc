"""Cluster benchmark: fleets of N SGLang servers behind SGLang's own router (`smg`), with and without
a shared Mooncake Store, paired like `bench.ab` (issue 19).

Systems (`bench.cluster.systems`): `KIND:POLICY`, a server kind (`stock` RadixAttention, `hiradix` +
its Mooncake Store, `hicache` = stock HiCache + its Mooncake Store) behind an `smg` router with that
policy (`round_robin`, `cache_aware`, `power_of_two`, `least_load`, ...). Every system has its own
fleet of `--servers` N servers (and its own store where it has one) and its own router, ALL UP AT
ONCE for the whole run (`bench.cluster.fleet`; idle servers sleep, `--sleep-on-idle`). The A/A
control is a second fleet of the reference system (`stock-aa:cache_aware` next to
`stock:cache_aware`). `ideal` is computed, not run: one infinite cache shared by every server
(`bench.cluster.workload.ideal_cached_tokens`, over the reference system's prompts). A sticky
system (`--sticky-sessions` with a routing-key header) is not included: `bench.ab.paired` sends no
per-session headers.

Memory: one tiny-model server takes ~1.7 GB here, so a run holds at most ~12 servers; a run of more
than `--max-servers` (default 12) servers in total is refused before anything starts. Default
systems (12 servers): N=2 `stock:cache_aware, stock-aa:cache_aware, stock:round_robin,
hiradix:round_robin, hiradix:cache_aware, hicache:cache_aware`; N=4 `stock:cache_aware,
stock-aa:cache_aware, hiradix:round_robin`. `--second` runs the other policies against the same
reference: N=2 `stock:cache_aware, stock-aa:cache_aware, hiradix:power_of_two, hiradix:least_load,
hicache:round_robin`; N=4 `stock:cache_aware, hiradix:power_of_two, hiradix:least_load`.

Model: `models/tiny` for N=2 and N=4 (the small model's servers do not fit 12 at once). HBM pool
`--max-total-tokens` 2560 per server (~5 MB of KV at 2 KiB a token): a repetition's working set
(4 hot sessions x 8 turns of up to 1,500 characters per message + 24 cold x 3 of up to 400, with 16-token
answers: ~10-11.6k tokens on N=2 by the tiny model's tokenizer, the longest prompt ~2,000) is twice the
fleet's HBM (5k); N=4 doubles the sessions (~22k vs 10k). So HBM churns; DRAM (hiradix, HiCache) is
2x the pool per server, and only the store holds everything.

Paired rounds (`bench.ab.paired.run_paired`, reused): the workload advances in rounds; a round's
batch (the next turn of up to `--concurrency` ready sessions, sent concurrently) goes to each
system's router in turn, one system at a time, in an order rotated per round (`rotation`: a Williams
design); request (repeat, session, turn) is paired across systems. Sessions arrive as a seeded
Poisson process (`--session-rate`), think `--think-time-s` (exponential mean) between turns, and
each system's history carries its own answers. Workload (`bench.cluster.workload`): skewed, a few
hot sessions with many long turns among many short cold ones; batches of 8 on N=2 (16 on N=4) so
queues form at the servers. `--repeats` repetitions, each with sessions of its own, every server's
cache flushed in between where it lets itself be (`flush_best_effort`: stock HiCache + Mooncake refuses);
the stores keep the old sessions' pages, which no later request can hit.

Report (`bench.cluster.report`): per system, hit share by tier (HBM / DRAM / store), prefill tokens
computed, TTFT of turns >= 2 (1-based: every turn with a history) p50 and p99 with bootstrap 95%
intervals, requests per server from the router (max/mean = imbalance), the router-side TTFT, ratios
to the reference with intervals and the A/A; then the targets (printed, not asserted).
Outputs under `runs/cluster-<timestamp>/` (or `--out-dir`): records.json, records.csv, summary.json,
config.json, cluster_hits.png, cluster_ttft.png, cluster_imbalance.png, and `fleets/<system>/` with
the server, router and store logs and each server's final `/metrics`.

    python -m bench.cluster --servers 2             # N=2, the default systems (12 servers)
    python -m bench.cluster --servers 2 --second    # N=2, the other policies
    python -m bench.cluster --servers 4             # N=4 (12 servers)
    python -m bench.cluster --quick                 # smoke run: N=2, stock:cache_aware + hiradix:round_robin
    python -m bench.cluster --servers 2 --systems \
        stock:cache_aware,stock-aa:cache_aware,hiradix:round_robin,hiradix:cache_aware,hiradix:cache_aware+events

`KIND:cache_aware+events` (issue 34): smg's cache-aware policy fed by the engines' KV events
(`bench.cluster.systems`, `bench.cluster.smg_grpc`): its servers run in SGLang's SMG gRPC mode (the
smg-grpc-servicer package must be importable; the run is refused up front otherwise), so its
warm-up goes through its router (before the router's counters are read), its flush is the router's
`POST /flush_cache`, its servers' `/metrics` come from SGLang's HTTP sidecar, and its records have
`cached_tokens` without a tier split or output ids (smg's gRPC responses carry neither; `same`
compares texts). The ideal is tokenized by an HTTP server (the reference's first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a file: python bench/cluster/run.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.ab import run as ab
from bench.ab.paired import PairedConfig, PairedRecord, run_paired
from bench.cluster import fleet as cluster_fleet
from bench.cluster import report as cluster_report
from bench.cluster import workload as cluster_workload
from bench.cluster.systems import (DEFAULT_SYSTEMS, REFERENCE, SECOND_SYSTEMS, SERVED_MODEL, FleetSystem,
                                   check_server_budget, parse_systems)
from bench.common.conversations import Session
from bench.common.multiturn import WorkloadConfig
from bench.cluster.smg_grpc import fetch_server_metrics, servicer_problem
from bench.common.server_metrics import parse_snapshot, tier_used_tokens

logger = logging.getLogger("bench.cluster.run")

FULL_DEFAULTS = {"model": "models/tiny", "hot": 4, "hot_turns": 8, "hot_chars": 1500, "cold": 24, "cold_turns": 3,
                 "cold_chars": 400, "max_tokens": 16, "concurrency": None, "session_rate": 2.0, "think_time_s": 0.5,
                 "repeats": 4, "max_total_tokens": 2560, "store_mib": 256}  # fmt: skip
QUICK_DEFAULTS = {"model": "models/tiny", "hot": 0, "hot_turns": 3, "hot_chars": 200, "cold": 3, "cold_turns": 3,
                  "cold_chars": 200, "max_tokens": 8, "concurrency": 1, "session_rate": 0.0, "think_time_s": 0.0,
                  "repeats": 1, "max_total_tokens": 1024, "store_mib": 64}  # fmt: skip
QUICK_SYSTEMS = "stock:cache_aware,hiradix:round_robin"


@dataclass
class ClusterRecord(PairedRecord):
    """A `PairedRecord` plus the `ideal` hit of its prompt and its storage hits split by source (tokens)."""

    ideal_cached_tokens: Optional[int] = None
    cached_nvme_tokens: Optional[int] = None  # storage hits from local NVMe (hiradix)
    cached_store_tokens: Optional[int] = None  # storage hits from the cluster store


@dataclass
class RepeatResult:
    """One repetition: its records and, per system, the router's counters over it."""

    records: list[ClusterRecord]
    router: dict  # system name -> fleet.RouterSnapshot (delta over the repetition)
    workload_s: float
    admission: dict = dataclasses.field(default_factory=dict)  # system name -> server_metrics ADMISSION_COUNTERS delta


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description="Fleets behind SGLang's router (smg), "
                                "paired: stock / hiradix + store / HiCache + store x router policies.")  # fmt: skip
    p.add_argument("--quick", action="store_true", help=f"smoke run: N=2, {QUICK_SYSTEMS}, 3 sessions x 3 turns")
    p.add_argument("--servers", type=int, default=2, help="servers per system (N)")
    p.add_argument("--systems", default=None, help="KIND:POLICY,... (default: see the module docstring)")
    p.add_argument("--second", action="store_true", help="the second invocation's systems (other policies)")
    p.add_argument("--max-servers", type=int, default=12, help="refuse runs with more servers in all")
    p.add_argument("--model", default=None)
    p.add_argument("--repeats", type=int, default=None)
    for name, what in (("hot", "hot sessions"), ("hot-turns", "turns of a hot session"),
                       ("hot-chars", "max characters per hot message"), ("cold", "cold sessions"),
                       ("cold-turns", "turns of a cold session"), ("cold-chars", "max characters per cold message"),
                       ("max-tokens", "generated tokens per turn"), ("concurrency", "requests per round"),
                       ("max-total-tokens", "HBM KV pool per server, tokens"), ("store-mib", "holder segment, MiB")):
        p.add_argument(f"--{name}", type=int, default=None, help=what)
    p.add_argument("--session-rate", type=float, default=None, help="Poisson session arrivals per s (0: all at once)")
    p.add_argument("--think-time-s", type=float, default=None, help="mean think time between turns")
    p.add_argument("--dram-ratio", type=float, default=2.0, help="DRAM of HiCache and hiradix x the HBM pool")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--source", default="auto", choices=["auto", "sharegpt", "synthetic"])
    p.add_argument("--router-args", default="", help="more `smg launch` flags for every router")
    p.add_argument("--out-dir", default=None, help="default runs/cluster-<timestamp>")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    return p


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    """Options with the `--quick` / full defaults filled and the systems parsed (`args.fleet_systems`).

    Raises:
        SystemExit: On bad systems, a repeat count below 1, or more servers than `--max-servers`.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, value in (QUICK_DEFAULTS if args.quick else FULL_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.concurrency is None:
        args.concurrency = 4 * args.servers
    if args.systems is None:
        table = SECOND_SYSTEMS if args.second else DEFAULT_SYSTEMS
        args.systems = QUICK_SYSTEMS if args.quick else table.get(args.servers, table[4 if args.servers > 2 else 2])
    try:
        args.fleet_systems = parse_systems(args.systems)
        check_server_budget(args.fleet_systems, args.servers, args.max_servers)
    except ValueError as exc:
        parser.error(str(exc))
    events = [s.name for s in args.fleet_systems if s.events]
    if events and servicer_problem():
        parser.error(f"{', '.join(events)}: {servicer_problem()}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def sessions_per_repeat(args: argparse.Namespace) -> list[list[Session]]:
    """Sessions of their own for each repetition (scaled by N/2: the same load per server)."""
    scale = max(1, args.servers // 2)
    return cluster_workload.skewed_sessions(args.hot * scale, args.hot_turns, args.hot_chars, args.cold * scale,
                                            args.cold_turns, args.cold_chars, args.seed, args.source, args.repeats)


def to_cluster_record(r: PairedRecord) -> ClusterRecord:
    rec = ClusterRecord(**dataclasses.asdict(r))
    rec.cached_nvme_tokens, rec.cached_store_tokens = cluster_report.split_storage(
        rec.cached_storage_tokens, rec.cached_storage_backend)
    return rec


def run_repeat(fleets: Sequence[cluster_fleet.Fleet], repeat: int, sessions: Sequence[Session],
               config: PairedConfig) -> RepeatResult:
    """One repetition on flushed caches: warm up every server (directly, not through its router), then
    the paired rounds through the routers; the routers' counters are read before and after."""
    for fleet in fleets:
        if fleet.system.events:  # gRPC workers have no HTTP API: through the router, before its counters are read
            ab.warm_up(fleet.router.base_url, config.workload, config.concurrency * len(fleet.servers))
            continue
        for server in fleet.servers:
            ab.warm_up(server.base_url, config.workload, config.concurrency)
    before = {f.system.name: cluster_fleet.router_snapshot(f.router) for f in fleets}
    admission_before = {f.system.name: fleet_admission(f) for f in fleets}
    names = [f.system.name for f in fleets]
    order = names[repeat % len(names):] + names[: repeat % len(names)]
    urls = {f.system.name: f.router.base_url for f in fleets}
    total = sum(s.num_turns for s in sessions)
    t0 = time.perf_counter()

    def progress(round_index: int, done: int) -> None:
        logger.info("repeat %d round %d: %d/%d requests per system (%.0f s)", repeat, round_index, done, total,
                    time.perf_counter() - t0)

    records = asyncio.run(run_paired({n: urls[n] for n in order}, sessions,
                                     dataclasses.replace(config, repeat=repeat), progress))  # fmt: skip
    workload_s = time.perf_counter() - t0
    router = {f.system.name: cluster_fleet.router_snapshot(f.router).minus(before[f.system.name]) for f in fleets}
    admission = {}
    for f in fleets:
        start = admission_before[f.system.name]
        admission[f.system.name] = {k: v - start.get(k, 0.0) for k, v in fleet_admission(f).items()}
    return RepeatResult([to_cluster_record(r) for r in records], router, workload_s, admission)


def fleet_admission(fleet: cluster_fleet.Fleet) -> dict:
    """The arrival-to-admission counters (`bench.common.server_metrics.ADMISSION_COUNTERS`) summed over
    a fleet's servers now."""
    total: Counter = Counter()
    for server in fleet.servers:
        total.update(parse_snapshot(fetch_server_metrics(server)).admission)  # update keeps zeros (+ drops them)
    return dict(total)


def flush_best_effort(fleets: Sequence[cluster_fleet.Fleet], timeout_s: float = 15.0) -> list[str]:
    """Empty every server's prefix cache between repetitions (`bench.ab.run.flush_caches`, one server at
    a time); returns the servers that still refused after `timeout_s`. Stock HiCache + Mooncake
    refused `/flush_cache` for minutes after a repetition ("pending requests", with no request queued
    or running): its old pages then stay, which no later request can hit (sessions of their own)."""
    refused = []
    for f in fleets:
        if f.system.events:
            if not flush_through_router(f, timeout_s):
                logger.warning("[%s] caches not empty %.0f s after the router's /flush_cache: they keep the last "
                               "repetition's pages", f.system.name, timeout_s)  # fmt: skip
                refused.append(f.system.name)
            continue
        for i, server in enumerate(f.servers):
            label = f"{f.system.name}/{i}"
            try:
                ab.flush_caches({label: server}, timeout_s=timeout_s)
            except TimeoutError:
                logger.warning("[%s] /flush_cache still refused after %.0f s: its cache keeps the last repetition's "
                               "pages", label, timeout_s)  # fmt: skip
                refused.append(label)
    return refused


def flush_through_router(fleet: cluster_fleet.Fleet, timeout_s: float, poll_s: float = 0.5) -> bool:
    """Empty a gRPC fleet's caches: `POST /flush_cache` to its router (smg sends `FlushCache` to every
    worker), retried until it answers 200 and every server's hiradix tier gauges (its sidecar's
    `/metrics`) read 0; False if not so within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            request = urllib.request.Request(fleet.router.base_url + "/flush_cache", method="POST")
            with urllib.request.urlopen(request, timeout=30) as resp:
                flushed = resp.status == 200
        except (urllib.error.URLError, OSError):
            flushed = False
        if flushed and all(tier_used_tokens(fetch_server_metrics(s)) == 0 for s in fleet.servers):
            logger.info("[%s] caches flushed (through the router)", fleet.system.name)
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)


def http_server_url(fleets: Sequence[cluster_fleet.Fleet], first: str) -> Optional[str]:
    """The base URL of an HTTP server (`/tokenize`), of fleet `first` if it has one; None if every
    fleet runs in gRPC mode."""
    for f in sorted(fleets, key=lambda f: f.system.name != first):
        if not f.system.events:
            return f.servers[0].base_url
    return None


def fill_ideal(records: list[ClusterRecord], reference: str, sessions_by_repeat: list, tokenize_url: str) -> int:
    """Set `ideal_cached_tokens` of every record from the reference system's prompts (its own answers,
    tokenized by `tokenize_url`'s server) in its send order, per repetition; returns the longest prompt."""
    ref = [r for r in records if r.system == reference]
    answers = {(r.repeat, r.session_index, r.turn_index): r.output_text for r in ref}
    ideal, longest = {}, 0
    for repeat, sessions in enumerate(sessions_by_repeat):
        prompts, outputs, order = {}, {}, []
        for r in (x for x in ref if x.repeat == repeat):
            key = (r.session_index, r.turn_index)
            outputs[key] = r.output_token_ids
            own = [answers.get((repeat, r.session_index, t), "") for t in range(r.turn_index)]
            prompts[key] = cluster_workload.tokenize_chat(
                tokenize_url, SERVED_MODEL, sessions[r.session_index].prompt_messages(r.turn_index, own))
            longest = max(longest, len(prompts[key]))
            order.append(key)
        for key, n in cluster_workload.ideal_cached_tokens(prompts, order, outputs=outputs).items():
            ideal[(repeat, *key)] = n
    for r in records:
        r.ideal_cached_tokens = ideal.get((r.repeat, r.session_index, r.turn_index))
    return longest


def run_all(args: argparse.Namespace, by_repeat: list, run_dir: Path) -> tuple[list[RepeatResult], dict]:
    """Start every fleet, run the repetitions, compute the ideal, save each server's `/metrics`; stop all."""
    systems: list[FleetSystem] = args.fleet_systems
    settings = cluster_fleet.FleetSettings(Path(args.model), args.servers, args.max_total_tokens, args.dram_ratio,
                                           args.store_mib << 20, run_dir, args.startup_timeout_s,
                                           tuple(args.router_args.split()))  # fmt: skip
    workload = WorkloadConfig(max_tokens=args.max_tokens, think_time_s=args.think_time_s,
                              session_rate_per_s=args.session_rate or None, seed=args.seed, ignore_eos=True,
                              model=SERVED_MODEL, progress=False)  # fmt: skip
    config = PairedConfig(workload, concurrency=args.concurrency, own_answers=True)
    info: dict = {}
    with contextlib.ExitStack() as stack:
        t0 = time.perf_counter()
        fleets = cluster_fleet.start_fleets(stack, systems, settings)
        info["startup_s"] = time.perf_counter() - t0
        results = []
        for repeat, sessions in enumerate(by_repeat):
            if repeat:
                info.setdefault("not_flushed", []).extend(flush_best_effort(fleets))
            results.append(run_repeat(fleets, repeat, sessions, config))
            logger.info("repeat %d done after %.0f s", repeat, time.perf_counter() - t0)
        names = [f.system.name for f in fleets]
        reference = REFERENCE if REFERENCE in names else names[0]
        tokenize_url = http_server_url(fleets, reference)
        if tokenize_url is None:
            logger.warning("no HTTP server to tokenize with (every fleet in gRPC mode): no ideal hits")
        else:
            info["longest_prompt_tokens"] = fill_ideal([r for res in results for r in res.records], reference,
                                                       by_repeat, tokenize_url)  # fmt: skip
        info["store_keys"] = {f.system.name: f.store.key_count() for f in fleets if f.store is not None}
        info["worker_urls"] = {f.system.name: [s.base_url for s in f.servers] for f in fleets}
        for f in fleets:
            for i, server in enumerate(f.servers):
                metrics = fetch_server_metrics(server)
                (run_dir / "fleets" / f.system.slug / f"server-{i}.metrics.txt").write_text(metrics)
            (run_dir / "fleets" / f.system.slug / "router.metrics.txt").write_text(f.router.metrics_text())
    return results, info


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark; returns the exit code (1 if any request failed)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")  # fmt: skip
    model_path = Path(args.model)
    if not model_path.is_absolute() and not model_path.exists():
        model_path = ab.REPO_ROOT / model_path
    if not model_path.exists():
        raise SystemExit(f"model {args.model} not found; build it with scripts/make_model.py --preset tiny")
    args.model = str(model_path)
    run_dir = Path(args.out_dir) if args.out_dir else ab.REPO_ROOT / "runs" / f"cluster-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    by_repeat = sessions_per_repeat(args)
    count = ab.token_counter(model_path)
    cluster_workload.check_fits(max(cluster_workload.longest_prompt_bound(ss, count, answer_tokens=args.max_tokens)
                                    for ss in by_repeat), args.max_total_tokens, args.max_tokens)  # fmt: skip
    logger.info("N=%d, systems %s; %d repeat(s) of %d sessions (%s); results in %s", args.servers, args.systems,
                args.repeats, len(by_repeat[0]), by_repeat[0][0].source, run_dir)
    t0 = time.perf_counter()
    results, info = run_all(args, by_repeat, run_dir)
    config = {**{k: v for k, v in vars(args).items() if k != "fleet_systems"}, **info,
              "total_s": time.perf_counter() - t0, "session_source": by_repeat[0][0].source,
              "session_ids": [[s.session_id for s in ss] for ss in by_repeat],
              "session_turns": [[s.num_turns for s in ss] for ss in by_repeat]}  # fmt: skip
    report = cluster_report.build_report(results, [s.name for s in args.fleet_systems], info["worker_urls"])
    cluster_report.write_outputs(results, report, run_dir, config)
    print()
    print(f"model {model_path.name}, N={args.servers} servers per system, {args.repeats} repeat(s) of "
          f"{len(by_repeat[0])} sessions ({by_repeat[0][0].source}; hot {args.hot * max(1, args.servers // 2)} x "
          f"{args.hot_turns} turns, cold {args.cold * max(1, args.servers // 2)} x {args.cold_turns}), concurrency "
          f"{args.concurrency}, max_total_tokens {args.max_total_tokens}, page 16, dram {args.dram_ratio:g}x, "
          f"max_tokens {args.max_tokens}" + (" -- a smoke run (--quick): its TTFTs are noise" if args.quick else ""))
    print(cluster_report.format_report(report))
    if info.get("not_flushed"):
        print(f"not flushed between repetitions (refused /flush_cache): {', '.join(sorted(set(info['not_flushed'])))}")
    print(f"\nresults: {run_dir}; startup {info['startup_s']:.0f} s, total {config['total_s']:.0f} s")
    return 1 if any(not r.ok for res in results for r in res.records) else 0


if __name__ == "__main__":
    sys.exit(main())
