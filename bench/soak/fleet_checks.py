"""The fleet soak's resource series and the checks on them: samples over time, flat or not.

A series is judged flat by comparing the median of its first quarter with the median of its
last quarter (medians, so one sample taken during a burst does not decide): growth above the
series' bound is a violation. Series with fewer than `MIN_SAMPLES` samples are reported but not
judged (too short to say).
"""

from __future__ import annotations

import re
import statistics
from typing import Sequence

import msgspec

MIB = 1 << 20
MIN_SAMPLES = 8
GAUGE_RE = re.compile(r'^(sglang:hiradix_tier_capacity_(?:bytes|tokens))\{[^}]*tier="DRAM"[^}]*\}\s+(\S+)', re.M)


class Sample(msgspec.Struct):
    """Resources at one time; None where a process was not measured (a server restarting)."""

    t_s: float  # seconds since the load began
    rss_bytes: dict[str, int | None]  # server name -> RSS of its process tree
    fds: dict[str, int | None]  # server name -> open fds of its process tree
    router_rss_bytes: int | None
    store_objects: int  # the master's key count
    store_allocated_bytes: int


class Flatness(msgspec.Struct):
    """First- vs last-quarter medians of one series, and the verdict."""

    name: str
    samples: int
    first_quarter_median: float
    last_quarter_median: float
    growth: float
    bound: float
    judged: bool  # enough samples to judge
    ok: bool


def quarter_medians(values: Sequence[float]) -> tuple[float, float]:
    """Medians of the first and the last quarter of `values` (at least one value each).

    Raises:
        ValueError: `values` is empty.
    """
    if not values:
        raise ValueError("no values")
    quarter = max(1, len(values) // 4)
    return statistics.median(values[:quarter]), statistics.median(values[-quarter:])


def flatness(name: str, values: Sequence[float], bound: float) -> Flatness | None:
    """The verdict on one series (None if it is empty): ok when the last-quarter median exceeds
    the first-quarter median by at most `bound` (same unit as the values)."""
    if not values:
        return None
    first, last = quarter_medians(values)
    judged = len(values) >= MIN_SAMPLES
    growth = last - first
    return Flatness(name, len(values), first, last, growth, bound, judged, not judged or growth <= bound)


def flat_violations(series: Sequence[Flatness]) -> list[str]:
    """One line per series that grew beyond its bound."""
    return [f"{f.name} not flat: first-quarter median {f.first_quarter_median:,.0f}, last-quarter "
            f"{f.last_quarter_median:,.0f} (growth {f.growth:,.0f} > bound {f.bound:,.0f})"
            for f in series if not f.ok]  # fmt: skip


def page_bytes(metrics_text: str, page_tokens: int) -> float | None:
    """Bytes of one KV page (one store object), from a hiradix server's DRAM tier gauges
    (`sglang:hiradix_tier_capacity_bytes / _tokens`, summed over ranks); None if absent."""
    found: dict[str, float] = {}
    for name, value in GAUGE_RE.findall(metrics_text):
        found[name] = found.get(name, 0.0) + float(value)
    tokens, size = found.get("sglang:hiradix_tier_capacity_tokens"), found.get("sglang:hiradix_tier_capacity_bytes")
    return size / tokens * page_tokens if tokens and size else None
