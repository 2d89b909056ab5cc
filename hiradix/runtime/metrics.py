"""Prometheus metrics of the hiradix tiers (prometheus_client; SGLang's multiprocess registry).

Hits per tier are exported by SGLang itself from the per-request fields hiradix fills
(``sglang:cached_tokens_total{cache_source="device"|"host"|"storage"}`` = HBM / DRAM / NVMe,
``observability/metrics_collector.py``). :data:`SERIES` lists what only hiradix knows, read
from :class:`hiradix.core.stats.TierStats`, the books, the tree and the look-ahead view once per
scheduler step (counters advance by the delta since the last step).

Conventions, as SGLang's own series: the ``sglang:`` namespace, the unit last in the name
(``_tokens``, ``_bytes``, ``_requests``; counters end in ``_total``), and SGLang's radix-cache
labels (``cache_type``, ``tp_rank``, ``pp_rank``, ``dp_rank``; ``radix_cache_metric_labels``).
Every counter and gauge is created with all its label sets at construction, so each series is
exported (at 0) from the start. Gauges are ``mostrecent`` in the multiprocess registry.

Create the exporter in the scheduler process only (SGLang sets ``PROMETHEUS_MULTIPROC_DIR``
before spawning it, so the HTTP server's ``/metrics`` aggregates these).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Optional

from hiradix.core.ledger import Kind
from hiradix.core.hold_times import CAUSES as HOLD_CAUSES
from hiradix.core.stats import PREFETCH_OUTCOMES, READ_AHEAD_OUTCOMES, STORAGE_HIT_READS

TIERS = ("HBM", "DRAM", "NVMe", "store")  # label values of `tier`, fastest first (core Tier order)
HOST_TIERS = ("DRAM", "NVMe")  # the tiers whose bytes hiradix reserves on the host
KINDS = tuple(k.name for k in Kind)  # BACKUP, PROMOTE, DEMOTE, PREFETCH, PUT, GET
# the lower tier of each transfer kind (index into TIERS): its page size is what the copy moves
LOWER_TIER = {"BACKUP": 1, "PROMOTE": 1, "DEMOTE": 2, "PREFETCH": 2, "PUT": 3, "GET": 3}
# StoreTier.counts, in pages; skipped_slow: found, but recomputed (slower to read, hiradix.core.store_reads)
STORE_OPS = ("lookup", "found", "put", "put_failed", "put_retried", "get", "get_failed", "skipped_slow")
_STORE_COUNT = {"lookup": "lookup_pages", "found": "lookup_found_pages", "put": "put_pages",
                "put_failed": "put_failed_pages", "put_retried": "put_retried_pages", "get": "get_pages",
                "get_failed": "get_failed_pages"}


@dataclass(frozen=True)
class Series:
    """One exported series: name, type, its own label (name and values), help text."""

    name: str
    type: str  # "counter" | "gauge"
    help: str
    label: Optional[str] = None
    values: tuple[str, ...] = ()


SERIES: tuple[Series, ...] = (
    Series("sglang:hiradix_tier_capacity_tokens", "gauge", "Tokens each tier can hold (HBM: the device pool)", "tier", TIERS),
    Series("sglang:hiradix_tier_used_tokens", "gauge", "Tokens of cached KV the tree holds in each tier", "tier", TIERS),
    Series("sglang:hiradix_tier_capacity_bytes", "gauge", "Bytes of KV each tier can hold", "tier", TIERS),
    Series("sglang:hiradix_tier_used_bytes", "gauge", "Bytes of cached KV the tree holds in each tier", "tier", TIERS),
    Series("sglang:hiradix_reserved_bytes", "gauge",
           "Host bytes this process reserves for a tier (0 where another TP rank holds the copy it uses)", "tier",
           HOST_TIERS),
    Series("sglang:hiradix_moved_tokens_total", "counter", "Tokens moved between tiers, by transfer kind", "kind", KINDS),
    Series("sglang:hiradix_moved_bytes_total", "counter",
           "Bytes moved between tiers, by transfer kind (pages of the lower tier's size: encoded in a compressed tier)",
           "kind", KINDS),
    Series("sglang:hiradix_failed_transfers_total", "counter", "Transfers with at least one failed page", "kind", KINDS),
    Series("sglang:hiradix_transfers_in_flight", "gauge", "Transfers in flight, by kind", "kind", KINDS),
    Series("sglang:hiradix_prefetch_tokens_total", "counter", "NVMe -> DRAM reads by outcome", "outcome", PREFETCH_OUTCOMES),
    Series("sglang:hiradix_storage_hit_tokens_total", "counter",
           "NVMe hits (SGLang's storage tokens) by who started the read", "read", STORAGE_HIT_READS),
    Series("sglang:hiradix_read_ahead_tokens_total", "counter",
           "Reads for predicted returns (predictive policy) by outcome", "outcome", READ_AHEAD_OUTCOMES),
    Series("sglang:hiradix_dropped_tokens_total", "counter", "Tokens that left their last tier (lost)", "tier", TIERS),
    Series("sglang:hiradix_admission_skips_total", "counter", "Admissions skipped while the request's NVMe reads ran"),
    Series("sglang:hiradix_admission_wait_seconds_total", "counter",
           "Seconds requests were held at admission for their NVMe or store parts, by cause", "cause", HOLD_CAUSES),
    Series("sglang:hiradix_held_requests_total", "counter", "Requests admission held at least once for their reads"),
    Series("sglang:hiradix_streamed_tokens_total", "counter",
           "Tokens promoted to HBM while their request waited for the rest of a history larger than DRAM"),
    Series("sglang:hiradix_lookahead_window_requests", "gauge", "Waiting requests the look-ahead window inspected"),
    Series("sglang:hiradix_prefetch_window_requests", "gauge", "Requests whose NVMe pages may be read ahead (L_pw)"),
    Series("sglang:hiradix_protected_nodes", "gauge", "Tree nodes queued requests need (demoted last)"),
    Series("sglang:hiradix_nvme_enabled", "gauge", "1 while the NVMe tier takes copies, 0 when absent or switched off"),
    Series("sglang:hiradix_nvme_restored_pages", "gauge", "NVMe pages re-indexed from the durable index at start"),
    Series("sglang:hiradix_partial_page_tokens_total", "counter",
           "Prompt tokens served from a kept partly filled last page (--hiradix-partial-page; not computed again)"),
    Series("sglang:hiradix_nvme_durable_pages", "gauge",
           "NVMe pages the durable index lists now (what a restart would re-index)"),
    Series("sglang:hiradix_store_pages_total", "counter", "Cluster-store pages by operation", "op", STORE_OPS),
    Series("sglang:hiradix_store_used_tokens_total", "counter", "Tokens read from the cluster store and promoted to HBM"),
    Series("sglang:hiradix_store_switch_offs_total", "counter", "Times the cluster store was switched off after failures"),
    Series("sglang:hiradix_store_lookup_skips_total", "counter",
           "Store lookups not asked: tails of a length lookups (nearly) never find, recomputed faster than a "
           "lookup's round trip (--hiradix-store-read auto, TP 1)"),
    Series("sglang:hiradix_store_lookup_seconds", "gauge", "Moving estimate of a store lookup's round trip (0 before one)"),
    Series("sglang:hiradix_store_enabled", "gauge", "1 while the cluster store is in use, 0 when absent or switched off"),
    Series("sglang:hiradix_store_read_bytes_per_s", "gauge",
           "Moving estimate of the cluster store's read bandwidth into DRAM (0 before a GET)"),
    Series("sglang:hiradix_prefill_tokens_per_s", "gauge",
           "Moving estimate of the prefill rate the load-or-recompute choice uses (0 before a batch)"),
    Series("sglang:hiradix_context_truncated_tokens_total", "counter",
           "Prompt tokens dropped from prompts that overflowed the context (--hiradix-context-overflow)"),
    Series("sglang:hiradix_shifted_tokens_total", "counter",
           "Cached tokens reused at new positions after a context overflow (re-rotated KV copies)"),
)  # fmt: skip
SERIES_BY_NAME = {s.name: s for s in SERIES}


class TierMetrics:
    """Exports the hiradix series of one scheduler process; call :meth:`update` once per step.

    Args:
        labels: SGLang's radix-cache labels of this rank (values are made strings).
        page_size: tokens per page.
        page_bytes: bytes per page (all layers, K and V), as DRAM holds it.
        tier_page_bytes: bytes per page in each tier (:data:`TIERS` order), when a tier holds
            pages in another format (``--hiradix-cold-format``); default ``page_bytes`` everywhere.
        capacity_pages: pages per tier, in :data:`TIERS` order (HBM: the device pool's pages;
            0 for a tier that is absent, and for the cluster store, whose size is the store's).
        registry: the prometheus_client registry (default: the process's, which SGLang's
            multiprocess collector reads); tests pass their own.
        reserved_bytes: host bytes this process reserves for DRAM and NVMe (0 on a TP rank
            that maps another rank's copy: summed over ranks, the node's host bytes).
    """

    def __init__(self, labels: dict[str, Any], page_size: int, page_bytes: int, capacity_pages: tuple[int, ...],
                 registry: Any = None, reserved_bytes: tuple[int, int] = (0, 0),
                 tier_page_bytes: Optional[tuple[int, ...]] = None):
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry

        self.labels = {k: str(v) for k, v in labels.items()}
        self.page_size = page_size
        self.page_bytes = page_bytes
        # bytes of a page as each tier holds it (a compressed NVMe/store tier: the encoded size)
        self.tier_page_bytes = tier_page_bytes or (page_bytes,) * len(TIERS)
        self._seen: dict[tuple, float] = {}
        self.metric: dict[str, Any] = {}
        names = list(self.labels)
        for s in SERIES:
            label_names = names + ([s.label] if s.label else [])
            if s.type == "counter":
                # prometheus_client appends `_total` to a counter's name itself.
                m = Counter(s.name.removesuffix("_total"), s.help, label_names, registry=registry)
            else:
                m = Gauge(s.name, s.help, label_names, multiprocess_mode="mostrecent", registry=registry)
            for value in s.values or (None,):
                m.labels(**self._labels(s, value))  # the label set exists (at 0) from the start
            self.metric[s.name] = m
        for tier, pages, size in zip(TIERS, capacity_pages, self.tier_page_bytes):
            self._set("sglang:hiradix_tier_capacity_tokens", pages * page_size, tier)
            self._set("sglang:hiradix_tier_capacity_bytes", pages * size, tier)
        for tier, size_bytes in zip(HOST_TIERS, reserved_bytes):
            self._set("sglang:hiradix_reserved_bytes", size_bytes, tier)

    def _labels(self, series: Series, value: Optional[str]) -> dict[str, str]:
        return self.labels if value is None else {**self.labels, series.label: value}

    def _set(self, name: str, value: float, label_value: Optional[str] = None) -> None:
        series = SERIES_BY_NAME[name]
        self.metric[name].labels(**self._labels(series, label_value)).set(value)

    def _advance(self, name: str, total: float, label_value: Optional[str] = None) -> None:
        key = (name, label_value)
        delta = total - self._seen.get(key, 0)
        if delta > 0:
            self.metric[name].labels(**self._labels(SERIES_BY_NAME[name], label_value)).inc(delta)
        self._seen[key] = total

    def update(self, stats: Any, books: Any, tier_tokens: list[int], view: Optional[Any], store: Optional[Any] = None,
               overflow: Optional[dict] = None, partial_tokens: int = 0) -> None:
        """Advance counters to the cumulative values in ``stats``/``books``/``store``; set gauges.

        Args:
            store: the cluster-store tier (``hiradix.core.store_tier.StoreTier``), or None.
            overflow: cumulative context-overflow counts (``truncated_tokens``, ``shifted_tokens``), or None.
            partial_tokens: cumulative tokens served from kept partial last pages.
        """
        self._update_store(store, stats)
        overflow = overflow or {}
        self._advance("sglang:hiradix_context_truncated_tokens_total", overflow.get("truncated_tokens", 0))
        self._advance("sglang:hiradix_shifted_tokens_total", overflow.get("shifted_tokens", 0))
        self._advance("sglang:hiradix_partial_page_tokens_total", partial_tokens)
        for kind, value in stats.bytes_moved.items():  # counted in the model's pages
            pages = value // self.page_bytes
            self._advance("sglang:hiradix_moved_bytes_total", pages * self.tier_page_bytes[LOWER_TIER[kind]], kind)
            self._advance("sglang:hiradix_moved_tokens_total", pages * self.page_size, kind)
        for kind, value in stats.transfers_failed.items():
            self._advance("sglang:hiradix_failed_transfers_total", value, kind)
        for outcome, value in dict(stats.prefetch_tokens, wasted=books.wasted_prefetch_tokens).items():
            self._advance("sglang:hiradix_prefetch_tokens_total", value, outcome)
        for read, value in stats.storage_hit_tokens.items():
            self._advance("sglang:hiradix_storage_hit_tokens_total", value, read)
        for outcome, value in stats.read_ahead_tokens.items():
            self._advance("sglang:hiradix_read_ahead_tokens_total", value, outcome)
        for tier, value in zip(TIERS, books.dropped_tokens):
            self._advance("sglang:hiradix_dropped_tokens_total", value, tier)
        self._advance("sglang:hiradix_admission_skips_total", stats.admission_skips)
        self._advance("sglang:hiradix_streamed_tokens_total", stats.streamed_tokens)
        self._advance("sglang:hiradix_held_requests_total", stats.held_requests)
        for cause, seconds in stats.admission_wait_s.items():
            self._advance("sglang:hiradix_admission_wait_seconds_total", seconds, cause)
        for tier, tokens, size in zip(TIERS, tier_tokens, self.tier_page_bytes):
            self._set("sglang:hiradix_tier_used_tokens", tokens, tier)
            self._set("sglang:hiradix_tier_used_bytes", tokens // self.page_size * size, tier)
        in_flight = collections.Counter(op.kind.name for op in books.ops.values())
        for kind in KINDS:
            self._set("sglang:hiradix_transfers_in_flight", in_flight.get(kind, 0), kind)
        self._set("sglang:hiradix_nvme_enabled", int(bool(books.nvme_enabled)))
        self._set("sglang:hiradix_nvme_restored_pages", stats.restored_pages)
        journal = getattr(books, "nvme_journal", None)
        self._set("sglang:hiradix_nvme_durable_pages", (journal.durable_pages() if journal is not None else None) or 0)
        if view is not None:
            self._set("sglang:hiradix_lookahead_window_requests", view.window)
            self._set("sglang:hiradix_prefetch_window_requests", view.prefetch_window)
            self._set("sglang:hiradix_protected_nodes", view.protected_nodes)

    def _update_store(self, store: Optional[Any], stats: Any) -> None:
        if store is not None:
            for op in STORE_OPS:
                count = store.reads.skipped_pages if op == "skipped_slow" else store.counts[_STORE_COUNT[op]]
                self._advance("sglang:hiradix_store_pages_total", count, op)
            self._advance("sglang:hiradix_store_switch_offs_total", store.counts["switch_offs"])
            self._advance("sglang:hiradix_store_lookup_skips_total", store.reads.skipped_lookups)
        lookups_per_s = store.reads.lookup.per_s if store is not None else None
        self._set("sglang:hiradix_store_lookup_seconds", 1.0 / lookups_per_s if lookups_per_s else 0.0)
        # exported from the start like every series (0 without a store or before a sample)
        self._set("sglang:hiradix_store_read_bytes_per_s", (store.reads.read.per_s if store is not None else 0.0) or 0.0)
        self._set("sglang:hiradix_prefill_tokens_per_s", (store.reads.prefill.per_s if store is not None else 0.0) or 0.0)
        self._advance("sglang:hiradix_store_used_tokens_total", stats.store_tokens["used"])
        self._set("sglang:hiradix_store_enabled", int(store is not None and store.enabled))
