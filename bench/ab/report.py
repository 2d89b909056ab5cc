"""Tables, verdict lines, PNGs and files of `bench.ab.run` (records in, report out).

Every figure is over the requests of all repetitions; a request is keyed by
(repeat, session, turn) and was sent to every system in the same round (`bench.ab.paired`).

    paired TTFT ratio of system A to B: per request TTFT_A / TTFT_B; its median and the 95%
        percentile-bootstrap interval of that median (`bench.common.stats.paired_ratio_ci`; whole
        (repeat, session) groups resampled, as a session's turns are not independent), over the
        requests of turns >= 2 (0-based turn index: every turn with two earlier answers);
    A/A: a duplicate system (`stock2`) against its original; a run (or a repetition) whose A/A
        interval excludes 1.0 is a "biased run": read the other ratios against it;
    prefill tokens computed: prompt - cached tokens, from the responses and from `/metrics`;
    uncached share: prefill tokens computed / prompt tokens, turns >= 2;
    server-side TTFT: the median of SGLang's `sglang:time_to_first_token_seconds` histogram;
    host bytes reserved by hiradix (hiradix systems only): DRAM and NVMe, summed over the server's
        TP ranks (`sglang:hiradix_reserved_bytes`; an MLA model's shared host copy counts once).
Targets (issue 13; printed, not asserted): A/A contains 1.0 with a half-width <= 10%; hiradix
vs ideal <= 1.10x and vs stock <= 0.25x on turns >= 2; hiradix's prefill tokens within 5% of
the ideal's.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from bench.common import server_cpu, server_metrics
from bench.ab.systems import HICACHE, IDEAL, System
from bench.common.multiturn import RequestRecord, write_records
from bench.common.stats import excludes_one, half_width, paired_ratio_ci, paired_ratio_items

LATER_TURN = 2  # "turns >= 2"
TARGET_AA_HALF_WIDTH = 0.10
TARGET_VS_IDEAL = 1.10
TARGET_VS_STOCK = 0.25


@dataclass(frozen=True)
class Goals:
    """The targets a workload is judged by: hiradix's TTFT vs HiCache's (below this ratio) and its
    prefill tokens (at most this share above the ideal's)."""

    vs_hicache: float = 1.0  # faster than stock SGLang HiCache
    prefill_of_ideal: float = 0.05


DEMO_GOALS = Goals()
SPILL_GOALS = Goals(vs_hicache=0.5, prefill_of_ideal=0.02)  # histories several times HBM + DRAM: the paper's case
HOST_TIERS = ("DRAM", "NVMe")  # tiers of `sglang:hiradix_reserved_bytes` the report shows
BIASED = "BIASED RUN"
NOISY = "NOISY RUN"


@dataclass
class SystemRun:
    """One system's requests over all repetitions, and its servers' figures."""

    system: System
    records: list[RequestRecord]
    startup_s: float  # median spawn -> /health over repetitions
    workload_s: float  # time its requests took, summed
    log_path: str
    metrics: list = field(default_factory=list)  # one `server_metrics.MetricsSnapshot` delta per repetition
    cpu: list = field(default_factory=list)  # one `server_cpu.cpu_delta` (role -> CPU s) per repetition


def _key(r: RequestRecord) -> tuple[int, int, int]:
    return (getattr(r, "repeat", 0), r.session_index, r.turn_index)


def identical_fraction(baseline: Sequence[RequestRecord], other: Sequence[RequestRecord]) -> tuple[int, int]:
    """Count requests whose outputs are identical (token ids if both have them, else text).

    Returns:
        `(identical, compared)`: requests matched by (repeat, session, turn) where both succeeded.
    """
    theirs = {_key(r): r for r in other if r.ok}
    identical = compared = 0
    for mine in baseline:
        other_record = theirs.get(_key(mine))
        if not mine.ok or other_record is None:
            continue
        compared += 1
        if mine.output_token_ids is not None and other_record.output_token_ids is not None:
            identical += mine.output_token_ids == other_record.output_token_ids
        else:
            identical += mine.output_text == other_record.output_text
    return identical, compared


def _ttfts(records: Sequence[RequestRecord], keep: Callable[[RequestRecord], bool]) -> dict:
    return {_key(r): r.ttft_s for r in records if r.ok and r.ttft_s is not None and keep(r)}


def compare(a: SystemRun, b: SystemRun, keep: Callable[[RequestRecord], bool] | None = None) -> dict:
    """Paired TTFT ratio a/b: `{"n", "median", "ci": [lo, hi]}` over the requests `keep` selects
    (default: turns >= 2)."""
    keep = keep or (lambda r: r.turn_index >= LATER_TURN)
    items = paired_ratio_items(_ttfts(a.records, keep), _ttfts(b.records, keep))
    # sessions are resampled whole: a session's turns share its history, so they are not independent
    median, lo, hi = paired_ratio_ci([r for _, r in items], groups=[key[:2] for key, _ in items])
    return {"a": a.system.name, "b": b.system.name, "n": len(items), "median": median, "ci": [lo, hi]}


def comparisons(runs: Sequence[SystemRun]) -> list[dict]:
    """The paired comparisons of a run, each tagged `kind`: "vs-baseline", "vs-ideal", "vs-hicache"
    (a hiradix system vs stock HiCache, also as the baseline) or "aa"."""
    by_name = {run.system.name: run for run in runs}
    base, ideal, hicache = runs[0], by_name.get(IDEAL), by_name.get(HICACHE)
    out = []
    for run in runs[1:]:
        dup = run.system.duplicate_of
        if dup and dup in by_name:
            out.append({**compare(run, by_name[dup]), "kind": "aa"})
            continue
        hiradix = "--enable-hiradix" in run.system.server_args
        kind = "vs-ideal" if base is ideal else "vs-hicache" if base is hicache and hiradix else "vs-baseline"
        out.append({**compare(run, base), "kind": kind})
        if ideal is not None and run is not ideal and ideal is not base:
            out.append({**compare(run, ideal), "kind": "vs-ideal"})
        if hicache is not None and hicache is not base and hiradix:
            out.append({**compare(run, hicache), "kind": "vs-hicache"})
    return out


def repeat_comparisons(runs: Sequence[SystemRun]) -> dict[int, list[dict]]:
    """`comparisons` per repetition (`{repeat: [...]}`), to flag a biased repetition."""
    repeats = sorted({getattr(r, "repeat", 0) for run in runs for r in run.records})
    out = {}
    for rep in repeats:
        keep = (lambda r, rep=rep: getattr(r, "repeat", 0) == rep and r.turn_index >= LATER_TURN)
        subset = [SystemRun(run.system, [r for r in run.records if keep(r)], run.startup_s, 0.0, run.log_path)
                  for run in runs]
        out[rep] = comparisons(subset)
    return out


def uncached_share(records: Sequence[RequestRecord]) -> float:
    """Uncached prompt tokens over prompt tokens, summed over the ok requests of turns >= 2."""
    later = [r for r in records if r.ok and r.turn_index >= LATER_TURN]
    prompt = sum(r.prompt_tokens or 0 for r in later)
    return sum((r.prompt_tokens or 0) - (r.cached_tokens or 0) for r in later) / prompt if prompt else math.nan


def prefill_tokens(records: Sequence[RequestRecord]) -> int:
    """Prompt tokens computed (prompt - cached), summed over all ok requests (from the responses)."""
    return sum((r.prompt_tokens or 0) - (r.cached_tokens or 0) for r in records if r.ok)


def host_reserved_bytes(system: System, metrics: server_metrics.MetricsSnapshot) -> Optional[dict]:
    """`{"DRAM": bytes, "NVMe": bytes}` hiradix reserves on the system's server, summed over its TP
    ranks (None where `/metrics` lacked the gauge); None for a system without hiradix."""
    if "--enable-hiradix" not in system.server_args:
        return None
    return {tier: metrics.reserved_bytes.get(tier) for tier in HOST_TIERS}


def host_bytes_line(name: str, reserved: Optional[dict]) -> Optional[str]:
    """`hiradix: host bytes reserved by hiradix: DRAM 37.7 MB, NVMe 0.0 MB (sum over TP ranks)`, or
    None for a system without hiradix (`reserved` None)."""
    if reserved is None:
        return None
    parts = ", ".join(f"{tier} {_fmt(reserved[tier], 1e-6, 0, 1)} MB" for tier in HOST_TIERS)
    return f"{name}: host bytes reserved by hiradix: {parts} (sum over TP ranks)"


def system_figures(run: SystemRun) -> dict:
    """Deterministic and server-side figures of one system (all requests, all repetitions)."""
    m = server_metrics.total(run.metrics)
    return {
        "requests": len(run.records), "errors": sum(not r.ok for r in run.records),
        "prefill_tokens": prefill_tokens(run.records),
        "prefill_tokens_metrics": m.prefill_tokens if m.available else None,
        "uncached_share_later": uncached_share(run.records),
        "server_ttft_median_s": server_metrics.histogram_quantile(m.ttft_buckets, 0.5),
        "ttft_buckets": {str(k): v for k, v in sorted(m.ttft_buckets.items())},
        "startup_s": run.startup_s, "workload_s": run.workload_s,
        "host_reserved_bytes": host_reserved_bytes(run.system, m),
        "cpu_ms_per_request": cpu_ms_per_request(run),
        "admission_per_request": admission_per_request(m.admission, len(run.records)),
    }  # fmt: skip


def cpu_ms_per_request(run: SystemRun) -> Optional[dict]:
    """CPU milliseconds the server's processes spent per request of the workload, by role
    (`bench.common.server_cpu`), over all repetitions; None when not sampled."""
    if not run.cpu or not run.records:
        return None
    return {role: 1e3 * sum(c.get(role, 0.0) for c in run.cpu) / len(run.records) for role in server_cpu.ROLES}


def admission_per_request(counters: dict, requests: int) -> Optional[dict]:
    """Per request of the workload: ms from arrival to admission in SGLang's queue (`queue_ms`), ms
    hiradix held it by cause (`held_ms`), held requests' share and admission skips; None without
    SGLang's queue time."""
    if "queue_s" not in counters or not requests:
        return None
    held = {k.split(":", 1)[1]: 1e3 * v / requests for k, v in counters.items() if k.startswith("held_s:")}
    return {"queue_ms": 1e3 * counters["queue_s"] / requests, "held_ms": held,
            "held_share": counters["held_requests"] / requests if "held_requests" in counters else None,
            "admission_skips": counters["admission_skips"] / requests if "admission_skips" in counters else None}


def admission_line(name: str, per_request: Optional[dict]) -> Optional[str]:
    if per_request is None:
        return None
    line = f"{name}: arrival to admission per request: {per_request['queue_ms']:.1f} ms queued (SGLang's queue time)"
    if per_request["held_share"] is not None:
        causes = ", ".join(f"{cause} {ms:.1f}" for cause, ms in per_request["held_ms"].items())
        line += (f", of it held for reads (ms): {causes}; {per_request['held_share']:.0%} of requests held, "
                 f"{per_request['admission_skips']:.1f} admission skips each")
    return line


def cpu_line(name: str, per_request: Optional[dict]) -> Optional[str]:
    if per_request is None:
        return None
    parts = ", ".join(f"{role} {per_request[role]:.1f}" for role in server_cpu.ROLES if per_request[role] or role == "scheduler")
    return f"{name}: CPU ms per request: {parts}"


def per_turn_summary(runs: Sequence[SystemRun]) -> list[dict]:
    """Per turn index and system: n, median and mean TTFT (s), mean prompt and cached tokens."""
    turns = sorted({r.turn_index for run in runs for r in run.records})
    rows = []
    for turn in turns:
        row: dict = {"turn_index": turn}
        for run in runs:
            ok = [r for r in run.records if r.ok and r.turn_index == turn]
            ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
            row[run.system.name] = {
                "n": len(ok), "median_ttft_s": statistics.median(ttfts) if ttfts else math.nan,
                "mean_ttft_s": _mean(ttfts), "mean_prompt_tokens": _mean(r.prompt_tokens for r in ok),
                "mean_cached_tokens": _mean(r.cached_tokens for r in ok),
            }  # fmt: skip
        rows.append(row)
    return rows


def _mean(values) -> float:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else math.nan


def _fmt(value: Optional[float], scale: float = 1.0, width: int = 8, digits: int = 0) -> str:
    return f"{'-':>{width}}" if value is None or math.isnan(value) else f"{value * scale:>{width}.{digits}f}"


def format_ratio(c: dict) -> str:
    """`0.31x [0.27, 0.36]` (or `-` without paired requests)."""
    if math.isnan(c["median"]):
        return "-"
    return f"{c['median']:.2f}x [{c['ci'][0]:.2f}, {c['ci'][1]:.2f}]"


def format_table(runs: Sequence[SystemRun]) -> str:
    """Per-turn medians and cached tokens, then the paired ratios per repetition (turns >= 2)."""
    names = [run.system.name for run in runs]
    width = max(15, *(len(n) + 2 for n in names))
    ratio_w = max([12] + [len(f"{n}/{names[0]}") + 1 for n in names[1:]])
    lines = [f"{'turn':>4} {'n':>4} |" + "".join(f" {n:^{width}} |" for n in names)
             + "".join(f" {n + '/' + names[0]:>{ratio_w}}" for n in names[1:]),
             f"{'':>9} |" + "".join(f" {'ttft_ms':>{width - 8}} {'cached':>7} |" for _ in names)
             + "".join(f" {'paired':>{ratio_w}}" for _ in names[1:])]
    lines.append("-" * len(lines[1]))
    for row in per_turn_summary(runs):
        turn = row["turn_index"]
        line = f"{turn:>4} {row[names[0]]['n']:>4} |"
        for n in names:
            line += f" {_fmt(row[n]['median_ttft_s'], 1e3, width - 8, 1)} {_fmt(row[n]['mean_cached_tokens'], 1, 7)} |"
        for run in runs[1:]:
            c = compare(run, runs[0], lambda r, t=turn: r.turn_index == t)
            line += f" {_fmt(c['median'], 1, ratio_w, 2)}"
        lines.append(line)
    lines.append("(ttft_ms: median TTFT; cached: mean cached tokens per request; paired: median per-request "
                 "TTFT ratio to the first system)")
    lines.append("")
    lines.append(f"paired TTFT ratios, turns >= {LATER_TURN}, per repetition (median [95% bootstrap CI]):")
    for rep, comps in repeat_comparisons(runs).items():
        parts = [f"{c['a']}/{c['b']} {format_ratio(c)}" for c in comps]
        biased = any(c["kind"] == "aa" and excludes_one(c["ci"]) for c in comps)
        lines.append(f"  repeat {rep}: " + "; ".join(parts) + (f"  <- {BIASED} (A/A interval excludes 1.0)" if biased else ""))
    lines.append("")
    for run in runs:
        f = system_figures(run)
        lines.append(f"{run.system.name}: {f['requests']} requests, {f['errors']} errors, startup {run.startup_s:.0f} s, "
                     f"prefill tokens computed {f['prefill_tokens']} (responses) / "
                     f"{_fmt(f['prefill_tokens_metrics'], 1, 0)} (/metrics), uncached share turns >= {LATER_TURN} "
                     f"{f['uncached_share_later']:.2f}, server-side median TTFT "
                     f"{_fmt(f['server_ttft_median_s'], 1e3, 0, 0)} ms")  # fmt: skip
        host = host_bytes_line(run.system.name, f["host_reserved_bytes"])
        if host is not None:
            lines.append(host)
        for line in (cpu_line(run.system.name, f["cpu_ms_per_request"]),
                     admission_line(run.system.name, f["admission_per_request"])):
            if line is not None:
                lines.append(line)
    for run in runs[1:]:
        same, compared = identical_fraction(runs[0].records, run.records)
        lines.append(f"token-identical outputs {run.system.name} vs {names[0]}: {same}/{compared}"
                     + (f" ({same / compared:.0%})" if compared else ""))
    return "\n".join(lines)


def verdict_lines(runs: Sequence[SystemRun]) -> list[str]:
    """The lines `scripts/demo` ends with: each system vs the baseline and vs the ideal, the A/A
    control (with "BIASED RUN" when its interval excludes 1.0), prefill tokens vs the ideal."""
    comps = comparisons(runs)
    by_name = {run.system.name: run for run in runs}
    lines = []
    for c in comps:
        if c["kind"] == "aa":
            hw = half_width(c["median"], c["ci"])
            if excludes_one(c["ci"]):
                state = (f"{BIASED}: its interval excludes 1.0, so the machine favoured one server, by "
                         f"{abs(c['median'] - 1):.0%}; read the other ratios against it (differences of that "
                         "size are not resolved)")
            elif hw is None or hw > TARGET_AA_HALF_WIDTH:
                state = (f"{NOISY}: the interval contains 1.0 but is wider than +-{TARGET_AA_HALF_WIDTH:.0%}; "
                         "smaller differences are not resolved by this run")
            else:
                state = "unbiased (interval contains 1.0)"
            hw_text = f", half-width {hw:.0%}" if hw is not None else ""
            lines.append(f"A/A {c['a']} vs {c['b']}, turns >= {LATER_TURN}: TTFT {format_ratio(c)} "
                         f"(n={c['n']}{hw_text}): {state}")
        else:
            b = "HiCache" if c["kind"] == "vs-hicache" else c["b"]  # stock SGLang HiCache, by its name
            lines.append(f"{c['a']} vs {b}, turns >= {LATER_TURN}: TTFT {format_ratio(c)} (n={c['n']})")
    ideal = by_name.get(IDEAL)
    if ideal is not None:
        ideal_prefill = prefill_tokens(ideal.records)
        for run in runs[1:]:
            if run is ideal or run.system.duplicate_of:
                continue
            mine = prefill_tokens(run.records)
            ratio = mine / ideal_prefill if ideal_prefill else math.nan
            lines.append(f"{run.system.name} prefill tokens computed: {mine} vs ideal {ideal_prefill} ({ratio:.2f}x)")
    return lines


def targets(runs: Sequence[SystemRun], goals: Goals = DEMO_GOALS) -> list[dict]:
    """The issue's targets that this run has the systems for (`met`: True/False)."""
    out = []
    by_name = {run.system.name: run for run in runs}
    for c in comparisons(runs):
        hiradix = "--enable-hiradix" in by_name[c["a"]].system.server_args
        if c["kind"] == "aa":
            hw = half_width(c["median"], c["ci"])
            out.append({"target": f"A/A {c['a']}/{c['b']} contains 1.0, half-width <= {TARGET_AA_HALF_WIDTH:.0%}",
                        "measured": format_ratio(c),
                        "met": (not excludes_one(c["ci"])) and hw is not None and hw <= TARGET_AA_HALF_WIDTH})
        elif hiradix and c["kind"] == "vs-ideal":
            out.append({"target": f"{c['a']} vs ideal <= {TARGET_VS_IDEAL}x", "measured": format_ratio(c),
                        "met": c["median"] <= TARGET_VS_IDEAL})
        elif hiradix and c["kind"] == "vs-hicache":
            out.append({"target": f"{c['a']} vs HiCache < {goals.vs_hicache}x", "measured": format_ratio(c),
                        "met": c["median"] < goals.vs_hicache})
        elif hiradix and c["b"] == "stock":
            out.append({"target": f"{c['a']} vs stock <= {TARGET_VS_STOCK}x", "measured": format_ratio(c),
                        "met": c["median"] <= TARGET_VS_STOCK})
    ideal = by_name.get(IDEAL)
    for run in runs:
        if ideal is not None and "--enable-hiradix" in run.system.server_args:
            mine, best = prefill_tokens(run.records), prefill_tokens(ideal.records)
            rel = mine / best - 1 if best else math.nan
            # at most that share above the ideal's: fewer is better (partial last pages beat the page-16 ideal)
            out.append({"target": f"{run.system.name} prefill tokens at most {goals.prefill_of_ideal:.0%} above ideal's",
                        "measured": f"{mine} vs {best} ({rel:+.1%})", "met": rel <= goals.prefill_of_ideal})
    return out


def summary(runs: Sequence[SystemRun], goals: Goals = DEMO_GOALS) -> dict[str, Any]:
    """Everything `summary.json` holds."""
    return {
        "per_turn": per_turn_summary(runs), "comparisons": comparisons(runs),
        "per_repeat": {str(k): v for k, v in repeat_comparisons(runs).items()},
        "systems": {run.system.name: {**system_figures(run), **asdict(run.system)} for run in runs},
        "identical_vs_baseline": {run.system.name: identical_fraction(runs[0].records, run.records) for run in runs[1:]},
        "verdicts": verdict_lines(runs), "targets": targets(runs, goals),
    }  # fmt: skip


def write_outputs(runs: Sequence[SystemRun], run_dir: Path, config: dict, goals: Goals = DEMO_GOALS) -> dict:
    """records.json/.csv, summary.json, config.json, ab_verdict.png, ttft_by_turn.png; returns the summary."""
    from bench.ab import plots as ab_plots

    write_records([r for run in runs for r in run.records], run_dir / "records.json", run_dir / "records.csv")
    result = summary(runs, goals)
    (run_dir / "summary.json").write_text(json.dumps(result, indent=1, default=str))
    (run_dir / "config.json").write_text(json.dumps(config, indent=1, default=str))
    ab_plots.plot_verdict(runs, result, run_dir / "ab_verdict.png")
    ab_plots.plot_ttft_by_turn(result["per_turn"], [run.system.name for run in runs], run_dir / "ttft_by_turn.png")
    return result
