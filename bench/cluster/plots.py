"""PNGs of `bench.cluster.run` (from `bench.cluster.report.build_report`'s dict):

    cluster_hits.png       hit share by tier (stacked: HBM, DRAM, NVMe, store) per system, the ideal marked
    cluster_ttft.png       TTFT of turns >= 2, p50 and p99 per system with 95% bootstrap whiskers
    cluster_imbalance.png  requests per server (router counts) and max/mean per system
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.cluster.report import TARGET_IMBALANCE, TIERS

TIER_LABELS = {"device": "HBM", "host": "DRAM", "nvme": "NVMe", "store": "store"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _labels(report: dict) -> list[str]:
    return [s["system"].replace(":", "\n") for s in report["systems"]]


def plot_hits(report: dict, png_path: Path) -> None:
    plt = _pyplot()
    systems = report["systems"]
    x = np.arange(len(systems))
    fig, ax = plt.subplots(figsize=(max(7, 1.4 * len(systems)), 4.5))
    bottom = np.zeros(len(systems))
    for tier in TIERS:
        vals = np.nan_to_num(np.array([100 * s["tier_share"][tier] for s in systems]))
        ax.bar(x, vals, bottom=bottom, label=TIER_LABELS[tier])
        bottom += vals
    unsplit = np.array([100 * s["hit_share"] if np.isnan(s["tier_share"]["device"]) else 0.0 for s in systems])
    if unsplit.any():  # smg's gRPC mode reports cached tokens without their tiers
        ax.bar(x, unsplit, bottom=bottom, color="grey", label="tier not reported")
    ax.scatter(x, [100 * s["ideal_share"] for s in systems], marker="_", s=700, color="black", label="ideal", zorder=3)
    ax.set(ylabel="hit tokens, % of prompt tokens", title="Prefix-cache hits by tier, behind SGLang's router")
    ax.set_xticks(x, _labels(report), fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def plot_ttft(report: dict, png_path: Path) -> None:
    plt = _pyplot()
    systems = report["systems"]
    x = np.arange(len(systems))
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 2.4 * len(systems)), 4.5))
    for ax, key in zip(axes, ("p50", "p99")):
        mid = np.array([s["ttft_later"][key]["s"] * 1e3 for s in systems])
        lo = np.array([s["ttft_later"][key]["ci_s"][0] * 1e3 for s in systems])
        hi = np.array([s["ttft_later"][key]["ci_s"][1] * 1e3 for s in systems])
        ax.bar(x, mid, yerr=np.nan_to_num(np.vstack([mid - lo, hi - mid])), capsize=4, color="tab:blue", alpha=0.8)
        ax.set(title=f"TTFT {key}, turns >= 2 (ms; whiskers: 95% bootstrap)")
        ax.set_xticks(x, _labels(report), fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def plot_imbalance(report: dict, png_path: Path) -> None:
    plt = _pyplot()
    systems = report["systems"]
    x = np.arange(len(systems))
    n = max(len(s["server_requests"]) for s in systems)
    width = 0.8 / n
    fig, (ax_req, ax_imb) = plt.subplots(1, 2, figsize=(max(10, 2.4 * len(systems)), 4.5))
    for i in range(n):
        ax_req.bar(x - 0.4 + width * (i + 0.5), [s["server_requests"][i] if i < len(s["server_requests"]) else 0
                                                 for s in systems], width, label=f"server {i}")  # fmt: skip
    ax_req.set(ylabel="requests (router's smg_worker_requests_total)", title="Requests per server")
    ax_req.legend(fontsize=8)
    ax_imb.bar(x, [s["imbalance"] for s in systems], color="tab:gray")
    ax_imb.axhline(TARGET_IMBALANCE, color="tab:red", linewidth=1, label=f"target {TARGET_IMBALANCE}")
    ax_imb.set(ylabel="max / mean requests per server", title="Imbalance")
    ax_imb.legend(fontsize=8)
    for ax in (ax_req, ax_imb):
        ax.set_xticks(x, _labels(report), fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def plot_all(report: dict, run_dir: Path) -> None:
    """Write the three PNGs into `run_dir`."""
    plot_hits(report, run_dir / "cluster_hits.png")
    plot_ttft(report, run_dir / "cluster_ttft.png")
    plot_imbalance(report, run_dir / "cluster_imbalance.png")
