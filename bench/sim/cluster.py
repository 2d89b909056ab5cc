"""Cluster trace simulator: N servers behind SGLang's router, with or without a shared cluster store.

Replays a Mooncake-format trace (``bench/sim/simulate.py`` reads it) through N simulated servers,
each the server's own prefix cache (``bench.sim.simulate.Engine`` over
:class:`hiradix.core.prefix_cache.TieredPrefixCache`) and its own FIFO queue of prefill batches, on
one shared virtual clock. At each request's arrival a router policy of the SMG (``bench/sim/router.py``:
round_robin, random, power_of_two, cache_aware, sticky) picks a server from the servers' loads
(requests outstanding).

With ``--store`` scenarios the servers share one :class:`hiradix.testing.sim_ports.SimStore` (the
cluster tier: write-through PUTs, lookups of what follows a local match, GETs), optionally bounded
(``--store-tokens``, LRU). The cost model is on (``bench/sim/cost.py``): a request's service time is
the read time of the cached tokens it uses (DRAM, NVMe, store bandwidths) and the prefill time of
the rest, and it reads only the leading run that beats recomputing (``--load-policy``).

Arrivals are scaled per cluster (``--per-server-load``, on by default): at N servers the trace's
time runs N times faster, so each server sees about the load one server sees at real time (the
trace at real time leaves 16 or 64 servers idle and nothing queues).

Per scenario: hit share = cached tokens used / prompt tokens (store share: of prompt tokens, read
from the store); imbalance = max / mean requests per server; queueing delay = arrival to admission
(mean, p99); time saved = 1 - modelled prefill time / prefill time with no cache.

    .venv/bin/python bench/sim/cluster.py                       # 4, 16, 64 servers x 5 policies x store
    .venv/bin/python bench/sim/cluster.py --instances 4 --policies cache_aware,round_robin --limit 3000

Outputs under ``--out-dir`` (default ``runs/simulate-cluster-<time>/``): ``simulate_cluster.json``
and ``simulate_cluster.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

if __package__ in (None, ""):  # run as a script: make `hiradix` and `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.sim.simulate import (  # noqa: E402
    DEFAULT_TRACE,
    TIERS,
    Engine,
    SimConfig,
    TraceRequest,
    add_sim_config_args,
    infinite_hit_rates,
    load_trace,
    sim_config_from_args,
)
from bench.sim.cluster_report import format_table, plot  # noqa: E402
from bench.sim.cost import sum_counters, time_saved  # noqa: E402
from bench.sim.router import ROUTER_POLICIES, CacheAwareConfig, Router  # noqa: E402
from hiradix.testing.sim_ports import SimClock, SimStore  # noqa: E402



@dataclass(frozen=True)
class Scenario:
    """One simulated cluster."""

    instances: int
    routing: str  # a router policy (bench.sim.router.ROUTER_POLICIES)
    store: bool  # servers share a cluster store

    @property
    def name(self) -> str:
        return f"{self.instances}x {self.routing}{' +store' if self.store else ''}"


def run_cluster(trace: Sequence[TraceRequest], cfg: SimConfig, scenario: Scenario, lowest_tier: str, policy: str,
                store_tokens: Optional[int] = None, seed: int = 0,
                cache_aware: CacheAwareConfig = CacheAwareConfig()) -> dict:
    """Replay ``trace`` on one simulated cluster, routing each request at its arrival; returns its
    summary (JSON-ready)."""
    start = time.perf_counter()
    clock = SimClock()
    store = SimStore(None if store_tokens is None else store_tokens // cfg.page_size) if scenario.store else None
    parts: list[list[TraceRequest]] = [[] for _ in range(scenario.instances)]
    engines = [Engine(part, cfg, lowest_tier, policy, clock=clock, store=store) for part in parts]
    router = Router(scenario.routing, scenario.instances, seed, cache_aware)
    nxt = 0
    while True:
        times = [t for e in engines if (t := e._next_event_s()) is not None]
        if nxt < len(trace):
            times.append(max(trace[nxt].arrival_s * cfg.time_scale, clock()))
        if not times:
            break
        now = min(times)
        clock.advance_to(now)
        while nxt < len(trace) and trace[nxt].arrival_s * cfg.time_scale <= now:
            loads = [len(e.trace) - e.finished for e in engines]
            parts[router.route(trace[nxt], loads, now)].append(trace[nxt])
            nxt += 1
        for engine in engines:
            t = engine._next_event_s()
            if t is not None and t <= now:
                engine.step()
    return summarize(scenario, engines, store, router, time.perf_counter() - start)


def summarize(scenario: Scenario, engines: Sequence[Engine], store, router: Router, wall_s: float) -> dict:
    """The scenario's figures from its servers' counters (see the module docstring)."""
    counters = [e.counters for e in engines]
    prompt = sum(c.prompt_tokens for c in counters)
    by_tier = [sum(c.hit_tokens[i] for c in counters) for i in range(3)]
    hit = sum(by_tier)
    from_store = sum(c.store_tokens for c in counters)
    per_server = [c.requests for c in counters]
    waits = np.concatenate([np.asarray(c.queue_wait_s, dtype=float) for c in counters] + [np.zeros(0)])
    waits = waits if waits.size else np.zeros(1)
    return {
        "scenario": scenario.name,
        **dataclasses.asdict(scenario),
        "hit_rate": hit / max(prompt, 1),
        "store_hit_rate": from_store / max(prompt, 1),
        "hit_share": {t: (n / hit if hit else 0.0) for t, n in zip(TIERS, by_tier)},
        "store_share": from_store / hit if hit else 0.0,
        "hit_tokens": dict(zip(TIERS, by_tier)),
        "store_tokens": from_store,
        "prompt_tokens": prompt,
        "requests": sum(per_server),
        "requests_per_server": per_server,
        "imbalance": max(per_server) / (sum(per_server) / len(per_server)) if sum(per_server) else 1.0,
        "queue_wait_s": {"mean": float(waits.mean()), "p50": float(np.percentile(waits, 50)),
                         "p99": float(np.percentile(waits, 99))},
        **time_saved(sum_counters(counters)),
        "router_decisions": dict(router.decisions) if scenario.routing == "cache_aware" else {},
        "store_objects": len(store) if store is not None else 0,
        "wall_s": wall_s,
    }


def default_scenarios(instances: Sequence[int], policies: Sequence[str]) -> list[Scenario]:
    """Every (N, router policy, with/without store) triple; one server only needs one policy."""
    out = []
    for n in instances:
        for routing in (policies[:1] if n == 1 else policies):
            for store in (False, True):
                out.append(Scenario(n, routing, store))
    return out


def cluster_config(cfg: SimConfig, instances: int, per_server_load: bool) -> SimConfig:
    """The servers' config at ``instances`` servers: arrivals ``instances`` times faster if
    ``per_server_load`` (each server sees about one server's load at real time)."""
    return dataclasses.replace(cfg, time_scale=cfg.time_scale / instances) if per_server_load else cfg


def _run_one(job: tuple) -> dict:
    trace, cfg, scenario, args, cache_aware = job
    ccfg = cluster_config(cfg, scenario.instances, args.per_server_load)
    out = run_cluster(trace, ccfg, scenario, args.tiers, args.policy, args.store_tokens, args.seed, cache_aware)
    out["time_scale"] = ccfg.time_scale
    return out


def run_scenarios(trace, cfg: SimConfig, scenarios: Sequence[Scenario], args, cache_aware: CacheAwareConfig) -> list[dict]:
    """Run ``scenarios`` on ``args.jobs`` processes (fork); results in the order given."""
    jobs = [(trace, cfg, s, args, cache_aware) for s in scenarios]
    if args.jobs <= 1 or len(jobs) == 1:
        return [_run_one(j) for j in jobs]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    order = sorted(range(len(jobs)), key=lambda k: -scenarios[k].instances)  # the slowest first
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("fork")) as pool:
        futures = {k: pool.submit(_run_one, jobs[k]) for k in order}
        return [futures[k].result() for k in range(len(jobs))]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--instances", default="4,16,64", help="comma list of server counts")
    p.add_argument("--policies", default=",".join(ROUTER_POLICIES), help="comma list of router policies")
    p.add_argument("--tiers", default="dram", choices=TIERS, help="each server's lowest local tier")
    p.add_argument("--policy", default="lookahead", help="the servers' eviction policy")
    p.add_argument("--store-tokens", type=lambda s: int(float(s)), default=None,
                   help="store capacity (LRU); default: unbounded")
    p.add_argument("--seed", type=int, default=0, help="random and power_of_two's seed")
    p.add_argument("--per-server-load", action=argparse.BooleanOptionalAction, default=True,
                   help="at N servers, arrivals N times faster (time_scale / N)")
    p.add_argument("--jobs", type=int, default=2, help="clusters simulated in parallel (processes)")
    p.add_argument("--out-dir", type=Path, default=None, help="where JSON and PNG go")
    d = CacheAwareConfig()
    p.add_argument("--cache-threshold", type=float, default=d.cache_threshold, help="cache_aware (smg --cache-threshold)")
    p.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs_threshold, help="cache_aware, in requests")
    p.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel_threshold, help="cache_aware")
    p.add_argument("--eviction-interval-s", type=float, default=d.eviction_interval_s, help="cache_aware tree pruning")
    p.add_argument("--max-tree-tokens", type=lambda s: int(float(s)), default=d.max_tree_tokens,
                   help="cache_aware tree size per server (smg --max-tree-size)")
    p.add_argument("--cache-aware-miss", default=d.miss, choices=("min_load", "smallest_tree"),
                   help="cache_aware below the threshold: smg's code (min_load) or its docs (smallest_tree)")
    add_sim_config_args(p)
    p.set_defaults(cost_model=True)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    cfg = sim_config_from_args(args)
    policies = args.policies.split(",")
    for name in policies:
        if name not in ROUTER_POLICIES:
            raise SystemExit(f"unknown router policy {name!r}; choose from {', '.join(ROUTER_POLICIES)}")
    cache_aware = CacheAwareConfig(args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold,
                                   args.eviction_interval_s, args.max_tree_tokens, args.cache_aware_miss)
    trace = load_trace(args.trace, args.limit)
    infinite = infinite_hit_rates(trace, cfg.page_size)
    scenarios = default_scenarios([int(n) for n in args.instances.split(",")], policies)
    start = time.perf_counter()
    results = run_scenarios(trace, cfg, scenarios, args, cache_aware)
    out_dir = args.out_dir or Path("runs") / time.strftime("simulate-cluster-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"trace": str(args.trace), "requests": len(trace), "config": dataclasses.asdict(cfg), "tiers": args.tiers,
               "policy": args.policy, "store_tokens": args.store_tokens, "per_server_load": args.per_server_load,
               "cache_aware": dataclasses.asdict(cache_aware), "infinite": infinite, "results": results,
               "wall_s": time.perf_counter() - start}
    (out_dir / "simulate_cluster.json").write_text(json.dumps(summary, indent=2))
    plot(results, infinite, out_dir / "simulate_cluster.png")
    print(format_table(results, infinite))
    print(f"{len(trace)} requests, {len(results)} clusters on {args.jobs} processes: {summary['wall_s']:.1f} s; "
          f"wrote {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
