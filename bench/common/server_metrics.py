"""Figures from SGLang's `/metrics` (Prometheus text) that noise cannot hide, per server.

SGLang 0.5.23 (`sglang/srt/metrics/collector.py`) counts, per finished request:
`sglang:prompt_tokens_total` (prompt tokens) and `sglang:cached_tokens_total{cache_source=...}`
(prompt tokens served by the prefix cache, by tier), so the prefill tokens computed are their
difference; and it keeps the server-side TTFT histogram `sglang:time_to_first_token_seconds`
(buckets `le` in seconds). `snapshot` reads those; `delta` subtracts two snapshots (after the
warm-up and after the workload) so only the measured requests count.

hiradix adds the gauge `sglang:hiradix_reserved_bytes{tier, tp_rank}`: the host bytes each scheduler
process reserves for its DRAM and NVMe tiers (0 on a TP rank that maps rank 0's copy of an MLA
model), so their sum over ranks is the server's host bytes. A gauge is not subtracted: `delta`
and `total` keep the latest value.
"""

from __future__ import annotations

import math
import urllib.request
from dataclasses import dataclass, field
from typing import Sequence

from prometheus_client.parser import text_string_to_metric_families

from hiradix.core.hold_times import CAUSES as HOLD_CAUSES

TTFT_HISTOGRAM = "sglang:time_to_first_token_seconds"
# Where a request's time from arrival to admission goes: SGLang's queue time (every system; it
# includes hiradix's holds), hiradix's holds by cause and its admission skips (loop iterations that
# held a request). Sample name (label value or None) -> key in MetricsSnapshot.admission.
ADMISSION_COUNTERS = {
    ("sglang:queue_time_seconds_sum", None): "queue_s",
    ("sglang:queue_time_seconds_count", None): "queued_requests",
    ("sglang:hiradix_held_requests_total", None): "held_requests",
    ("sglang:hiradix_admission_skips_total", None): "admission_skips",
    **{("sglang:hiradix_admission_wait_seconds_total", cause): f"held_s:{cause}" for cause in HOLD_CAUSES},
}
# SGLang's per-request stage latencies (histogram, label `stage`: request_process, prefill_forward,
# chunked_prefill are observed on a plain server): sum and count per stage -> MetricsSnapshot.stages.
STAGE_LATENCY = "sglang:per_stage_req_latency_seconds"
TIER_USED_TOKENS = "sglang:hiradix_tier_used_tokens"  # gauge per tier (hiradix/runtime/metrics.py)
RESERVED_BYTES = "sglang:hiradix_reserved_bytes"  # gauge per tier and TP rank (hiradix/runtime/metrics.py)


@dataclass
class MetricsSnapshot:
    """Counters of one server at one time (tokens; TTFT bucket counts keyed by `le` in seconds)."""

    prompt_tokens: float = 0.0
    cached_tokens: float = 0.0
    ttft_buckets: dict = field(default_factory=dict)  # le (s, inf for +Inf) -> cumulative count
    available: bool = False  # False: /metrics did not answer or lacked the counters
    reserved_bytes: dict = field(default_factory=dict)  # tier -> hiradix's host bytes, sum over TP ranks ({}: none)
    admission: dict = field(default_factory=dict)  # ADMISSION_COUNTERS' keys -> value ({}: none reported)
    stages: dict = field(default_factory=dict)  # "<stage>:s" / "<stage>:count" of STAGE_LATENCY ({}: none)

    @property
    def prefill_tokens(self) -> float:
        """Prompt tokens the server computed (prompt - cached)."""
        return self.prompt_tokens - self.cached_tokens


def fetch_metrics(base_url: str, timeout_s: float = 10.0) -> str:
    """The server's Prometheus text from `GET /metrics`, or "" if it does not answer in time."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=timeout_s) as resp:
            return resp.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def parse_snapshot(text: str) -> MetricsSnapshot:
    """Sum the counters over all label sets (streaming and not, every tier) of one `/metrics` text."""
    snap = MetricsSnapshot()
    if not text:
        return snap
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sglang:prompt_tokens_total":
                snap.prompt_tokens += sample.value
                snap.available = True
            elif sample.name == "sglang:cached_tokens_total":
                snap.cached_tokens += sample.value
            elif sample.name == TTFT_HISTOGRAM + "_bucket":
                le = float(sample.labels["le"])
                snap.ttft_buckets[le] = snap.ttft_buckets.get(le, 0.0) + sample.value
            elif sample.name in (STAGE_LATENCY + "_sum", STAGE_LATENCY + "_count"):
                key = sample.labels.get("stage", "") + (":s" if sample.name.endswith("_sum") else ":count")
                snap.stages[key] = snap.stages.get(key, 0.0) + sample.value
            elif sample.name == RESERVED_BYTES:
                tier = sample.labels.get("tier", "")
                snap.reserved_bytes[tier] = snap.reserved_bytes.get(tier, 0.0) + sample.value
            else:
                key = ADMISSION_COUNTERS.get((sample.name, sample.labels.get("cause")))
                if key is not None:
                    snap.admission[key] = snap.admission.get(key, 0.0) + sample.value
    return snap


def tier_used_tokens(text: str) -> float | None:
    """Tokens hiradix's tiers hold, summed over tiers, from one `/metrics` text: 0.0 on a server
    without hiradix, None when the text is empty (`/metrics` did not answer)."""
    if not text:
        return None
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == TIER_USED_TOKENS)


def delta(after: MetricsSnapshot, before: MetricsSnapshot) -> MetricsSnapshot:
    """`after - before`, counter by counter (available only if both are); gauges: `after`'s."""
    return MetricsSnapshot(
        after.prompt_tokens - before.prompt_tokens,
        after.cached_tokens - before.cached_tokens,
        {le: n - before.ttft_buckets.get(le, 0.0) for le, n in after.ttft_buckets.items()},
        after.available and before.available,
        dict(after.reserved_bytes),
        {k: v - before.admission.get(k, 0.0) for k, v in after.admission.items()},
        {k: v - before.stages.get(k, 0.0) for k, v in after.stages.items()},
    )


def total(snapshots: Sequence[MetricsSnapshot]) -> MetricsSnapshot:
    """The sum of several deltas (e.g. one per repetition); gauges: the last snapshot's."""
    out = MetricsSnapshot(available=bool(snapshots) and all(s.available for s in snapshots),
                          reserved_bytes=dict(snapshots[-1].reserved_bytes) if snapshots else {})
    for s in snapshots:
        out.prompt_tokens += s.prompt_tokens
        out.cached_tokens += s.cached_tokens
        for le, n in s.ttft_buckets.items():
            out.ttft_buckets[le] = out.ttft_buckets.get(le, 0.0) + n
        for k, v in s.admission.items():
            out.admission[k] = out.admission.get(k, 0.0) + v
        for k, v in s.stages.items():
            out.stages[k] = out.stages.get(k, 0.0) + v
    return out


def histogram_quantile(buckets: dict, q: float) -> float:
    """The q-quantile (0..1) of a cumulative histogram, linear within a bucket (as PromQL's
    `histogram_quantile`); NaN if empty; the last finite bound if it falls in `+Inf`."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return math.nan
    rank = q * buckets[bounds[-1]]
    prev_le, prev_n = 0.0, 0.0
    for le in bounds:
        n = buckets[le]
        if n >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_n) / (n - prev_n) if n > prev_n else 0.0)
        prev_le, prev_n = le, n
    return prev_le
