"""The open-loop part of `bench.ab`'s report (`--open-loop RATE`): TTFT distributions, SGLang's
own per-request split, and ratios of means and p90s to the ideal and to HiCache.

Per system (all repetitions): TTFT mean, p50, p90 and p99 over its requests; from its servers'
`/metrics` deltas, per request: SGLang's queue time (`sglang:queue_time_seconds`, arrival to
admission; it includes hiradix's holds), prefill forward (`sglang:per_stage_req_latency_seconds`,
stage `prefill_forward`) and the rest of the TTFT (tokenizing, the first decode step, the
stream); the client-side wait for a free slot or a ready session. Ratios (hiradix / the ideal,
hiradix / HiCache, the A/A) of the mean and the p90 of turns >= 2, with 95% bootstrap intervals
over requests paired by (repeat, session, turn).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from bench.ab.report import LATER_TURN, SystemRun
from bench.ab.systems import HICACHE, IDEAL
from bench.common import server_metrics
from bench.common.stats import paired_statistic_ratio_ci

QUANTILES = (0.5, 0.9, 0.99)


def ttft_distribution(run: SystemRun) -> dict:
    """TTFT mean and quantiles of turns >= 2, in seconds (NaN without requests)."""
    values = [r.ttft_s for r in run.records if r.ok and r.turn_index >= LATER_TURN and r.ttft_s is not None]
    if not values:
        return {"n": 0, "mean": math.nan, **{f"p{round(q * 100)}": math.nan for q in QUANTILES}}
    return {"n": len(values), "mean": float(np.mean(values)),
            **{f"p{round(q * 100)}": float(np.quantile(values, q)) for q in QUANTILES}}


def hits_by_tier(run: SystemRun) -> dict:
    """Shares of the prompt tokens (all turns) served from HBM (`device`), DRAM (`host`) and below
    (`storage`: NVMe or the store, HiCache's L3), from the responses' `cached_tokens_details`."""
    ok = [r for r in run.records if r.ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    sums = {"device": sum(r.cached_device_tokens or 0 for r in ok), "host": sum(r.cached_host_tokens or 0 for r in ok),
            "storage": sum(r.cached_storage_tokens or 0 for r in ok)}
    return {tier: (n / prompt if prompt else math.nan) for tier, n in sums.items()}


def stage_split(run: SystemRun) -> Optional[dict]:
    """Per request, seconds: SGLang's queue time and prefill forward (from `/metrics`), the rest of
    the mean TTFT (all turns), and the client's wait for a slot; None without SGLang's figures."""
    metrics = server_metrics.total(run.metrics) if run.metrics else None
    if metrics is None or not metrics.admission.get("queued_requests"):
        return None
    ok = [r for r in run.records if r.ok and r.ttft_s is not None]
    queue_s = metrics.admission["queue_s"] / metrics.admission["queued_requests"]
    forward_n = metrics.stages.get("prefill_forward:count", 0.0)
    forward_s = metrics.stages.get("prefill_forward:s", 0.0) / forward_n if forward_n else math.nan
    ttft_s = float(np.mean([r.ttft_s for r in ok])) if ok else math.nan
    waits = [r.start_s - r.arrival_s for r in ok if getattr(r, "arrival_s", None) is not None and r.start_s is not None]
    return {"ttft_s": ttft_s, "queue_s": queue_s, "prefill_forward_s": forward_s,
            "rest_s": ttft_s - queue_s - (forward_s if not math.isnan(forward_s) else 0.0),
            "client_wait_s": float(np.mean(waits)) if waits else math.nan}


def paired_stat_ratio(a: SystemRun, b: SystemRun, statistic) -> dict:
    """statistic(a's TTFTs) / statistic(b's) over the turns >= 2 both have, and its bootstrap
    interval (`stats.paired_statistic_ratio_ci`: the same requests resampled on both sides)."""
    def by_key(run: SystemRun) -> dict:
        return {(r.repeat, r.session_index, r.turn_index): r.ttft_s for r in run.records
                if r.ok and r.ttft_s is not None and r.turn_index >= LATER_TURN}
    ratio, lo, hi, n = paired_statistic_ratio_ci(by_key(a), by_key(b), statistic)
    return {"ratio": ratio, "ci": (lo, hi), "n": n}


def _p90(x, axis=None):
    return np.quantile(x, 0.9, axis=axis)


def open_loop_ratios(runs: Sequence[SystemRun]) -> list[dict]:
    """Mean and p90 ratios: each hiradix system vs the ideal and HiCache, and the A/A pair."""
    by_name = {run.system.name: run for run in runs}
    pairs = []
    for run in runs:
        if run.system.duplicate_of and run.system.duplicate_of in by_name:
            pairs.append((run, by_name[run.system.duplicate_of], "aa"))
        elif "--enable-hiradix" in run.system.server_args:
            pairs += [(run, by_name[other], kind) for other, kind in ((IDEAL, "vs-ideal"), (HICACHE, "vs-hicache"))
                      if other in by_name]
    out = []
    for a, b, kind in pairs:
        mean, p90 = paired_stat_ratio(a, b, np.mean), paired_stat_ratio(a, b, _p90)
        out.append({"a": a.system.name, "b": b.system.name, "kind": kind, "mean": mean, "p90": p90})
    return out


def _ms(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 1000:.0f}"


def open_loop_lines(runs: Sequence[SystemRun], rate_per_s: float, max_in_flight: int) -> list[str]:
    """The open-loop table and ratio lines `bench.ab` prints."""
    lines = [f"open loop: Poisson arrivals at {rate_per_s:g} requests/s, at most {max_in_flight} in flight; "
             f"each system alone on its server; TTFT of turns >= {LATER_TURN} in ms; per request (all turns): "
             "SGLang's queue time and prefill forward, the rest of the TTFT, the client's wait for a slot",
             f"{'system':<10} {'n':>4} {'mean':>6} {'p50':>6} {'p90':>6} {'p99':>6} | {'queue':>6} {'prefill':>7} "
             f"{'rest':>6} {'wait':>6} | hits % of prompt tokens: HBM / DRAM / below"]
    for run in runs:
        d, split, hits = ttft_distribution(run), stage_split(run) or {}, hits_by_tier(run)
        lines.append(f"{run.system.name:<10} {d['n']:>4} {_ms(d['mean']):>6} {_ms(d['p50']):>6} {_ms(d['p90']):>6} "
                     f"{_ms(d['p99']):>6} | {_ms(split.get('queue_s')):>6} {_ms(split.get('prefill_forward_s')):>7} "
                     f"{_ms(split.get('rest_s')):>6} {_ms(split.get('client_wait_s')):>6} | "
                     + " / ".join(f"{hits[t] * 100:.1f}" for t in ("device", "host", "storage")))
    for r in open_loop_ratios(runs):
        b = "HiCache" if r["kind"] == "vs-hicache" else r["b"]
        label = "A/A " if r["kind"] == "aa" else ""
        lines.append(f"{label}{r['a']} vs {b}, open loop, turns >= {LATER_TURN}: TTFT mean {_ratio(r['mean'])}, "
                     f"p90 {_ratio(r['p90'])} (n={r['mean']['n']})")
    return lines


def _ratio(r: dict) -> str:
    return f"{r['ratio']:.2f}x [{r['ci'][0]:.2f}, {r['ci'][1]:.2f}]"
