"""TTFT per phase of the fleet soak: the routed (hiradix fleet) and stock answers' time to first
token between the soak's events (a holder restart, a server restart), as median and p99.

A phase runs from one event's start to the next (the first from the load's start, the last to its
end); a turn belongs to the phase its routed request started in. Pure: samples in, rows out."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TtftSample:
    """One answered turn: when its routed request started (``time.monotonic()``) and both
    systems' TTFT in seconds (None where a stream carried no content)."""

    start_s: float
    routed_ttft_s: float | None
    stock_ttft_s: float | None


def ttft_by_phase(samples: list[TtftSample], events: list[tuple[str, float, float]], origin_s: float) -> list[dict]:
    """One row per phase: its name, bounds (seconds since ``origin_s``), turns, and the median
    and p99 TTFT in milliseconds of the routed and the stock answers.

    Args:
        samples: the answered turns.
        events: ``(name, t_s, seconds taken)`` in time order, ``t_s`` counted from ``origin_s``,
            as in the soak's report.
        origin_s: the ``time.monotonic()`` the events are counted from.
    """
    bounds = [("start", 0.0)] + [(name, t_s) for name, t_s, _ in events]
    rows = []
    for i, (name, begin_s) in enumerate(bounds):
        end_s = bounds[i + 1][1] if i + 1 < len(bounds) else math.inf
        inside = [s for s in samples if begin_s <= s.start_s - origin_s < end_s]
        row: dict = {"phase": f"from {name}", "begin_s": begin_s, "end_s": None if end_s == math.inf else end_s,
                     "turns": len(inside)}  # fmt: skip
        for system in ("routed", "stock"):
            values = [v for s in inside if (v := getattr(s, f"{system}_ttft_s")) is not None]
            for label, q in (("p50", 50), ("p99", 99)):
                row[f"{system}_{label}_ms"] = round(float(np.percentile(values, q)) * 1000, 1) if values else None
        rows.append(row)
    return rows


def phase_line(row: dict) -> str:
    """A row as one line of the soak's summary."""
    end = "end" if row["end_s"] is None else f"{row['end_s']:.0f} s"
    return (f"TTFT {row['phase']} ({row['begin_s']:.0f} s - {end}, {row['turns']} turns): fleet p50/p99 "
            f"{row['routed_p50_ms']}/{row['routed_p99_ms']} ms, stock {row['stock_p50_ms']}/{row['stock_p99_ms']} ms")
