"""The fleet soak's PNG: the sampled resources over time, with the fault events marked."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from bench.soak.fleet_checks import MIB, Sample


def plot_resources(samples: Sequence[Sample], events: Sequence[tuple[str, float]], path: Path) -> None:
    """Four panels over time (s): RSS per server tree (MiB), open fds per server tree, the
    router's RSS (MiB) and the store's object count; a dashed line per `(name, t_s)` event."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    t = [s.t_s for s in samples]
    names = sorted({name for s in samples for name in s.rss_bytes})
    for name in names:
        axes[0].plot(t, [_mib(s.rss_bytes.get(name)) for s in samples], label=name)
        axes[1].plot(t, [_num(s.fds.get(name)) for s in samples], label=name)
    axes[2].plot(t, [_mib(s.router_rss_bytes) for s in samples], color="tab:purple")
    axes[3].plot(t, [s.store_objects for s in samples], color="tab:green")
    titles = ("RSS of each server's process tree (MiB)", "open fds of each server's process tree",
              "router RSS (MiB)", "store objects (master key count)")  # fmt: skip
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        for label, at in events:
            ax.axvline(at, color="grey", linestyle="--", linewidth=0.8)
            ax.text(at, 1.0, " " + label, transform=ax.get_xaxis_transform(), fontsize=7, va="top")
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    axes[-1].set_xlabel("time since the load began (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _num(value: int | None) -> float:
    return float("nan") if value is None else float(value)


def _mib(value: int | None) -> float:
    return _num(value) / MIB
