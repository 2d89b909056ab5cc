"""Tables and plots of the trace simulator's scenario run (``bench/sim/simulate.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

TIERS = ("hbm", "dram", "nvme")


def format_table(results: Sequence[dict], infinite: dict) -> str:
    """Plain-text table: one row per scenario plus the infinite cache."""
    head = (
        f"{'scenario':<16}{'hit %':>7}{'block %':>8}{'% of inf':>9}{'HBM %':>7}{'DRAM %':>7}{'NVMe %':>7}"
        f"{'DRAM@1st %':>11}{'ready %':>8}{'NVMe wait ms':>13}{'unready %':>10}{'queue p50 s':>12}{'p99 s':>7}"
    )
    lines = [head, "-" * len(head)]
    inf_tok = infinite["token_hit_rate"]
    for r in results:
        s, w = r["hit_share"], r["queue_wait_s"]
        lines.append(
            f"{r['scenario']:<16}{100 * r['hit_rate']:>7.1f}{100 * r['block_hit_rate']:>8.1f}"
            f"{100 * r['hit_rate'] / inf_tok:>9.1f}{100 * s['hbm']:>7.1f}{100 * s['dram']:>7.1f}{100 * s['nvme']:>7.1f}"
            f"{100 * r['strict_dram_share']:>11.1f}{100 * r['ready_share']:>8.1f}{r['nvme_wait_s']['per_request_ms']:>13.1f}"
            f"{100 * r['nvme_unready_share']:>10.2f}{w['p50']:>12.2f}{w['p99']:>7.2f}"
        )
    lines.append(f"{'infinite':<16}{100 * inf_tok:>7.1f}{100 * infinite['block_hit_rate']:>8.1f}{100.0:>9.1f}")
    lines += [
        "hit %: hit tokens / prompt tokens; block %: per 512-token block; % of inf: hit % / infinite hit %.",
        "HBM/DRAM/NVMe %: share of hit tokens by where hiradix served them (pages read up from NVMe count as NVMe,",
        "read ahead or on demand); DRAM@1st %: share already in DRAM when the request was first tried;",
        "ready %: share already in HBM or DRAM then (served without waiting); NVMe wait ms: time requests were",
        "held back for NVMe reads, per request; unready %: prompt tokens matched on NVMe but admitted unread",
        "(recomputed); queue: arrival -> admission.",
    ]
    return "\n".join(lines)


def plot(results: Sequence[dict], infinite: dict, path: Path) -> None:
    """Stacked bars: hit rate per scenario split by serving tier; a line at infinite."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["scenario"] for r in results]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = np.zeros(len(results))
    for tier, color in zip(TIERS, ("tab:green", "tab:blue", "tab:orange")):
        vals = np.array([100 * r["hit_tokens"][tier] / r["prompt_tokens"] for r in results])
        ax.bar(names, vals, bottom=bottom, label=f"from {tier.upper().replace('NVME', 'NVMe')}", color=color)
        bottom += vals
    ax.axhline(100 * infinite["token_hit_rate"], color="k", ls="--", label="infinite cache")
    ax.set_ylim(0, 130 * infinite["token_hit_rate"])
    ax.set_ylabel("hit rate (% of prompt tokens)")
    ax.set_title("Trace replay: prefix-cache hit rate, split by the tier that served it")
    ax.legend(loc="upper left", ncol=4, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
