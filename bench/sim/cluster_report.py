"""Table and figure of the cluster simulator (``bench/sim/cluster.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def format_table(results: Sequence[dict], infinite: dict) -> str:
    """Plain-text table: one row per cluster, then the infinite cache's hit share."""
    head = (f"{'cluster':<24}{'hit %':>7}{'store %':>8}{'imbal':>7}{'queue mean s':>13}{'p99 s':>8}"
            f"{'saved %':>8}{'recomp %':>9}{'wall s':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        w = r["queue_wait_s"]
        recomputed = r["recomputed_hit_tokens"] / max(r["prompt_tokens"], 1)
        lines.append(f"{r['scenario']:<24}{100 * r['hit_rate']:>7.1f}{100 * r['store_hit_rate']:>8.1f}"
                     f"{r['imbalance']:>7.2f}{w['mean']:>13.2f}{w['p99']:>8.2f}{100 * r['time_saved']:>8.1f}"
                     f"{100 * recomputed:>9.1f}{r['wall_s']:>8.1f}")
    lines.append(f"{'infinite (one cache)':<24}{100 * infinite['token_hit_rate']:>7.1f}")
    lines.append("hit %: cached tokens used / prompt tokens; store %: of prompt tokens, read from the store; imbal: "
                 "max / mean requests per server; queue: arrival -> admission; saved %: prefill time saved vs no "
                 "cache (cost model); recomp %: of prompt tokens, cached but recomputed (reading was slower).")
    return "\n".join(lines)


def plot(results: Sequence[dict], infinite: dict, path: Path) -> None:
    """Hit share (local tiers vs store) and time saved per cluster; p99 queueing delay and imbalance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["scenario"] for r in results]
    x = range(len(names))
    store = [100 * r["store_hit_rate"] for r in results]
    local = [100 * r["hit_rate"] - s for r, s in zip(results, store)]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(max(10, 0.4 * len(names)), 8), sharex=True)
    ax.bar(x, local, label="local tiers (HBM, DRAM, NVMe)", color="tab:blue")
    ax.bar(x, store, bottom=local, label="cluster store", color="tab:orange")
    ax.plot(x, [100 * r["time_saved"] for r in results], "k^", label="prefill time saved vs no cache")
    ax.axhline(100 * infinite["token_hit_rate"], color="k", ls="--", lw=0.8, label="infinite cache (one server)")
    ax.set_ylabel("% of prompt tokens / of prefill time")
    ax.set_title("Mooncake conversation trace on N servers behind SMG router policies")
    ax.legend(fontsize="small")
    bx.bar(x, [r["queue_wait_s"]["p99"] for r in results], color="tab:red", label="p99 queueing delay (s)")
    bx.set_ylabel("p99 queueing delay (s)")
    bx.set_yscale("symlog", linthresh=0.1)
    tx = bx.twinx()
    imbalance = [r["imbalance"] for r in results]
    tx.plot(x, imbalance, "ko", label="imbalance (max / mean requests)")
    tx.set_ylim(0.98, max(imbalance) + 0.25 * (max(imbalance) - 0.98) + 0.01)
    tx.set_ylabel("imbalance")
    bx.set_xticks(list(x), names, rotation=60, ha="right", fontsize="small")
    bx.legend(loc="upper left", fontsize="small")
    tx.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
