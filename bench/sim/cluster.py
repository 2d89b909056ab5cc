"""Cluster trace simulator: N servers behind a router, with or without a shared cluster store.

Replays a Mooncake-format trace (``bench/sim/simulate.py`` reads it) through N simulated servers,
each the server's own prefix cache (``bench.sim.simulate.Engine`` over
:class:`hiradix.core.prefix_cache.TieredPrefixCache`) on one shared virtual clock. A router sends
each request to one server:

* ``sticky``: every request of a conversation to the same server (the limit a session-affine
  load balancer reaches). A conversation is identified by its first block after the system
  prompt (``hash_ids[1]``): the trace's turns of one conversation share it.
* ``random``: a uniformly random server per request (seeded): what a load balancer that ignores
  sessions does, and where a server mostly sees turns whose history another server computed.

With ``--store`` the servers share one :class:`hiradix.testing.sim_ports.SimStore` (the cluster
tier: write-through PUTs, lookups of what follows a local match, GETs, all timed on the virtual
clock), optionally bounded (``--store-tokens``, LRU). Without it each server has only its own
tiers. Hit rate = hit tokens / prompt tokens over all servers; "store %" = the share of hit
tokens read from the store (another server's KV, or its own after a local eviction).

    .venv/bin/python bench/sim/cluster.py                       # 1, 4, 16 servers x routing x store
    .venv/bin/python bench/sim/cluster.py --instances 4 --tiers nvme --limit 3000

Outputs under ``--out-dir`` (default ``runs/simulate-cluster-<time>/``): ``simulate_cluster.json``
and ``simulate_cluster.png`` (hit rate per scenario, split by serving tier).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

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
from hiradix.testing.sim_ports import SimClock, SimStore  # noqa: E402

ROUTINGS = ("sticky", "random")


@dataclass(frozen=True)
class Scenario:
    """One simulated cluster."""

    instances: int
    routing: str  # sticky or random
    store: bool  # servers share a cluster store

    @property
    def name(self) -> str:
        return f"{self.instances}x {self.routing}{' +store' if self.store else ''}"


def conversation_of(req: TraceRequest) -> int:
    """The conversation a request belongs to: its first block after the shared system prompt."""
    return req.hash_ids[1] if len(req.hash_ids) > 1 else req.hash_ids[0]


def _spread(x: int) -> int:
    """A fixed, well-mixed hash of a conversation id (Fibonacci hashing), for sticky routing."""
    return ((x * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) >> 32


def route(trace: Sequence[TraceRequest], instances: int, routing: str, seed: int = 0) -> list[list[TraceRequest]]:
    """Split ``trace`` (sorted by arrival) into one sub-trace per server.

    Raises:
        ValueError: unknown ``routing``.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    rng = random.Random(seed)
    out: list[list[TraceRequest]] = [[] for _ in range(instances)]
    for req in trace:
        server = _spread(conversation_of(req)) % instances if routing == "sticky" else rng.randrange(instances)
        out[server].append(req)
    return out


def run_cluster(trace: Sequence[TraceRequest], cfg: SimConfig, scenario: Scenario, lowest_tier: str, policy: str,
                store_tokens: Optional[int] = None, seed: int = 0) -> dict:
    """Replay ``trace`` on one simulated cluster; returns its summary (JSON-ready)."""
    start = time.perf_counter()
    clock = SimClock()
    store = SimStore(None if store_tokens is None else store_tokens // cfg.page_size) if scenario.store else None
    engines = [Engine(part, cfg, lowest_tier, policy, clock=clock, store=store)
               for part in route(trace, scenario.instances, scenario.routing, seed)]
    while True:
        due = [(t, e) for e in engines if (t := e._next_event_s()) is not None]
        if not due:
            break
        now = min(t for t, _ in due)
        clock.advance_to(now)
        for t, engine in due:
            if t <= now:
                engine.step()
    counters = [e.counters for e in engines]
    prompt = sum(c.prompt_tokens for c in counters)
    by_tier = [sum(c.hit_tokens[i] for c in counters) for i in range(3)]
    hit = sum(by_tier)
    from_store = sum(c.store_tokens for c in counters)
    return {
        "scenario": scenario.name,
        **dataclasses.asdict(scenario),
        "hit_rate": hit / max(prompt, 1),
        "hit_share": {t: (n / hit if hit else 0.0) for t, n in zip(TIERS, by_tier)},
        "store_share": from_store / hit if hit else 0.0,
        "hit_tokens": dict(zip(TIERS, by_tier)),
        "store_tokens": from_store,
        "prompt_tokens": prompt,
        "requests": sum(c.requests for c in counters),
        "requests_per_server": [c.requests for c in counters],
        "store_objects": len(store) if store is not None else 0,
        "wall_s": time.perf_counter() - start,
    }


def default_scenarios(instances: Sequence[int]) -> list[Scenario]:
    out = []
    for n in instances:
        for routing in (("sticky",) if n == 1 else ROUTINGS):
            for store in (False, True):
                out.append(Scenario(n, routing, store))
    return out


def format_table(results: Sequence[dict], infinite: dict) -> str:
    head = f"{'cluster':<22}{'hit %':>7}{'% of inf':>9}{'HBM %':>7}{'DRAM %':>7}{'NVMe %':>7}{'store %':>8}{'wall s':>8}"
    lines = [head, "-" * len(head)]
    inf = infinite["token_hit_rate"]
    for r in results:
        s = r["hit_share"]
        lines.append(f"{r['scenario']:<22}{100 * r['hit_rate']:>7.1f}{100 * r['hit_rate'] / inf:>9.1f}"
                     f"{100 * s['hbm']:>7.1f}{100 * s['dram']:>7.1f}{100 * s['nvme']:>7.1f}"
                     f"{100 * r['store_share']:>8.1f}{r['wall_s']:>8.1f}")
    lines.append(f"{'infinite (one cache)':<22}{100 * inf:>7.1f}{100.0:>9.1f}")
    lines.append("hit %: hit tokens / prompt tokens over all servers; HBM/DRAM/NVMe %: where hiradix served the hits "
                 "(store reads count as DRAM, as the server sees them); store %: share of hits read from the store.")
    return "\n".join(lines)


def plot(results: Sequence[dict], infinite: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["scenario"] for r in results]
    local = [100 * r["hit_rate"] * (1 - r["store_share"]) for r in results]
    shared = [100 * r["hit_rate"] * r["store_share"] for r in results]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    ax.bar(names, local, label="local tiers (HBM, DRAM, NVMe)", color="tab:blue")
    ax.bar(names, shared, bottom=local, label="cluster store", color="tab:orange")
    ax.axhline(100 * infinite["token_hit_rate"], color="k", ls="--", label="infinite cache (one server)")
    ax.set_ylabel("hit rate (% of prompt tokens)")
    ax.set_title("Trace replay on N servers: hit rate by routing, with and without a shared store")
    ax.tick_params(axis="x", rotation=30)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--instances", default="1,4,16", help="comma list of server counts")
    p.add_argument("--tiers", default="dram", choices=TIERS, help="each server's lowest local tier")
    p.add_argument("--policy", default="lookahead", help="the servers' policy")
    p.add_argument("--store-tokens", type=lambda s: int(float(s)), default=None, help="store capacity (LRU); default: unbounded")
    p.add_argument("--seed", type=int, default=0, help="random routing's seed")
    p.add_argument("--out-dir", type=Path, default=None, help="where JSON and PNG go")
    add_sim_config_args(p)
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    cfg = sim_config_from_args(args)
    trace = load_trace(args.trace, args.limit)
    infinite = infinite_hit_rates(trace, cfg.page_size)
    scenarios = default_scenarios([int(n) for n in args.instances.split(",")])
    start = time.perf_counter()
    results = [run_cluster(trace, cfg, s, args.tiers, args.policy, args.store_tokens, args.seed) for s in scenarios]
    out_dir = args.out_dir or Path("runs") / time.strftime("simulate-cluster-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"trace": str(args.trace), "config": dataclasses.asdict(cfg), "tiers": args.tiers, "policy": args.policy,
               "store_tokens": args.store_tokens, "infinite": infinite, "results": results,
               "wall_s": time.perf_counter() - start}
    (out_dir / "simulate_cluster.json").write_text(json.dumps(summary, indent=2))
    plot(results, infinite, out_dir / "simulate_cluster.png")
    print(format_table(results, infinite))
    print(f"{len(trace)} requests, {len(results)} clusters: {summary['wall_s']:.1f} s; wrote {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
