"""The PNGs of `bench.ab.run`: paired ratios with intervals, prefill tokens, server-side TTFT.

`ab_verdict.png`, three panels: the paired TTFT ratios of turns >= 2 (median, whiskers = 95%
bootstrap interval, a line at 1.0; log scale), the prefill tokens computed per system (bars from
the responses, a marker from `/metrics`), and the cumulative server-side TTFT histogram per
system. `ttft_by_turn.png`: median TTFT and mean cached tokens per turn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_verdict(runs: Sequence, result: dict, png_path: Path) -> None:
    """Write `ab_verdict.png` (see the module docstring) from `ab_report.summary`'s `result`."""
    plt = _pyplot()
    fig, (ax_ratio, ax_prefill, ax_hist) = plt.subplots(1, 3, figsize=(15, 4.5))
    comps = result["comparisons"]
    x = np.arange(len(comps))
    mid = np.array([c["median"] for c in comps], dtype=float)
    lo = np.array([c["ci"][0] for c in comps], dtype=float)
    hi = np.array([c["ci"][1] for c in comps], dtype=float)
    colors = ["silver" if c["kind"] == "aa" else "tab:green" if c["kind"] == "vs-ideal"
              else "tab:orange" if c["kind"] == "vs-hicache" else "tab:blue" for c in comps]
    for i in range(len(comps)):
        if np.isfinite(mid[i]):
            ax_ratio.errorbar([x[i]], [mid[i]], yerr=[[mid[i] - lo[i]], [hi[i] - mid[i]]], fmt="o", color=colors[i],
                              capsize=6, markersize=8)
    if len(comps) and np.isfinite(mid).any():
        ax_ratio.set_yscale("log")
    ax_ratio.axhline(1.0, color="black", linewidth=0.8)
    ax_ratio.set_xticks(x, [f"{c['a']}\n/{c['b']}" for c in comps], fontsize=8)
    ax_ratio.set(title="paired TTFT ratio, turns >= 2\n(median, 95% bootstrap CI; grey = A/A)", ylabel="ratio (log)")
    names = [run.system.name for run in runs]
    figures = result["systems"]
    xs = np.arange(len(names))
    ax_prefill.bar(xs, [figures[n]["prefill_tokens"] for n in names], color="tab:gray", label="responses")
    metric_vals = [figures[n]["prefill_tokens_metrics"] for n in names]
    ax_prefill.scatter(xs, [np.nan if v is None else v for v in metric_vals], color="black", marker="_", s=500,
                       label="/metrics", zorder=3)
    ax_prefill.set_xticks(xs, names, fontsize=8)
    ax_prefill.set(title="prefill tokens computed (prompt - cached)", ylabel="tokens")
    ax_prefill.legend(fontsize=8)
    for n in names:
        buckets = {float(k): v for k, v in figures[n]["ttft_buckets"].items()}
        finite = sorted(k for k in buckets if np.isfinite(k))
        total = buckets.get(float("inf")) or (buckets[finite[-1]] if finite else 0)
        if finite and total:
            ax_hist.step(finite, [buckets[k] / total for k in finite], where="post", label=n)
    ax_hist.set_xscale("log")
    ax_hist.set(title="server-side TTFT (SGLang histogram, all turns)", xlabel="TTFT (s, bucket bound)",
                ylabel="share of requests <= bound")
    if ax_hist.lines:
        ax_hist.legend(fontsize=8)
    else:
        ax_hist.text(0.5, 0.5, "no TTFT histogram in /metrics", ha="center", transform=ax_hist.transAxes)
    for ax in (ax_ratio, ax_prefill, ax_hist):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def plot_ttft_by_turn(rows: Sequence[dict], names: Sequence[str], png_path: Path) -> None:
    """Write `ttft_by_turn.png`: median TTFT (ms, log axis) and mean cached tokens per turn."""
    plt = _pyplot()
    turns = [row["turn_index"] for row in rows]
    fig, (ax_ttft, ax_cached) = plt.subplots(1, 2, figsize=(10, 4))
    for name in names:
        ax_ttft.plot(turns, [row[name]["median_ttft_s"] * 1e3 for row in rows], marker="o", label=name)
        ax_cached.plot(turns, [row[name]["mean_cached_tokens"] for row in rows], marker="o", label=name)
    ax_ttft.set_yscale("log")
    ax_ttft.set(xlabel="turn index", ylabel="median TTFT (ms, log scale)", title="TTFT by turn (log scale)")
    ax_cached.set(xlabel="turn index", ylabel="mean cached tokens", title="Prefix-cache hits by turn")
    for ax in (ax_ttft, ax_cached):
        ax.set_xticks(turns)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def plot_open_loop(open_loop: dict, png_path: Path) -> None:
    """Write `open_loop.png` from `summary.json`'s `open_loop`: per system, TTFT mean/p50/p90/p99
    of turns >= 2 (bars), and the mean TTFT split per request (queue time, prefill forward, the
    rest; stacked)."""
    plt = _pyplot()
    fig, (ax_ttft, ax_split) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(open_loop["systems"])
    x = np.arange(len(names))
    stats = ("mean", "p50", "p90", "p99")
    width = 0.8 / len(stats)
    for k, stat in enumerate(stats):
        values = [open_loop["systems"][n]["ttft_s"][stat] * 1000 for n in names]
        ax_ttft.bar(x + (k - 1.5) * width, values, width, label=stat)
    ax_ttft.set_xticks(x, names)
    ax_ttft.set_ylabel("TTFT, turns >= 2 (ms)")
    ax_ttft.set_title(f"open loop, {open_loop['rate_per_s']:g} requests/s, <= {open_loop['max_in_flight']} in flight")
    ax_ttft.legend()
    bottom = np.zeros(len(names))
    for part, label in (("queue_s", "queue (SGLang)"), ("prefill_forward_s", "prefill forward"), ("rest_s", "rest")):
        values = np.array([(open_loop["systems"][n]["split"] or {}).get(part, np.nan) * 1000 for n in names])
        values = np.nan_to_num(values)
        ax_split.bar(x, values, 0.6, bottom=bottom, label=label)
        bottom += values
    ax_split.set_xticks(x, names)
    ax_split.set_ylabel("mean per request, all turns (ms)")
    ax_split.set_title("where a request's TTFT goes")
    ax_split.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
