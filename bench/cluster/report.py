"""Figures, table, targets and files of `bench.cluster.run` (records and router counters in, report out).

Per system, over the requests of all repetitions (tokens summed over requests):
    hit tokens by tier: `device` (HBM), `host` (DRAM) and the storage hits split by `storage_backend`
        into `nvme` (hiradix's local NVMe) and `store` (the cluster store: hiradix's `mooncake=N`,
        HiCache's `MooncakeStore`), each as a share of prompt tokens; `ideal`: one infinite shared cache;
    prefill tokens computed: prompt - cached;
    TTFT of turns >= 2 (1-based; `turn_index >= 1`: every turn with a history): p50 and p99 with 95%
        percentile-bootstrap intervals (`bench.common.stats.bootstrap_ci`), and the ratio of each to the
        reference's (`stock:cache_aware`) with a paired cluster bootstrap: whole (repeat, session)
        groups resampled for both systems at once (requests are paired, a session's turns are not
        independent); the A/A row is the reference's duplicate fleet;
    requests per server: the router's `smg_worker_requests_total` over the measured rounds (warm-ups
        go to the servers directly); imbalance = max / mean over the N servers;
    router TTFT: p50 / p99 of the router's `smg_router_ttft_seconds` histogram (None: not exposed, as
        in smg 1.13.0's HTTP mode); router duration: of `smg_router_request_duration_seconds`, which
        ends when a streaming response starts (all turns; coarse buckets);
    outputs token-identical to the reference (matched by repeat, session, turn).
Targets (issue 19; printed, not asserted), per hiradix system under a load-only policy: hit tokens
>= 95% of the reference's, imbalance <= 1.2, p99 TTFT of turns >= 2 below the reference's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from bench.ab.report import admission_line, admission_per_request, identical_fraction
from bench.common.multiturn import write_records
from bench.common.server_metrics import histogram_quantile
from bench.common.stats import LEVEL, RESAMPLES, bootstrap_ci

TIERS = ("device", "host", "nvme", "store")
QUANTILES = {"p50": 0.50, "p99": 0.99}
TARGET_HITS_OF_REFERENCE = 0.95
TARGET_IMBALANCE = 1.2
LOAD_ONLY = ("round_robin", "power_of_two", "least_load", "random")
_PAIR = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*=\s*(\d+)\s*$")


def split_storage(storage_tokens: Optional[int], label: Optional[str]) -> tuple[Optional[int], Optional[int]]:
    """Split a request's `storage` hits into (NVMe tokens, cluster-store tokens).

    `label` is `cached_tokens_details.storage_backend`: hiradix gives tokens per source
    (`"nvme=32,mooncake=240"`: `nvme` is local, any other name a store); SGLang HiCache names its
    one L3 backend (`"MooncakeStore"`: all of `storage_tokens`). No label: all to the store.

    Returns:
        (None, None) when the request reported no `storage` figure.
    """
    if storage_tokens is None:
        return None, None
    pairs = [_PAIR.match(part) for part in (label or "").split(",")] if label and "=" in label else []
    if pairs and all(pairs):
        nvme = sum(int(m.group(2)) for m in pairs if m.group(1).lower() == "nvme")
        return nvme, sum(int(m.group(2)) for m in pairs) - nvme
    if label and "nvme" in label.lower():
        return storage_tokens, 0
    return 0, storage_tokens


def later_ttfts(records) -> dict:
    """(repeat, session, turn) -> TTFT (s) of the ok requests of turns >= 2 (1-based)."""
    return {(r.repeat, r.session_index, r.turn_index): r.ttft_s for r in records
            if r.ok and r.turn_index >= 1 and r.ttft_s is not None}  # fmt: skip


def paired_quantile_ratio(a: dict, b: dict, q: float, resamples: int = RESAMPLES, level: float = LEVEL,
                          seed: int = 0) -> tuple[float, float, float]:
    """quantile_q(a) / quantile_q(b) over the keys both have, and its interval: whole (repeat, session)
    groups (`key[:2]`) resampled for both sides at once. NaNs without common keys."""
    keys = sorted(set(a) & set(b))
    if not keys:
        return math.nan, math.nan, math.nan
    groups: dict = {}
    for k in keys:
        groups.setdefault(k[:2], []).append(k)
    blocks = [(np.array([a[k] for k in ks]), np.array([b[k] for k in ks])) for ks in groups.values()]
    va, vb = np.concatenate([x for x, _ in blocks]), np.concatenate([y for _, y in blocks])
    point = float(np.quantile(va, q) / np.quantile(vb, q))
    rng = np.random.default_rng(seed)
    stats = []
    for row in rng.integers(0, len(blocks), size=(resamples, len(blocks))):
        xa = np.concatenate([blocks[i][0] for i in row])
        xb = np.concatenate([blocks[i][1] for i in row])
        stats.append(np.quantile(xa, q) / np.quantile(xb, q))
    tail = (1.0 - level) / 2 * 100
    return point, float(np.percentile(stats, tail)), float(np.percentile(stats, 100 - tail))


def _sum(records, name: str) -> int:
    return sum(getattr(r, name) or 0 for r in records)


def _quantile_ci(values: Sequence[float], q: float) -> tuple[float, float, float]:
    if not values:
        return math.nan, math.nan, math.nan
    lo, hi = bootstrap_ci(values, statistic=lambda x, axis: np.quantile(x, q, axis=axis))
    return float(np.quantile(values, q)), lo, hi


def server_counts(results: Sequence, name: str, urls: Sequence[str]) -> list[float]:
    """Requests the router sent to each of `urls` (in that order), summed over the repetitions."""
    return [sum(res.router[name].requests.get(u, 0.0) for res in results) for u in urls]


def router_ttft(results: Sequence, name: str, field: str = "ttft_buckets") -> dict:
    """p50 / p99 of a router histogram (`field` of `RouterSnapshot`) over the repetitions (None when absent)."""
    snaps = [res.router[name] for res in results]
    buckets: dict = {}
    for s in snaps:
        for le, n in getattr(s, field).items():
            buckets[le] = buckets.get(le, 0.0) + n
    if not buckets or (field == "ttft_buckets" and not any(s.ttft_available for s in snaps)):
        return {"available": False, "p50": None, "p99": None, "count": 0}
    count = max(buckets.values()) if buckets else 0
    return {"available": True, "count": count, **{k: histogram_quantile(buckets, q) for k, q in QUANTILES.items()}}


def system_summary(name: str, results: Sequence, urls: Sequence[str], reference: Sequence) -> dict:
    """Figures of one system (see the module docstring); `reference`: the reference system's records."""
    records = [r for res in results for r in res.records if r.system == name]
    ok = [r for r in records if r.ok]
    prompt, cached = _sum(ok, "prompt_tokens"), _sum(ok, "cached_tokens")
    tiers = {"device": _sum(ok, "cached_device_tokens"), "host": _sum(ok, "cached_host_tokens"),
             "nvme": _sum(ok, "cached_nvme_tokens"), "store": _sum(ok, "cached_store_tokens")}  # fmt: skip
    share = (lambda n: n / prompt) if prompt else (lambda n: math.nan)
    # no request said where its hits came from (smg's gRPC mode relays cached_tokens only): no tier shares
    split = any(r.cached_device_tokens is not None for r in ok)
    mine, ref = later_ttfts(records), later_ttfts(reference)
    ttft = {}
    for k, q in QUANTILES.items():
        point, lo, hi = _quantile_ci(list(mine.values()), q)
        ratio = paired_quantile_ratio(mine, ref, q)
        ttft[k] = {"s": point, "ci_s": [lo, hi], "ratio": ratio[0], "ratio_ci": [ratio[1], ratio[2]]}
    counts = server_counts(results, name, urls)
    mean = sum(counts) / len(counts) if counts else math.nan
    same, compared = identical_fraction(reference, records)
    ideal = _sum(ok, "ideal_cached_tokens")
    ideal_known = any(r.ideal_cached_tokens is not None for r in ok)  # none without an HTTP server to tokenize
    return {
        "system": name, "requests": len(records), "errors": len(records) - len(ok), "prompt_tokens": prompt,
        "cached_tokens": cached, "tier_tokens": tiers, "hit_share": share(cached),
        "tier_share": {t: share(n) if split else math.nan for t, n in tiers.items()}, "ideal_cached_tokens": ideal,
        "ideal_share": share(ideal) if ideal_known else math.nan, "prefill_tokens": prompt - cached,
        "ttft_later_n": len(mine),
        "ttft_later": ttft, "server_requests": counts, "routed_requests": sum(counts),
        "imbalance": max(counts) / mean if counts and mean > 0 else math.nan,
        "router_ttft": router_ttft(results, name), "router_duration": router_ttft(results, name, "duration_buckets"),
        "identical_to_reference": [same, compared],
        "workload_s": sum(res.workload_s for res in results),
        "admission_per_request": admission_per_request(_admission(results, name), len(records)),
    }  # fmt: skip


def _admission(results: Sequence, name: str) -> dict:
    """A system's arrival-to-admission counters summed over the repetitions ({}: none recorded)."""
    total: Counter = Counter()
    for res in results:
        total.update(res.admission.get(name, {}))  # update keeps zeros (+ drops them)
    return dict(total)


def build_report(results: Sequence, names: Sequence[str], worker_urls: dict) -> dict:
    """Per system (in `names` order) and the targets; the reference is `stock:cache_aware` if run, else the first."""
    reference = "stock:cache_aware" if "stock:cache_aware" in names else names[0]
    ref_records = [r for res in results for r in res.records if r.system == reference]
    systems = [system_summary(n, results, worker_urls[n], ref_records) for n in names]
    return {"reference": reference, "systems": systems, "targets": evaluate_targets(systems, reference)}


def evaluate_targets(systems: Sequence[dict], reference: str) -> list[dict]:
    """The issue's targets for every hiradix system under a load-only policy (met: True/False)."""
    by = {s["system"]: s for s in systems}
    ref = by.get(reference)
    out = []
    for s in systems:
        kind, _, policy = s["system"].partition(":")
        if kind != "hiradix" or policy not in LOAD_ONLY or ref is None:
            continue
        hits = s["cached_tokens"] / ref["cached_tokens"] if ref["cached_tokens"] else math.nan
        out.append({"system": s["system"], "target": f"hit tokens >= {TARGET_HITS_OF_REFERENCE:.0%} of {reference}'s",
                    "measured": f"{s['cached_tokens']} / {ref['cached_tokens']} = {hits:.3f}", "value": hits,
                    "met": bool(hits >= TARGET_HITS_OF_REFERENCE)})  # fmt: skip
        out.append({"system": s["system"], "target": f"imbalance (max/mean requests per server) <= {TARGET_IMBALANCE}",
                    "measured": f"{s['imbalance']:.2f} ({'/'.join(f'{c:.0f}' for c in s['server_requests'])}; "
                                f"{reference}: {ref['imbalance']:.2f})",
                    "value": s["imbalance"], "met": bool(s["imbalance"] <= TARGET_IMBALANCE)})  # fmt: skip
        p99, rp99 = s["ttft_later"]["p99"], ref["ttft_later"]["p99"]
        out.append({"system": s["system"], "target": f"p99 TTFT turns >= 2 below {reference}'s",
                    "measured": f"{p99['s'] * 1e3:.0f} vs {rp99['s'] * 1e3:.0f} ms, ratio {p99['ratio']:.2f} "
                                f"[{p99['ratio_ci'][0]:.2f}, {p99['ratio_ci'][1]:.2f}]",
                    "value": p99["ratio"], "met": bool(p99["s"] < rp99["s"])})  # fmt: skip
    return out


def _pct(x: float) -> str:
    return "    -" if x is None or math.isnan(x) else f"{100 * x:5.1f}"


def _ms(d: dict) -> str:
    return "-" if math.isnan(d["s"]) else f"{d['s'] * 1e3:.0f} [{d['ci_s'][0] * 1e3:.0f}-{d['ci_s'][1] * 1e3:.0f}]"


def _ratio(d: dict) -> str:
    return "-" if math.isnan(d["ratio"]) else f"{d['ratio']:.2f} [{d['ratio_ci'][0]:.2f}-{d['ratio_ci'][1]:.2f}]"


def _router_ms(rt: dict) -> str:
    if not rt["available"]:
        return "n/a"
    return f"{rt['p50'] * 1e3:.0f}/{rt['p99'] * 1e3:.0f}"


def format_report(report: dict) -> str:
    """The per-system table printed at the end of a run, then the targets."""
    head = (f"{'system':<26} {'req':>4} {'hit%':>5} {'ideal%':>6} {'HBM%':>5} {'DRAM%':>5} {'store%':>6} "
            f"{'prefill':>7} {'p50 ms t>=2 [CI]':>17} {'p99 ms t>=2 [CI]':>18} {'p50/ref [CI]':>17} "
            f"{'p99/ref [CI]':>17} {'per server':>12} {'imb':>4} {'router p50/p99':>14} {'dur p50/p99':>11} "
            f"{'same':>7}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for s in report["systems"]:
        t, share = s["ttft_later"], s["tier_share"]
        per = "/".join(f"{c:.0f}" for c in s["server_requests"])
        same = "{}/{}".format(*s["identical_to_reference"])
        lines.append(f"{s['system']:<26} {s['requests']:>4} {_pct(s['hit_share'])} {_pct(s['ideal_share']):>6} "
                     f"{_pct(share['device'])} {_pct(share['host'])} {_pct(share['store'] + share['nvme']):>6} "
                     f"{s['prefill_tokens']:>7} {_ms(t['p50']):>17} {_ms(t['p99']):>18} {_ratio(t['p50']):>17} "
                     f"{_ratio(t['p99']):>17} {per:>12} {s['imbalance']:>4.2f} {_router_ms(s['router_ttft']):>14} "
                     f"{_router_ms(s.get('router_duration', {'available': False})):>11} {same:>7}")  # fmt: skip
    lines.append(f"hit% = cached / prompt tokens (all turns); ideal% = one infinite cache shared by all servers; "
                 f"HBM/DRAM/store = where the hits came from (-: not reported, as in smg's gRPC mode); "
                 f"prefill = prompt - cached tokens; t>=2 = turns with a "
                 f"history; /ref = ratio of that quantile to {report['reference']}'s (paired session bootstrap); "
                 "per server / imb = the router's requests per worker and max/mean; router = smg_router_ttft_seconds "
                 "p50/p99 ms (n/a: not exposed); dur = smg_router_request_duration_seconds p50/p99 ms (all turns; it ends "
                 "when a stream starts); same = outputs token-identical to the reference")  # fmt: skip
    for s in report["systems"]:
        line = admission_line(s["system"], s.get("admission_per_request"))
        if line is not None:
            lines.append(line)
    if not any(s["router_ttft"]["available"] for s in report["systems"]):
        lines.append("router TTFT: smg exposed no smg_router_ttft_seconds samples for these (streaming chat) requests")
    errors = sum(s["errors"] for s in report["systems"])
    if errors:
        lines.append(f"FAILED REQUESTS: {errors} (see records.json)")
    for t in report["targets"]:
        lines.append(f"target [{t['system']}]: {t['target']}: {t['measured']} -> {'MET' if t['met'] else 'MISSED'}")
    return "\n".join(lines)


def write_outputs(results: Sequence, report: dict, run_dir: Path, config: dict) -> None:
    """records.json/.csv (every request), summary.json, config.json and the PNGs."""
    from bench.cluster import plots

    write_records([r for res in results for r in res.records], run_dir / "records.json", run_dir / "records.csv")
    router = [{name: dataclasses.asdict(snap) for name, snap in res.router.items()} for res in results]
    (run_dir / "summary.json").write_text(json.dumps({**report, "router_per_repeat": router}, indent=1, default=str))
    (run_dir / "config.json").write_text(json.dumps(config, indent=1, default=str))
    plots.plot_all(report, run_dir)
