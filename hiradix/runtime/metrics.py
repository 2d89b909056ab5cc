"""Prometheus metrics of the hiradix tiers (prometheus_client; SGLang's multiprocess registry).

Hits per tier are already exported by SGLang itself from the per-request fields hiradix fills
(``sglang:cached_tokens_total{cache_source="device"|"host"|"storage"}`` = HBM / DRAM / NVMe;
``observability/metrics_collector.py``). This module adds what only hiradix knows, read from
:class:`hiradix.core.stats.TierStats`, the books and the look-ahead view once per scheduler step
(counters advance by the delta since the last step):

* ``hiradix_moved_bytes_total{kind}``            BACKUP, PROMOTE, DEMOTE, PREFETCH bytes that landed
* ``hiradix_failed_transfers_total{kind}``       transfers with at least one failed page
* ``hiradix_prefetch_tokens_total{outcome}``     started, completed, failed, used, wasted
* ``hiradix_read_ahead_tokens_total{outcome}``   reads for predicted returns: started, used, wasted
* ``hiradix_dropped_tokens_total{tier}``         tokens that left their last tier (lost)
* ``hiradix_admission_skips_total``              requests skipped while their prefetch ran
* ``hiradix_tier_tokens{tier}``                  tokens held per tier (gauge)
* ``hiradix_lookahead_window_requests``, ``hiradix_prefetch_window_requests``,
  ``hiradix_protected_nodes``                    the last look-ahead view (gauges)
* ``hiradix_store_pages_total{op}``              cluster store: lookup (asked), found, put, put_failed,
                                                 get, get_failed pages; used_tokens promoted
* ``hiradix_store_up``                           1 while the cluster store is in use (gauge)
* ``hiradix_store_switch_offs_total``            times the store was switched off after failures

Create the exporter in the scheduler process only (SGLang sets ``PROMETHEUS_MULTIPROC_DIR``
before spawning it, so the HTTP server's ``/metrics`` aggregates these).
"""

from __future__ import annotations

import collections

from typing import Any, Optional

TIERS = ("HBM", "DRAM", "NVMe", "store")


class TierMetrics:
    """Exports hiradix counters and gauges; call :meth:`update` once per scheduler step.

    Args:
        labels: constant labels (e.g. ``{"tp_rank": "0"}``).
    """

    def __init__(self, labels: dict[str, str]):
        from prometheus_client import Counter, Gauge

        names = list(labels)
        self.labels = labels
        self._seen: dict[tuple, float] = {}
        self.moved = Counter("hiradix_moved_bytes_total", "Bytes moved between tiers", names + ["kind"])
        self.failed = Counter("hiradix_failed_transfers_total", "Transfers with a failed page", names + ["kind"])
        self.prefetch = Counter("hiradix_prefetch_tokens_total", "NVMe->DRAM prefetch tokens by outcome", names + ["outcome"])
        self.read_ahead = Counter("hiradix_read_ahead_tokens_total", "Reads for predicted returns by outcome",
                                  names + ["outcome"])
        self.dropped = Counter("hiradix_dropped_tokens_total", "Tokens that left their last tier", names + ["tier"])
        self.skips = Counter("hiradix_admission_skips_total", "Admissions skipped for a pending prefetch", names)
        gauge = dict(multiprocess_mode="mostrecent")
        self.tier_tokens = Gauge("hiradix_tier_tokens", "Tokens held per tier", names + ["tier"], **gauge)
        self.window = Gauge("hiradix_lookahead_window_requests", "Requests in the look-ahead window", names, **gauge)
        self.prefetch_window = Gauge("hiradix_prefetch_window_requests", "Prefetch window L_pw", names, **gauge)
        self.protected = Gauge("hiradix_protected_nodes", "Nodes needed by queued requests", names, **gauge)
        self.in_flight = Gauge("hiradix_transfers_in_flight", "Transfers in flight by kind", names + ["kind"], **gauge)
        self.restored = Gauge("hiradix_nvme_restored_pages", "NVMe pages re-indexed at start", names, **gauge)
        self.store_pages = Counter("hiradix_store_pages_total", "Cluster-store pages by operation", names + ["op"])
        self.store_up = Gauge("hiradix_store_up", "1 while the cluster store is in use", names, **gauge)
        self.store_offs = Counter("hiradix_store_switch_offs_total", "Cluster-store switch-offs after failures", names)

    def _advance(self, counter: Any, key: tuple, total: float, **extra: str) -> None:
        delta = total - self._seen.get(key, 0)
        if delta > 0:
            counter.labels(**self.labels, **extra).inc(delta)
        self._seen[key] = total

    def update(self, stats: Any, books: Any, tier_tokens: list[int], view: Optional[Any], store: Optional[Any] = None) -> None:
        """Advance counters to the cumulative values in ``stats``/``books``/``store``; set gauges."""
        if store is not None:
            self._update_store(store, stats)
        for kind, value in stats.bytes_moved.items():
            self._advance(self.moved, ("moved", kind), value, kind=kind)
        for kind, value in stats.transfers_failed.items():
            self._advance(self.failed, ("failed", kind), value, kind=kind)
        prefetch = dict(stats.prefetch_tokens, wasted=books.wasted_prefetch_tokens)
        for outcome, value in prefetch.items():
            self._advance(self.prefetch, ("prefetch", outcome), value, outcome=outcome)
        for outcome, value in stats.read_ahead_tokens.items():
            self._advance(self.read_ahead, ("read_ahead", outcome), value, outcome=outcome)
        for tier, value in zip(TIERS, books.dropped_tokens):
            self._advance(self.dropped, ("dropped", tier), value, tier=tier)
        self._advance(self.skips, ("skips",), stats.admission_skips)
        for tier, value in zip(TIERS, tier_tokens):
            self.tier_tokens.labels(**self.labels, tier=tier).set(value)
        in_flight = collections.Counter(op.kind.name for op in books.ops.values())
        for kind in stats.bytes_moved:
            self.in_flight.labels(**self.labels, kind=kind).set(in_flight.get(kind, 0))
        self.restored.labels(**self.labels).set(stats.restored_pages)
        if view is not None:
            self.window.labels(**self.labels).set(view.window)
            self.prefetch_window.labels(**self.labels).set(view.prefetch_window)
            self.protected.labels(**self.labels).set(view.protected_nodes)

    def _update_store(self, store: Any, stats: Any) -> None:
        counts = store.counts
        ops = {"lookup": counts["lookup_pages"], "found": counts["lookup_found_pages"], "put": counts["put_pages"],
               "put_failed": counts["put_failed_pages"], "get": counts["get_pages"], "get_failed": counts["get_failed_pages"],
               "used_tokens": stats.store_tokens["used"]}
        for op, value in ops.items():
            self._advance(self.store_pages, ("store", op), value, op=op)
        self._advance(self.store_offs, ("store_offs",), counts["switch_offs"])
        self.store_up.labels(**self.labels).set(1 if store.enabled else 0)
