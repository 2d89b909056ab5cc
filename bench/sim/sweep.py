"""Hit rate against capacity (``bench/sim/simulate.py --sweep``): hiradix policies next to LRU, Belady, infinite.

Capacity points are fractions of the trace's unique tokens (distinct blocks x 512; default 1%,
3%, 9%, 25%, 50%). At a point of ``C`` tokens the simulated server has DRAM ``C x dram_share``
(default 1/9, the 1M DRAM : 8M NVMe of issue 12) and NVMe the rest, HBM as configured
(``--hbm-tokens``). Per point:

* every ``--policies`` policy on the ``nvme`` scenario (bench/sim/simulate.py's engine);
* "NVMe worth" of ``--worth-policy``: its hit rate with DRAM d + NVMe n over its hit rate with
  DRAM d + n alone (the ``dram`` scenario with all of C in DRAM);
* the references over one pool of C (bench/sim/offline.py): Belady's offline optimum and plain LRU;
  and the infinite cache.

Hit rates are block hit rates (the simulator's ``block %``, comparable with Belady's). The
targets of issue 12 are judged per point against the ``lru`` policy of the same run. Outputs:
``sweep.json``, ``sweep.png`` (hit rate vs capacity), the sweep table and the targets table.
"""

from __future__ import annotations

import dataclasses
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

from bench.sim.offline import BLOCK_TOKENS, belady_hit_rate, distinct_blocks, lru_hit_rate

DEFAULT_FRACTIONS = (0.01, 0.03, 0.09, 0.25, 0.5)


def points(trace: Sequence, fractions: Sequence[float], dram_share: float) -> list[dict]:
    """Capacity points: ``{"fraction", "tokens", "dram_tokens", "nvme_tokens"}`` (whole 512-token blocks)."""
    unique = distinct_blocks(trace) * BLOCK_TOKENS
    out = []
    for f in fractions:
        tokens = max(2, round(f * unique / BLOCK_TOKENS)) * BLOCK_TOKENS
        dram = max(1, round(dram_share * tokens / BLOCK_TOKENS)) * BLOCK_TOKENS
        out.append({"fraction": f, "tokens": tokens, "dram_tokens": dram, "nvme_tokens": tokens - dram})
    return out


_TRACE: Sequence = ()  # set in the parent before the pool forks: the workers read it, no pickling


def _run(job: tuple) -> dict:
    from bench.sim.simulate import run_scenario

    cfg, tier, policy = job
    return run_scenario(_TRACE, cfg, tier, policy)


def run_sweep(trace: Sequence, base_cfg, policies: Sequence[str], worth_policy: Optional[str],
              fractions: Sequence[float], dram_share: float, jobs: int) -> dict:
    """Simulate every point; returns the JSON-ready summary (per point: results and references)."""
    global _TRACE
    pts = points(trace, fractions, dram_share)
    work = []
    for p in pts:
        cfg = dataclasses.replace(base_cfg, dram_tokens=p["dram_tokens"], nvme_tokens=p["nvme_tokens"])
        work += [(cfg, "nvme", pol) for pol in policies]
        if worth_policy:
            work.append((dataclasses.replace(base_cfg, dram_tokens=p["tokens"], nvme_tokens=0), "dram", worth_policy))
    start = time.perf_counter()
    _TRACE = trace
    import multiprocessing as mp

    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=mp.get_context("fork")) as pool:
        results = list(pool.map(_run, work))
    it = iter(results)
    for p in pts:
        p["results"] = {pol: next(it) for pol in policies}
        if worth_policy:
            p["dram_only"] = next(it)
        blocks = p["tokens"] // BLOCK_TOKENS
        p["belady"] = belady_hit_rate(trace, blocks)
        p["lru_blocks"] = lru_hit_rate(trace, blocks)
    from bench.sim.simulate import infinite_hit_rates

    inf = infinite_hit_rates(trace, base_cfg.page_size)
    return {"points": pts, "infinite": inf, "policies": list(policies), "worth_policy": worth_policy,
            "dram_share": dram_share, "config": dataclasses.asdict(base_cfg), "wall_s": time.perf_counter() - start,
            "max_scenario_wall_s": max(r["wall_s"] for r in results)}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def format_sweep(summary: dict) -> str:
    """The sweep table: per capacity point, block hit % of each system, served-without-wait %,
    NVMe wait per request, unready share, NVMe worth, and wall time."""
    pols = summary["policies"]
    head = f"{'capacity':>10}{'% uniq':>7}" + "".join(f"{p:>12}" for p in pols) + f"{'LRU blk':>9}{'Belady':>8}{'inf':>6}"
    head += "".join(f"{'ready% ' + p[:4]:>12}" for p in pols) + "".join(f"{'wait ms ' + p[:4]:>13}" for p in pols)
    head += "".join(f"{'saved% ' + p[:4]:>12}" for p in pols)
    head += f"{'unready%':>9}{'worth%':>8}{'wall s':>7}"
    lines = [head, "-" * len(head)]
    inf = summary["infinite"]["block_hit_rate"]
    best = pols[-1]
    for p in summary["points"]:
        r = p["results"]
        row = f"{p['tokens'] / 1e6:>9.2f}M{100 * p['fraction']:>7.0f}" + "".join(f"{_pct(r[q]['block_hit_rate']):>12}" for q in pols)
        row += f"{_pct(p['lru_blocks']):>9}{_pct(p['belady']):>8}{_pct(inf):>6}"
        row += "".join(f"{_pct(r[q]['ready_share']):>12}" for q in pols)
        row += "".join(f"{r[q]['nvme_wait_s']['per_request_ms']:>13.1f}" for q in pols)
        row += "".join(f"{_pct(r[q].get('time_saved', 0.0)):>12}" for q in pols)
        row += f"{100 * r[best]['nvme_unready_tokens'] / max(1, r[best]['prompt_tokens']):>9.2f}"
        worth = _worth(p)
        row += f"{'-' if worth is None else _pct(worth):>8}{max(x['wall_s'] for x in r.values()):>7.0f}"
        lines.append(row)
    lines += [
        "columns per policy: block hit % (hiradix simulator, nvme scenario); LRU blk / Belady: one pool of DRAM+NVMe",
        "bytes over the trace's blocks (bench/sim/offline.py); ready%: hits already in HBM or DRAM at the first admission",
        "try; wait ms: NVMe wait per request; saved%: prefill time saved vs no cache (--cost-model: reads + prefill,",
        "load or recompute; else prefill of the misses only); unready%: NVMe tokens admitted unread "
        f"({best}), of prompt tokens;",
        f"worth%: {summary['worth_policy']} with DRAM d + NVMe n over DRAM d+n alone; wall s: slowest scenario.",
    ]
    return "\n".join(lines)


def _worth(p: dict) -> Optional[float]:
    if "dram_only" not in p:
        return None
    pol = p["dram_only"]["policy"]
    alone = p["dram_only"]["block_hit_rate"]
    return p["results"][pol]["block_hit_rate"] / alone if alone else None


def targets(summary: dict, policy: str) -> list[dict]:
    """Issue 12's targets for ``policy`` at every point: value, bound, met."""
    rows = []
    for p in summary["points"]:
        r, lru = p["results"][policy], p["results"].get("lru")
        hit, bel = r["block_hit_rate"], p["belady"]
        at = f"{p['tokens'] / 1e6:.2f}M"
        rows.append({"point": at, "target": "hit >= 90% of Belady", "value": hit / bel if bel else 0.0, "bound": 0.9})
        if lru is not None and lru["block_hit_rate"] < 0.8 * bel:
            rows.append({"point": at, "target": "hit >= 1.2x lru (lru < 80% of Belady)",
                         "value": hit / max(lru["block_hit_rate"], 1e-9), "bound": 1.2})
        rows.append({"point": at, "target": ">= 90% of hits served without waiting", "value": r["ready_share"], "bound": 0.9})
        if lru is not None:
            lw = lru["nvme_wait_s"]["per_request_ms"]
            rows.append({"point": at, "target": "NVMe wait per request <= 25% of lru's",
                         "value": r["nvme_wait_s"]["per_request_ms"] / lw if lw else 0.0, "bound": 0.25, "upper": True})
        worth = _worth(p)
        if worth is not None:
            rows.append({"point": at, "target": "NVMe worth >= 95%", "value": worth, "bound": 0.95})
        rows.append({"point": at, "target": "nvme_unready_tokens <= 0.1% of prompt tokens",
                     "value": r["nvme_unready_tokens"] / max(1, r["prompt_tokens"]), "bound": 0.001, "upper": True})
    for row in rows:
        row["met"] = row["value"] <= row["bound"] if row.get("upper") else row["value"] >= row["bound"]
    return rows


def format_targets(rows: list[dict]) -> str:
    out = [f"{'point':>8}  {'target':<46}{'value':>9}{'bound':>8}  met"]
    for r in rows:
        out.append(f"{r['point']:>8}  {r['target']:<46}{r['value']:>9.3f}{r['bound']:>8.3f}  {'yes' if r['met'] else 'NO'}")
    return "\n".join(out)


def plot_sweep(summary: dict, path: Path) -> None:
    """Block hit rate vs capacity (log x): each policy, LRU and Belady over the same bytes, infinite."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = summary["points"]
    x = [p["tokens"] / 1e6 for p in pts]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for pol, style in zip(summary["policies"], ("s-", "^-", "o-", "v-", "d-")):
        ax.plot(x, [100 * p["results"][pol]["block_hit_rate"] for p in pts], style, label=f"hiradix {pol}")
    ax.plot(x, [100 * p["lru_blocks"] for p in pts], "x--", color="gray", label="LRU, one pool (offline replay)")
    ax.plot(x, [100 * p["belady"] for p in pts], "k*-", label="Belady, one pool (offline optimum)")
    ax.axhline(100 * summary["infinite"]["block_hit_rate"], color="k", ls=":", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity, DRAM + NVMe (M tokens)")
    ax.set_ylabel("hit rate (% of 512-token blocks)")
    ax.set_title("Trace replay: hit rate vs capacity")
    ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(summary: dict, out_dir: Path, policy: str) -> str:
    """sweep.json, sweep.png; returns the printable tables."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary["targets"] = targets(summary, policy)
    (out_dir / "sweep.json").write_text(json.dumps(summary, indent=2))
    plot_sweep(summary, out_dir / "sweep.png")
    return format_sweep(summary) + "\n\ntargets (" + policy + "):\n" + format_targets(summary["targets"])


def sweep_main(args, cfg, trace: Sequence) -> int:
    """``simulate.py --sweep``: run, print the sweep and targets tables, write JSON + PNG; returns 0."""
    policies = args.policies.split(",")
    worth = args.worth_policy or None
    fractions = [float(f) for f in args.fractions.split(",")]
    summary = run_sweep(trace, cfg, policies, worth, fractions, args.dram_share, args.jobs)
    summary["trace"] = str(args.trace)
    out_dir = args.out_dir or Path("runs") / time.strftime("sweep-%Y%m%d-%H%M%S")
    print(write_outputs(summary, out_dir, worth or policies[-1]))
    print(f"{len(trace)} requests, {len(fractions)} points x {len(policies) + bool(worth)} scenarios on {args.jobs} "
          f"processes: {summary['wall_s']:.1f} s (slowest scenario {summary['max_scenario_wall_s']:.1f} s); "
          f"wrote {out_dir / 'sweep.json'} and {out_dir / 'sweep.png'}")
    return 0
