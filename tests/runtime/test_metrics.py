"""hiradix's Prometheus series and the Grafana dashboard (issue 14).

* Every series of ``hiradix.runtime.metrics.SERIES`` is exported from construction, every label
  set at 0 (counters) or at its capacity (gauges), with SGLang's naming conventions.
* Counters advance by deltas of the cumulative stats, never twice for the same total.
* docs/metrics.md's table of them: tests/docs/test_metrics_doc.py.
* ``dashboards/hiradix.json``: no Grafana server installs here (not in Debian; Grafana's own
  downloads are not reachable) and npm's ``@grafana/schema`` ships TypeScript types, not a JSON
  Schema. So the dashboard is parsed by Grafana's foundation SDK models (generated from
  Grafana's dashboard schema): no key of ours may be dropped or changed by the round trip; a
  JSON Schema checks the types those models do not; and every series a query names must be
  exported by hiradix or by the installed SGLang.
"""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import jsonschema
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from hiradix.core.stats import TierStats
from hiradix.core.store_reads import StoreReadChoice
from hiradix.runtime.metrics import SERIES, SERIES_BY_NAME, TIERS, TierMetrics

REPO = Path(__file__).resolve().parents[2]
LABELS = {"cache_type": "TieredRadixCache", "tp_rank": 0, "pp_rank": 0, "dp_rank": 0}
PAGE_SIZE, PAGE_BYTES = 16, 4096


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in LABELS)))] = s.value
    return out


def make(registry: CollectorRegistry) -> TierMetrics:
    return TierMetrics(LABELS, PAGE_SIZE, PAGE_BYTES, (32, 100, 1000, 0), registry=registry)


def books(**kw):
    base = dict(wasted_prefetch_tokens=0, dropped_tokens=[0, 0, 0], ops={}, nvme_enabled=True)
    return types.SimpleNamespace(**{**base, **kw})


def test_every_series_is_exported_from_the_start():
    registry = CollectorRegistry()
    make(registry)
    got = samples(registry)
    for s in SERIES:
        for value in s.values or (None,):
            key = (s.name, ((s.label, value),) if value else ())
            assert key in got, key
            if s.type == "counter":
                assert got[key] == 0.0, key
    cap = {t: got[("sglang:hiradix_tier_capacity_tokens", (("tier", t),))] for t in TIERS}
    assert cap == {"HBM": 32 * 16, "DRAM": 100 * 16, "NVMe": 1000 * 16, "store": 0}
    assert got[("sglang:hiradix_tier_capacity_bytes", (("tier", "DRAM"),))] == 100 * PAGE_BYTES
    text = generate_latest(registry).decode()
    assert 'cache_type="TieredRadixCache"' in text and 'tp_rank="0"' in text


def test_names_follow_sglang_conventions():
    units = ("_tokens", "_bytes", "_requests", "_nodes", "_pages", "_transfers", "_in_flight", "_enabled", "_offs", "_per_s", "_seconds")
    for s in SERIES:
        assert re.fullmatch(r"sglang:hiradix_[a-z_]+", s.name), s.name
        assert s.name.endswith("_total") == (s.type == "counter"), s.name
        assert s.name.removesuffix("_total").endswith(units) or s.name.endswith("_skips_total"), s.name


def test_counters_advance_by_deltas_and_gauges_follow_the_tree():
    registry = CollectorRegistry()
    m = make(registry)
    stats = TierStats()
    stats.bytes_moved["DEMOTE"] = 3 * PAGE_BYTES
    stats.prefetch_tokens["started"] = 48
    stats.storage_hit_tokens["ahead"] = 32
    stats.admission_skips = 2
    stats.streamed_tokens = 96
    stats.admission_wait_s["nvme_read"] = 1.25
    stats.held_requests = 3
    op = types.SimpleNamespace(kind=types.SimpleNamespace(name="PREFETCH"))
    for _ in range(2):  # the same totals twice: counted once
        m.update(stats, books(wasted_prefetch_tokens=16, dropped_tokens=[0, 16, 0, 0], ops={1: op},
                              nvme_journal=types.SimpleNamespace(durable_pages=lambda: 29)), [64, 160, 480, 0], None)
    got = samples(registry)
    assert got[("sglang:hiradix_moved_bytes_total", (("kind", "DEMOTE"),))] == 3 * PAGE_BYTES
    assert got[("sglang:hiradix_moved_tokens_total", (("kind", "DEMOTE"),))] == 3 * PAGE_SIZE
    assert got[("sglang:hiradix_prefetch_tokens_total", (("outcome", "started"),))] == 48
    assert got[("sglang:hiradix_prefetch_tokens_total", (("outcome", "wasted"),))] == 16
    assert got[("sglang:hiradix_storage_hit_tokens_total", (("read", "ahead"),))] == 32
    assert got[("sglang:hiradix_storage_hit_tokens_total", (("read", "at_admission"),))] == 0
    assert got[("sglang:hiradix_dropped_tokens_total", (("tier", "DRAM"),))] == 16
    assert got[("sglang:hiradix_admission_skips_total", ())] == 2
    assert got[("sglang:hiradix_streamed_tokens_total", ())] == 96
    assert got[("sglang:hiradix_admission_wait_seconds_total", (("cause", "nvme_read"),))] == 1.25
    assert got[("sglang:hiradix_admission_wait_seconds_total", (("cause", "dram_room"),))] == 0
    assert got[("sglang:hiradix_held_requests_total", ())] == 3
    assert got[("sglang:hiradix_partial_page_tokens_total", ())] == 0  # none given
    assert got[("sglang:hiradix_tier_used_tokens", (("tier", "NVMe"),))] == 480
    assert got[("sglang:hiradix_tier_used_bytes", (("tier", "NVMe"),))] == 30 * PAGE_BYTES
    assert got[("sglang:hiradix_transfers_in_flight", (("kind", "PREFETCH"),))] == 1
    assert got[("sglang:hiradix_transfers_in_flight", (("kind", "DEMOTE"),))] == 0
    assert got[("sglang:hiradix_nvme_enabled", ())] == 1
    assert got[("sglang:hiradix_nvme_durable_pages", ())] == 29  # a restart would re-index these
    assert got[("sglang:hiradix_store_enabled", ())] == 0  # no store tier
    stats.admission_skips = 5
    store = types.SimpleNamespace(enabled=True, counts={"lookup_pages": 4, "lookup_found_pages": 2, "put_pages": 3,
                                                        "put_failed_pages": 0, "get_pages": 2, "get_failed_pages": 1,
                                                        "switch_offs": 1, "put_retried_pages": 6})
    store.reads = StoreReadChoice("auto", 1000.0, PAGE_SIZE, min_samples=1)
    store.reads.note_get(2e6, 0.01)  # 200 MB/s
    store.reads.note_prefill(1000, 0.1)  # 10k tokens/s: reading pays above 10 MB/s
    store.reads.skipped_pages = 7
    store.reads.skipped_lookups = 5
    store.reads.note_lookup(0.02, 100, 4, 0)
    stats.store_tokens["used"] = 32
    m.update(stats, books(nvme_enabled=False), [0, 0, 0, 0], None, store=store)
    got = samples(registry)
    assert got[("sglang:hiradix_admission_skips_total", ())] == 5
    assert got[("sglang:hiradix_nvme_enabled", ())] == 0
    assert got[("sglang:hiradix_nvme_durable_pages", ())] == 0  # no durable index
    assert got[("sglang:hiradix_store_pages_total", (("op", "found"),))] == 2
    assert got[("sglang:hiradix_store_pages_total", (("op", "get_failed"),))] == 1
    assert got[("sglang:hiradix_store_pages_total", (("op", "put_retried"),))] == 6
    assert got[("sglang:hiradix_store_used_tokens_total", ())] == 32
    assert got[("sglang:hiradix_store_lookup_skips_total", ())] == 5
    assert got[("sglang:hiradix_store_lookup_seconds", ())] == pytest.approx(0.02)
    assert got[("sglang:hiradix_store_switch_offs_total", ())] == 1
    assert got[("sglang:hiradix_store_enabled", ())] == 1
    assert got[("sglang:hiradix_store_pages_total", (("op", "skipped_slow"),))] == 7
    assert got[("sglang:hiradix_store_read_bytes_per_s", ())] == 2e8
    assert got[("sglang:hiradix_prefill_tokens_per_s", ())] == 1e4


# ------------------------------------------------------------------ the Grafana dashboard

DASHBOARD = REPO / "dashboards" / "hiradix.json"
PANEL_TYPES = {"row", "timeseries", "stat"}
TYPES_SCHEMA = {
    "type": "object",
    "required": ["uid", "title", "schemaVersion", "panels", "templating"],
    "properties": {
        "uid": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,40}$"},
        "schemaVersion": {"type": "integer", "minimum": 36},
        "panels": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["id", "type", "title", "gridPos"],
            "properties": {
                "id": {"type": "integer"},
                "type": {"enum": sorted(PANEL_TYPES)},
                "gridPos": {"type": "object", "required": ["h", "w", "x", "y"],
                            "properties": {k: {"type": "integer", "minimum": 0, "maximum": 24 if k in "wx" else 10**4}
                                           for k in "hwxy"}},
                "targets": {"type": "array", "items": {"type": "object", "required": ["refId", "expr"],
                                                        "properties": {"expr": {"type": "string", "minLength": 1}}}},
            },
        }},
    },
}  # fmt: skip


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _diff(mine, theirs, path=""):
    """Keys of ours the round trip dropped, and values it changed (added defaults are fine)."""
    if isinstance(mine, dict):
        for key, value in mine.items():
            if key not in theirs:
                yield f"dropped {path}.{key}"
            else:
                yield from _diff(value, theirs[key], f"{path}.{key}")
    elif isinstance(mine, list):
        if len(mine) != len(theirs):
            yield f"length of {path}"
        for i, (a, b) in enumerate(zip(mine, theirs)):
            yield from _diff(a, b, f"{path}[{i}]")
    elif mine != theirs:
        yield f"changed {path}: {mine!r} -> {theirs!r}"


def test_dashboard_round_trips_through_grafanas_dashboard_models():
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import Dashboard

    mine = _dashboard()
    theirs = json.loads(json.dumps(Dashboard.from_json(mine), cls=JSONEncoder))
    assert list(_diff(mine, theirs)) == []
    broken = _dashboard()
    broken["panels"][1]["targts"] = broken["panels"][1].pop("targets")  # a typo is caught
    assert list(_diff(broken, json.loads(json.dumps(Dashboard.from_json(broken), cls=JSONEncoder))))


def test_dashboard_types_ids_and_layout():
    dash = _dashboard()
    jsonschema.validate(dash, TYPES_SCHEMA)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**dash, "panels": [{**dash["panels"][1], "gridPos": {"h": 8, "w": "12", "x": 0, "y": 0}}]},
                            TYPES_SCHEMA)


def test_dashboard_queries_name_only_exported_series():
    import sglang.srt.observability.metrics_collector as collector

    sglang_names = set(re.findall(r'name="(sglang:[a-z_]+)"', Path(collector.__file__).read_text()))
    exprs = [t["expr"] for p in _dashboard()["panels"] for t in p.get("targets", [])]
    named = {n for e in exprs for n in re.findall(r"sglang:[a-z_]+", e)}
    ours = {n for n in named if n.startswith("sglang:hiradix_")}
    assert ours <= set(SERIES_BY_NAME), ours - set(SERIES_BY_NAME)
    theirs = {n.removesuffix("_total") for n in named - ours}
    assert theirs and theirs <= {n.removesuffix("_total") for n in sglang_names}, theirs
    # the per-tier view the issue asks for: hits by tier, occupancy, prefetch, bytes moved, stalls
    for needed in ("sglang:cached_tokens_total", "sglang:hiradix_tier_used_tokens", "sglang:hiradix_prefetch_tokens_total",
                   "sglang:hiradix_moved_bytes_total", "sglang:hiradix_admission_skips_total"):
        assert needed in named, needed


def test_moved_bytes_count_the_lower_tiers_page_size():
    """Compressed tiers (issue 21): a DEMOTE moves NVMe-sized (encoded) pages, a BACKUP DRAM-sized ones."""
    registry = CollectorRegistry()
    m = TierMetrics(LABELS, PAGE_SIZE, PAGE_BYTES, (32, 100, 1000, 0), registry=registry,
                    tier_page_bytes=(PAGE_BYTES, PAGE_BYTES // 4, PAGE_BYTES // 2, PAGE_BYTES // 2))
    stats = TierStats()
    stats.bytes_moved.update(DEMOTE=3 * PAGE_BYTES, BACKUP=2 * PAGE_BYTES, GET=PAGE_BYTES)
    m.update(stats, books(), [0, 0, 0, 0], None)
    got = samples(registry)
    assert got[("sglang:hiradix_moved_bytes_total", (("kind", "DEMOTE"),))] == 3 * (PAGE_BYTES // 2)
    assert got[("sglang:hiradix_moved_bytes_total", (("kind", "BACKUP"),))] == 2 * (PAGE_BYTES // 4)
    assert got[("sglang:hiradix_moved_bytes_total", (("kind", "GET"),))] == PAGE_BYTES // 2
    assert got[("sglang:hiradix_moved_tokens_total", (("kind", "DEMOTE"),))] == 3 * PAGE_SIZE
