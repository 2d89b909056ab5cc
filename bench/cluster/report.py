"""Figures, table, targets, plots and files of `bench.cluster.run` (records in, report out).

Per (system, routing) cell, over all its repeats (tokens summed over requests):
    hit tokens by tier: `device` (HBM), `host` (DRAM), and the storage hits split by
        `storage_backend` into `nvme` (hiradix's local NVMe) and `store` (the cluster store:
        hiradix's `mooncake=N`, HiCache's `MooncakeStore`), each as a share of prompt tokens;
    `ideal`: the hits of one infinite shared cache (`bench.cluster.run.ideal_cached_tokens`);
    prefill tokens computed: prompt - cached;
    TTFT of turns >= 2 (1-based; `turn_index >= 1`): median, 95% bootstrap interval (2,000
        resamples of the requests, seeded), and the ratio of medians to stock of the same
        routing (the A/A cell to stock sticky) with a bootstrap interval;
    outputs token-identical to stock sticky (per request, matched by session and turn).
Targets (issue 11; reported, not asserted): with random routing hiradix's hit tokens >= 90% of
sticky routing's, and above HiCache + Mooncake's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from bench.ab.run import identical_fraction
from bench.common.multiturn import write_records
from bench.common.stats import bootstrap_ci, ratio_ci

TIERS = ("device", "host", "nvme", "store")
SYSTEM_COLORS = {"stock": "tab:gray", "stock-aa": "silver", "hicache": "tab:orange", "hiradix": "tab:blue"}
TARGET_RANDOM_OF_STICKY = 0.90
_PAIR = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*=\s*(\d+)\s*$")


def split_storage(storage_tokens: Optional[int], label: Optional[str]) -> tuple[Optional[int], Optional[int]]:
    """Split a request's `storage` hits into (NVMe tokens, cluster-store tokens).

    `label` is `cached_tokens_details.storage_backend`: hiradix gives tokens per source
    (`"nvme=32,mooncake=240"`: `nvme` is local, any other name a store); SGLang HiCache names its
    one L3 backend (`"MooncakeStore"`: all of `storage_tokens`). No label: all to the store.

    Returns:
        (None, None) when the request reported no `storage` figure.
    """
    if storage_tokens is None:
        return None, None
    pairs = [_PAIR.match(part) for part in (label or "").split(",")] if label and "=" in label else []
    if pairs and all(pairs):
        nvme = sum(int(m.group(2)) for m in pairs if m.group(1).lower() == "nvme")
        return nvme, sum(int(m.group(2)) for m in pairs) - nvme
    if label and "nvme" in label.lower():
        return storage_tokens, 0
    return 0, storage_tokens


def _later_ttfts(records) -> list[float]:
    return [r.ttft_s for r in records if r.ok and r.turn_index >= 1 and r.ttft_s is not None]


def _sum(records, field: str) -> int:
    return sum(getattr(r, field) or 0 for r in records)


def cell_summary(system: str, routing: str, runs: Sequence, baseline_by_repeat: dict, stock_ttfts: list[float]) -> dict:
    """Figures of one (system, routing) over its runs (`bench.cluster.run.CellRun`s)."""
    records = [r for run in runs for r in run.records]
    ok = [r for r in records if r.ok]
    prompt = _sum(ok, "prompt_tokens")
    cached = _sum(ok, "cached_tokens")
    tiers = {"device": _sum(ok, "cached_device_tokens"), "host": _sum(ok, "cached_host_tokens"),
             "nvme": _sum(ok, "cached_nvme_tokens"), "store": _sum(ok, "cached_store_tokens")}  # fmt: skip
    ideal = _sum(ok, "ideal_cached_tokens")
    ttfts = _later_ttfts(records)
    ratio, ratio_lo, ratio_hi = ratio_ci(ttfts, stock_ttfts)
    lo, hi = bootstrap_ci(ttfts)
    same = compared = 0
    for run in runs:
        base = baseline_by_repeat.get(run.cell.repeat) or next(iter(baseline_by_repeat.values()), None)
        if base is not None:
            s, c = identical_fraction(base, run.records)
            same, compared = same + s, compared + c
    share = (lambda n: n / prompt) if prompt else (lambda n: math.nan)
    return {
        "system": system, "routing": routing, "repeats": len(runs), "requests": len(records),
        "errors": len(records) - len(ok), "prompt_tokens": prompt, "cached_tokens": cached,
        "tier_tokens": tiers, "ideal_cached_tokens": ideal,
        "hit_share": share(cached), "tier_share": {t: share(n) for t, n in tiers.items()},
        "ideal_share": share(ideal), "hit_of_ideal": cached / ideal if ideal else math.nan,
        "prefill_tokens": prompt - cached,
        "ttft_n": len(ttfts), "ttft_median_s": statistics.median(ttfts) if ttfts else math.nan,
        "ttft_ci_s": [lo, hi], "ttft_ratio_to_stock": ratio, "ttft_ratio_ci": [ratio_lo, ratio_hi],
        "identical_to_stock_sticky": [same, compared],
        "startup_s": [s for run in runs for s in run.startup_s], "workload_s": sum(run.workload_s for run in runs),
        "store_keys": [run.store_keys for run in runs],
    }  # fmt: skip


def build_report(runs: Sequence) -> dict:
    """Cells (in system, routing order of first appearance) and targets of a run."""
    keys: list[tuple[str, str]] = []
    for run in runs:
        if (run.cell.system, run.cell.routing) not in keys:
            keys.append((run.cell.system, run.cell.routing))
    by_key = {k: [run for run in runs if (run.cell.system, run.cell.routing) == k] for k in keys}
    baseline = {run.cell.repeat: run.records for run in by_key.get(("stock", "sticky"), [])}

    def stock_ttfts(system: str, routing: str) -> list[float]:
        ref = ("stock", "sticky") if system == "stock-aa" else ("stock", routing)
        return _later_ttfts([r for run in by_key.get(ref, []) for r in run.records])

    order = {"stock-aa": -1, "stock": 0, "hicache": 1, "hiradix": 2}
    routing_order = {"round-robin": 0, "random": 1, "sticky": 2}
    keys.sort(key=lambda k: (routing_order.get(k[1], 9), order.get(k[0], 9)))
    cells = [cell_summary(s, r, by_key[(s, r)], baseline, stock_ttfts(s, r)) for s, r in keys]
    return {"cells": cells, "targets": evaluate_targets(cells)}


def evaluate_targets(cells: Sequence[dict]) -> list[dict]:
    """The issue's two targets where the run has the cells for them (met: True/False)."""
    by = {(c["system"], c["routing"]): c for c in cells}
    out = []
    rand, sticky, hicache = by.get(("hiradix", "random")), by.get(("hiradix", "sticky")), by.get(("hicache", "random"))
    if rand and sticky:
        ratio = rand["cached_tokens"] / sticky["cached_tokens"] if sticky["cached_tokens"] else math.nan
        out.append({"target": f"hiradix hit tokens, random >= {TARGET_RANDOM_OF_STICKY:.0%} of sticky",
                    "measured": f"{rand['cached_tokens']} / {sticky['cached_tokens']} = {ratio:.3f}",
                    "value": ratio, "met": bool(ratio >= TARGET_RANDOM_OF_STICKY)})  # fmt: skip
    if rand and hicache:
        out.append({"target": "hiradix hit tokens > HiCache + Mooncake's, random routing",
                    "measured": f"{rand['cached_tokens']} vs {hicache['cached_tokens']}",
                    "value": rand["cached_tokens"] - hicache["cached_tokens"],
                    "met": bool(rand["cached_tokens"] > hicache["cached_tokens"])})  # fmt: skip
    return out


def _pct(x: float) -> str:
    return "    -" if math.isnan(x) else f"{100 * x:5.1f}"


def format_report(report: dict) -> str:
    """The table printed at the end of a run, then the targets."""
    head = (f"{'system':<9} {'routing':<11} {'req':>4} {'hit%':>5} {'ideal%':>6} {'dev%':>5} {'host%':>5} "
            f"{'nvme%':>5} {'store%':>6} {'prefill_tok':>11} {'ttft_ms turns>=2 [95% CI]':>27} "
            f"{'/stock [95% CI]':>19} {'identical':>9}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for c in report["cells"]:
        ms = c["ttft_median_s"] * 1e3
        lo, hi = (v * 1e3 for v in c["ttft_ci_s"])
        ratio = c["ttft_ratio_to_stock"]
        rlo, rhi = c["ttft_ratio_ci"]
        same, compared = c["identical_to_stock_sticky"]
        ttft = f"{ms:7.0f} [{lo:6.0f}-{hi:6.0f}]" if not math.isnan(ms) else "-"
        rel = f"{ratio:5.2f} [{rlo:4.2f}-{rhi:4.2f}]" if not math.isnan(ratio) else "-"
        share = c["tier_share"]
        lines.append(f"{c['system']:<9} {c['routing']:<11} {c['requests']:>4} {_pct(c['hit_share'])} "
                     f"{_pct(c['ideal_share']):>6} {_pct(share['device'])} {_pct(share['host'])} "
                     f"{_pct(share['nvme'])} {_pct(share['store']):>6} {c['prefill_tokens']:>11} {ttft:>27} "
                     f"{rel:>19} {f'{same}/{compared}':>9}")  # fmt: skip
    lines.append("hit% = cached / prompt tokens (all turns); ideal% = one infinite cache shared by both servers; "
                 "dev/host/nvme/store = where the hits came from; prefill_tok = prompt - cached tokens; "
                 "/stock = TTFT ratio of medians to stock with the same routing (stock-aa: to stock sticky, the A/A); "
                 "identical = greedy outputs token-identical to stock sticky")  # fmt: skip
    errors = sum(c["errors"] for c in report["cells"])
    if errors:
        lines.append(f"FAILED REQUESTS: {errors} (see records.json)")
    for t in report["targets"]:
        lines.append(f"target: {t['target']}: {t['measured']} -> {'MET' if t['met'] else 'MISSED'}")
    return "\n".join(lines)


def _label(c: dict) -> str:
    return f"{c['system']}\n{c['routing']}"


def plot_hits(report: dict, png_path: Path) -> None:
    """PNG: hit share by tier (stacked) with the ideal marked, and prefill tokens, per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    x = np.arange(len(cells))
    fig, (ax_hit, ax_prefill) = plt.subplots(1, 2, figsize=(max(10, 1.6 * len(cells)), 4.5))
    bottom = np.zeros(len(cells))
    for tier in TIERS:
        vals = np.array([100 * c["tier_share"][tier] for c in cells])
        ax_hit.bar(x, vals, bottom=bottom, label=tier)
        bottom += vals
    ax_hit.scatter(x, [100 * c["ideal_share"] for c in cells], marker="_", s=600, color="black", label="ideal", zorder=3)
    ax_hit.set(ylabel="hit tokens, % of prompt tokens", title="Prefix-cache hits by tier (2 servers)")
    ax_prefill.bar(x, [c["prefill_tokens"] for c in cells], color="tab:gray")
    ax_prefill.set(ylabel="prefill tokens computed (prompt - cached)", title="Prefill work left")
    for ax in (ax_hit, ax_prefill):
        ax.set_xticks(x, [_label(c) for c in cells], fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    ax_hit.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def plot_ttft(report: dict, png_path: Path) -> None:
    """PNG: median TTFT of turns >= 2 with 95% intervals, and its ratio to stock, per cell."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    x = np.arange(len(cells))
    fig, (ax_ttft, ax_ratio) = plt.subplots(1, 2, figsize=(max(10, 1.6 * len(cells)), 4.5))
    panels = ((ax_ttft, "ttft_median_s", "ttft_ci_s", 1e3, "median TTFT, turns >= 2 (ms)"),
              (ax_ratio, "ttft_ratio_to_stock", "ttft_ratio_ci", 1.0, "TTFT / stock, same routing"))
    for ax, key, ci_key, scale, title in panels:
        mid = np.array([c[key] * scale for c in cells])
        lo = np.array([c[ci_key][0] * scale for c in cells])
        hi = np.array([c[ci_key][1] * scale for c in cells])
        colors = [SYSTEM_COLORS.get(c["system"], "tab:purple") for c in cells]
        ax.bar(x, mid, yerr=np.nan_to_num(np.vstack([mid - lo, hi - mid])), capsize=4, color=colors, alpha=0.85)
        ax.set(title=title + " (whiskers: 95% bootstrap)")
        ax.set_xticks(x, [_label(c) for c in cells], fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    ax_ratio.axhline(1.0, color="black", linewidth=0.8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def write_outputs(runs: Sequence, report: dict, run_dir: Path, config: dict) -> None:
    """records.json/.csv (every request), summary.json, config.json and the two PNGs."""
    write_records([r for run in runs for r in run.records], run_dir / "records.json", run_dir / "records.csv")
    cells_run = [{**dataclasses.asdict(run.cell), "startup_s": run.startup_s, "workload_s": run.workload_s,
                  "store_keys": run.store_keys} for run in runs]  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps({**report, "cell_runs": cells_run}, indent=1))
    (run_dir / "config.json").write_text(json.dumps(config, indent=1, default=str))
    plot_hits(report, run_dir / "cluster_hits.png")
    plot_ttft(report, run_dir / "cluster_ttft.png")
