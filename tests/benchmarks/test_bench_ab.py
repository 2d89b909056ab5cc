"""Fast tests of the paired A/B pieces: bootstrap intervals, the rotated paired schedule, the
model's-own-answer history, the biased-run flag, verdict lines, `/metrics` figures."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.ab import report as ab_report
from bench.ab import run as ab
from bench.ab import open_report
from bench.ab import servers as ab_servers
from bench.ab.open_loop import OpenLoopConfig, mirrored_order, run_open_loop
from bench.common import server_cpu, server_metrics, stats  # noqa: E402
from bench.common.conversations import Session, synthetic_sessions  # noqa: E402
from bench.common.multiturn import WorkloadConfig, arrival_times_s  # noqa: E402
from bench.ab.paired import PairedConfig, PairedRecord, next_batch, rotation, run_paired, think_time_s  # noqa: E402
from tests.helpers.fake_chat import FakeChatServer  # noqa: E402

# ---------------------------------------------------------------- statistics


def test_paired_statistic_ratio_resamples_the_same_keys_on_both_sides():
    a = {k: 2.0 * (k + 1) for k in range(50)}
    b = {k: float(k + 1) for k in range(60)}  # 10 keys only b has: not compared
    ratio, lo, hi, n = stats.paired_statistic_ratio_ci(a, b, np.mean)
    assert (ratio, lo, hi, n) == (pytest.approx(2.0), pytest.approx(2.0), pytest.approx(2.0), 50)  # paired: exact
    noisy = {k: v * (1.5 if k % 2 else 0.5) for k, v in a.items()}
    ratio, lo, hi, _ = stats.paired_statistic_ratio_ci(noisy, b, np.mean)
    assert lo < ratio < hi
    assert stats.paired_statistic_ratio_ci({1: 1.0}, {2: 1.0})[3] == 0


def test_paired_ratio_ci_median_and_interval():
    ratios = [0.5] * 10 + [0.6] * 10 + [0.7] * 10
    median, lo, hi = stats.paired_ratio_ci(ratios)
    assert median == pytest.approx(0.6)
    assert 0.5 <= lo <= 0.6 <= hi <= 0.7
    assert (median, lo, hi) == stats.paired_ratio_ci(ratios)  # seeded: reproducible
    assert stats.paired_ratio_ci([0.3] * 20) == (0.3, 0.3, 0.3)  # no spread, no width
    wide = stats.paired_ratio_ci([0.4, 0.5, 0.6, 0.7, 0.8] * 2)
    narrow = stats.paired_ratio_ci([0.4, 0.5, 0.6, 0.7, 0.8] * 200)
    assert narrow[2] - narrow[1] < wide[2] - wide[1]  # more requests, a narrower interval
    assert all(math.isnan(x) for x in stats.paired_ratio_ci([]))
    # four sessions, each with ten equal ratios: resampling requests sees 40 independent values,
    # resampling sessions sees four, so its interval must be wider
    values = [0.4] * 10 + [0.8] * 10 + [1.2] * 10 + [1.6] * 10
    groups = [i // 10 for i in range(40)]
    by_request = stats.paired_ratio_ci(values)
    by_session = stats.paired_ratio_ci(values, groups)
    assert by_session[0] == by_request[0] == pytest.approx(1.0)
    assert by_session[2] - by_session[1] > by_request[2] - by_request[1]
    assert by_session[1] >= 0.4 and by_session[2] <= 1.6


def test_paired_ratios_match_keys_and_skip_missing():
    a = {(0, 0, 2): 1.0, (0, 1, 2): 3.0, (0, 2, 2): None, (1, 0, 2): 2.0}
    b = {(0, 0, 2): 2.0, (0, 1, 2): 1.0, (0, 2, 2): 1.0, (1, 0, 2): 0.0, (9, 9, 9): 1.0}
    assert stats.paired_ratios(a, b) == [0.5, 3.0]  # sorted keys; None and 0 denominators dropped


def test_excludes_one_and_half_width():
    assert stats.excludes_one((1.02, 1.3)) and stats.excludes_one((0.5, 0.99))
    assert not stats.excludes_one((0.95, 1.05)) and not stats.excludes_one((math.nan, 2.0))
    assert stats.half_width(1.0, (0.94, 1.08)) == pytest.approx(0.08)
    assert stats.half_width(math.nan, (0.9, 1.1)) is None


# ---------------------------------------------------------------- paired schedule


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_rotation_balances_positions_predecessors_and_the_order_of_every_pair(n):
    names = [f"s{i}" for i in range(n)]
    orders = [rotation(names, r) for r in range(2 * n)]
    assert orders[0][0] == names[0] and orders[n] == orders[0][::-1]
    for order in orders:
        assert sorted(order) == names
    for position in range(n):  # every system twice in every position
        assert sorted(order[position] for order in orders) == sorted(names * 2)
    follows = Counter((order[i - 1], order[i]) for order in orders for i in range(1, n))
    assert len(set(follows.values())) == 1 and len(follows) == n * (n - 1)  # each ordered pair equally often
    for a in names:  # every pair meets at each distance as often in one order as in the other
        for b in names:
            offsets = [order.index(b) - order.index(a) for order in orders]
            assert sorted(offsets) == sorted(-x for x in offsets), (a, b, offsets)
    assert rotation(names, 2 * n + 1) == orders[1]


def test_next_batch_takes_ready_sessions_earliest_first():
    from bench.ab.paired import _SessionState

    sessions = synthetic_sessions(4, 2, seed=0, max_message_chars=20)
    states = [_SessionState(ready_at_s=t) for t in (3.0, 0.5, 0.0, 9.0)]
    states[2].next_turn = 2  # finished
    assert next_batch(states, sessions, now_s=4.0, concurrency=4) == [1, 0]
    assert next_batch(states, sessions, now_s=4.0, concurrency=1) == [1]
    assert next_batch(states, sessions, now_s=0.1, concurrency=4) == []


def test_think_time_is_seeded_exponential():
    assert think_time_s(0.0, 0, 1, 1) == 0.0
    draws = [think_time_s(2.0, 7, s, 1) for s in range(2000)]
    assert draws[:3] == [think_time_s(2.0, 7, s, 1) for s in range(3)]
    assert sum(draws) / len(draws) == pytest.approx(2.0, rel=0.1) and min(draws) > 0


def test_own_answer_history_replaces_the_dataset_answers():
    session = Session("s", ({"role": "user", "content": "u0"}, {"role": "assistant", "content": "d0"},
                            {"role": "user", "content": "u1"}, {"role": "assistant", "content": "d1"},
                            {"role": "user", "content": "u2"}), "synthetic")
    own = session.prompt_messages(2, ["a0", "a1"])
    assert [m["content"] for m in own] == ["u0", "a0", "u1", "a1", "u2"]
    assert [m["content"] for m in session.prompt_messages(2)] == ["u0", "d0", "u1", "d1", "u2"]
    assert session.messages[1]["content"] == "d0"  # the session itself is untouched
    with pytest.raises(ValueError, match="previous answers"):
        session.prompt_messages(2, ["a0"])


def test_run_paired_sends_each_request_to_every_system_with_its_own_history():
    sessions = synthetic_sessions(3, 3, seed=1, max_message_chars=40)
    config = PairedConfig(WorkloadConfig(max_tokens=4, progress=False), concurrency=2, own_answers=True)
    with FakeChatServer(("alpha",)) as a, FakeChatServer(("beta", " beta")) as b:
        urls = {"A": f"http://127.0.0.1:{a.port}", "B": f"http://127.0.0.1:{b.port}"}
        calls = []
        records = asyncio.run(run_paired(urls, sessions, config, lambda rnd, done: calls.append((rnd, done))))
    assert len(records) == 18 and all(r.ok for r in records)
    assert calls == [(0, 2), (1, 4), (2, 6), (3, 8), (4, 9)]  # rounds of 2 (the concurrency), then the last one
    # each (session, turn) in one round, A and B in both positions
    by_key: dict = {}
    for r in records:
        by_key.setdefault((r.session_index, r.turn_index), []).append(r)
    for key, pair in by_key.items():
        assert sorted(r.system for r in pair) == ["A", "B"] and len({r.round_index for r in pair}) == 1
        assert {r.position for r in pair} == {0, 1}
    first = {r.round_index: r.system for r in records if r.position == 0}
    assert [first[r] for r in range(4)] == ["A", "B", "B", "A"]  # rotated, and reversed every other round
    # the history sent to each server carries that server's own answers, never the dataset's
    later_a = [body for body in a.requests if len(body["messages"]) == 5]
    later_b = [body for body in b.requests if len(body["messages"]) == 5]
    assert len(later_a) == len(later_b) == 3
    assert all(m["content"] == "alpha" for body in later_a for m in body["messages"] if m["role"] == "assistant")
    assert all(m["content"] == "beta beta" for body in later_b for m in body["messages"] if m["role"] == "assistant")


# ---------------------------------------------------------------- report


def _runs(factor_aa: float, factor_hiradix: float = 0.3, factor_ideal: float = 0.25, repeats: int = 2,
          jitter: bool = True) -> list[ab_report.SystemRun]:
    names = {"stock": 1.0, "ideal": factor_ideal, "hiradix": factor_hiradix, "stock2": factor_aa}
    runs = []
    for name, factor in names.items():
        records = []
        for rep in range(repeats):
            for s in range(6):
                for t in range(4):
                    base = 1.0 + 0.1 * s + 0.2 * t
                    wiggle = (1 + 0.02 * ((s + t + rep) % 3 - 1)) if jitter and name != "stock" else 1.0
                    records.append(PairedRecord(name, f"s{s}", s, t, ttft_s=base * factor * wiggle,
                                                prompt_tokens=100 * (t + 1), cached_tokens=int(100 * t * (1 - factor) + 0.5),
                                                output_token_ids=[1, 2], repeat=rep))
        system = ab.System(name, ("--enable-hiradix",) if name == "hiradix" else (),
                           duplicate_of="stock" if name == "stock2" else None)
        runs.append(ab_report.SystemRun(system, records, 1.0, 2.0, "log"))
    return runs


def test_verdict_lines_read_at_a_glance():
    lines = ab_report.verdict_lines(_runs(factor_aa=1.0, jitter=False))
    assert "hiradix vs stock, turns >= 2: TTFT 0.30x [0.30, 0.30] (n=24)" in lines
    assert "hiradix vs ideal, turns >= 2: TTFT 1.20x [1.20, 1.20] (n=24)" in lines
    assert "ideal vs stock, turns >= 2: TTFT 0.25x [0.25, 0.25] (n=24)" in lines
    aa = next(line for line in lines if line.startswith("A/A"))
    assert aa == "A/A stock2 vs stock, turns >= 2: TTFT 1.00x [1.00, 1.00] (n=24, half-width 0%): unbiased (interval contains 1.0)"
    # per session and repeat: prompts 100+200+300+400, cached 0+70+140+210 (hiradix), 0+75+150+225 (ideal)
    assert "hiradix prefill tokens computed: 6960 vs ideal 6600 (1.05x)" in lines
    assert not any(line.startswith(("stock2 prefill", "stock prefill")) for line in lines)


def test_an_ideal_baseline_is_compared_once_and_still_judged_as_the_ideal():
    """With the ideal first (`--systems ideal,hiradix,...`), hiradix vs ideal is printed once, not
    as the baseline and again as the ideal, and the target against the ideal is still judged."""
    runs = _runs(factor_aa=1.0, jitter=False)
    runs = [runs[1], runs[2], runs[0]]  # ideal, hiradix, stock
    lines = ab_report.verdict_lines(runs)
    assert len(lines) == len(set(lines)), lines
    assert lines.count("hiradix vs ideal, turns >= 2: TTFT 1.20x [1.20, 1.20] (n=24)") == 1
    assert {t["target"] for t in ab_report.targets(runs)} >= {"hiradix vs ideal <= 1.1x"}


def test_biased_run_is_flagged_in_table_and_verdict():
    runs = _runs(factor_aa=1.4)
    table = ab_report.format_table(runs)
    repeat_lines = [line for line in table.splitlines() if line.strip().startswith("repeat ")]
    assert len(repeat_lines) == 2 and all("BIASED RUN" in line for line in repeat_lines)
    aa = next(line for line in ab_report.verdict_lines(runs) if line.startswith("A/A"))
    assert "BIASED RUN" in aa and "1.40x" in aa
    noisy = _runs(factor_aa=1.0)
    for r in noisy[3].records:  # stock2: 0.5x stock in odd sessions, 1.6x in even ones
        r.ttft_s *= 0.5 if r.session_index % 2 else 1.6
    aa = next(line for line in ab_report.verdict_lines(noisy) if line.startswith("A/A"))
    assert "NOISY RUN" in aa and "BIASED" not in aa
    fair = ab_report.format_table(_runs(factor_aa=1.0))
    assert "BIASED RUN" not in fair
    met = {t["target"]: t["met"] for t in ab_report.targets(_runs(factor_aa=1.0))}
    assert met["A/A stock2/stock contains 1.0, half-width <= 10%"] is True
    assert met["hiradix vs ideal <= 1.1x"] is False and met["hiradix vs stock <= 0.25x"] is False


def test_spill_goals_judge_prefill_within_two_percent_and_half_of_hicache():
    """`--spill` is judged by its own goals: prefill tokens within 2% of the ideal's (the demo: 5%)."""
    runs = _runs(factor_aa=1.0, jitter=False)  # stock, ideal, hiradix, stock2
    ideal_cached = {(r.repeat, r.session_index, r.turn_index): r.cached_tokens for r in runs[1].records}

    def judged(extra_prefill_per_request: int) -> tuple[bool, bool, str]:
        for r in runs[2].records:
            r.cached_tokens = ideal_cached[(r.repeat, r.session_index, r.turn_index)] - extra_prefill_per_request
        demo = {t["target"]: t for t in ab_report.targets(runs)}["hiradix prefill tokens at most 5% above ideal's"]
        spill = {t["target"]: t for t in ab_report.targets(runs, ab_report.SPILL_GOALS)}
        return demo["met"], spill["hiradix prefill tokens at most 2% above ideal's"]["met"], demo["measured"]

    assert judged(0) == (True, True, "6600 vs 6600 (+0.0%)")
    assert judged(3) == (True, False, "6744 vs 6600 (+2.2%)")  # 48 requests x 3 tokens
    assert judged(10)[:2] == (False, False)
    assert ab_report.SPILL_GOALS.vs_hicache == 0.5 and ab_report.DEMO_GOALS.vs_hicache == 1.0
    # --spill's baseline is HiCache: hiradix vs it is still judged as "vs HiCache" (0.3x of it here)
    runs[0].system = ab.System("hicache", ())
    met = {t["target"]: t["met"] for t in ab_report.targets(runs, ab_report.SPILL_GOALS)}
    assert met["hiradix vs HiCache < 0.5x"] is True
    assert "hiradix vs HiCache, turns >= 2: TTFT 0.30x [0.30, 0.30] (n=24)" in ab_report.verdict_lines(runs)

METRICS_TEXT = """# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{is_streaming="false"} 11.0
sglang:prompt_tokens_total{is_streaming="true"} 989.0
# TYPE sglang:cached_tokens_total counter
sglang:cached_tokens_total{cache_source="device"} 300.0
sglang:cached_tokens_total{cache_source="host"} 100.0
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1"} 0.0
sglang:time_to_first_token_seconds_bucket{le="0.2"} 4.0
sglang:time_to_first_token_seconds_bucket{le="0.4"} 8.0
sglang:time_to_first_token_seconds_bucket{le="+Inf"} 10.0
sglang:time_to_first_token_seconds_count 10.0
sglang:time_to_first_token_seconds_sum 2.5
"""


def test_metrics_snapshot_delta_and_histogram_median():
    after = server_metrics.parse_snapshot(METRICS_TEXT)
    assert (after.prompt_tokens, after.cached_tokens, after.prefill_tokens) == (1000.0, 400.0, 600.0)
    before = server_metrics.MetricsSnapshot(100.0, 50.0, {0.1: 0.0, 0.2: 1.0, 0.4: 1.0, math.inf: 1.0}, True)
    d = server_metrics.delta(after, before)
    assert d.prefill_tokens == 550.0 and d.ttft_buckets[math.inf] == 9.0 and d.available
    assert server_metrics.histogram_quantile(after.ttft_buckets, 0.5) == pytest.approx(0.25)  # 5th of 10 in (0.2, 0.4]
    assert server_metrics.histogram_quantile(after.ttft_buckets, 1.0) == pytest.approx(0.4)  # +Inf: last bound
    assert math.isnan(server_metrics.histogram_quantile({}, 0.5))
    assert not server_metrics.parse_snapshot("").available


def test_tier_used_tokens_sums_the_tiers_and_tells_no_answer_from_zero():
    text = METRICS_TEXT + "\n".join([
        "# TYPE sglang:hiradix_tier_used_tokens gauge",
        'sglang:hiradix_tier_used_tokens{tier="HBM"} 32.0',
        'sglang:hiradix_tier_used_tokens{tier="DRAM"} 16.0',
        'sglang:hiradix_tier_used_tokens{tier="NVMe"} 0.0', ""])
    assert server_metrics.tier_used_tokens(text) == 48.0
    assert server_metrics.tier_used_tokens(METRICS_TEXT) == 0.0  # a server without hiradix
    assert server_metrics.tier_used_tokens("") is None  # /metrics did not answer: never "empty"


RESERVED_TEXT = "\n".join([
    "# TYPE sglang:hiradix_reserved_bytes gauge",
    'sglang:hiradix_reserved_bytes{tier="DRAM",tp_rank="0"} 3.7748736e+07',
    'sglang:hiradix_reserved_bytes{tier="DRAM",tp_rank="1"} 0.0',  # maps rank 0's copy (MLA under TP)
    'sglang:hiradix_reserved_bytes{tier="NVMe",tp_rank="0"} 2.0e+07',
    'sglang:hiradix_reserved_bytes{tier="NVMe",tp_rank="1"} 0.0', ""])


def test_reserved_bytes_sum_the_ranks_and_keep_the_latest_value():
    """A gauge: summed over TP ranks per tier; a delta or a total keeps the latest, never subtracts."""
    snap = server_metrics.parse_snapshot(METRICS_TEXT + RESERVED_TEXT)
    assert snap.reserved_bytes == {"DRAM": 37748736.0, "NVMe": 2e7}
    per_rank = RESERVED_TEXT.replace('"1"} 0.0', '"1"} 1.0e+06')  # --hiradix-mla-host-copy rank
    assert server_metrics.parse_snapshot(per_rank).reserved_bytes == {"DRAM": 38748736.0, "NVMe": 2.1e7}
    assert server_metrics.parse_snapshot(METRICS_TEXT).reserved_bytes == {}  # a server without hiradix
    d = server_metrics.delta(snap, snap)  # before == after: still the reserved bytes, not 0
    assert d.reserved_bytes == {"DRAM": 37748736.0, "NVMe": 2e7} and d.prefill_tokens == 0.0
    later = server_metrics.parse_snapshot(per_rank)
    assert server_metrics.total([d, later]).reserved_bytes == later.reserved_bytes  # the last repetition's
    assert server_metrics.total([]).reserved_bytes == {}


def test_host_bytes_are_reported_for_hiradix_systems_only():
    runs = _runs(factor_aa=1.0, jitter=False)
    for run in runs:  # every server exports the same text; only hiradix's system reports it
        run.metrics = [server_metrics.parse_snapshot(METRICS_TEXT + RESERVED_TEXT)]
    table = ab_report.format_table(runs)
    host_lines = [line for line in table.splitlines() if "host bytes reserved" in line]
    assert host_lines == ["hiradix: host bytes reserved by hiradix: DRAM 37.7 MB, NVMe 20.0 MB (sum over TP ranks)"]
    figures = ab_report.summary(runs)["systems"]
    assert figures["hiradix"]["host_reserved_bytes"] == {"DRAM": 37748736.0, "NVMe": 2e7}
    assert figures["stock"]["host_reserved_bytes"] is None and figures["ideal"]["host_reserved_bytes"] is None
    hiradix = next(run for run in runs if run.system.name == "hiradix")
    lacking = ab_report.host_reserved_bytes(hiradix.system, server_metrics.MetricsSnapshot())  # no gauge in /metrics
    assert ab_report.host_bytes_line("x", lacking) == "x: host bytes reserved by hiradix: DRAM - MB, NVMe - MB (sum over TP ranks)"


ADMISSION_TEXT = "\n".join([
    "# TYPE sglang:queue_time_seconds histogram",
    "sglang:queue_time_seconds_sum 3.0",
    "sglang:queue_time_seconds_count 20.0",
    "# TYPE sglang:hiradix_admission_wait_seconds_total counter",
    'sglang:hiradix_admission_wait_seconds_total{cause="nvme_read"} 1.5',
    'sglang:hiradix_admission_wait_seconds_total{cause="dram_room"} 0.5',
    "# TYPE sglang:hiradix_held_requests_total counter",
    "sglang:hiradix_held_requests_total 4.0",
    "# TYPE sglang:hiradix_admission_skips_total counter",
    "sglang:hiradix_admission_skips_total 30.0", ""])


def test_arrival_to_admission_is_split_by_cause_per_request():
    """SGLang's queue time for every system; hiradix's holds by cause, its held share and admission
    skips where it reports them; a delta of two snapshots counts only the measured requests."""
    before = server_metrics.parse_snapshot(ADMISSION_TEXT.replace("3.0", "1.0").replace("30.0", "10.0"))
    after = server_metrics.parse_snapshot(ADMISSION_TEXT)
    d = server_metrics.delta(after, before)
    assert d.admission["queue_s"] == 2.0 and d.admission["admission_skips"] == 20.0
    assert d.admission["held_s:nvme_read"] == 0.0 and d.admission["held_s:dram_room"] == 0.0
    per = ab_report.admission_per_request(after.admission, 10)
    assert per["queue_ms"] == pytest.approx(300.0) and per["held_share"] == pytest.approx(0.4)
    assert per["held_ms"] == {"nvme_read": pytest.approx(150.0), "dram_room": pytest.approx(50.0)}
    assert ab_report.admission_line("hiradix", per) == (
        "hiradix: arrival to admission per request: 300.0 ms queued (SGLang's queue time), of it held for reads (ms): "
        "nvme_read 150.0, dram_room 50.0; 40% of requests held, 3.0 admission skips each")
    stock = ab_report.admission_per_request(server_metrics.parse_snapshot(ADMISSION_TEXT.split("# TYPE sglang:hiradix")[0]).admission, 10)
    assert ab_report.admission_line("stock", stock) == "stock: arrival to admission per request: 300.0 ms queued (SGLang's queue time)"
    assert ab_report.admission_per_request({}, 10) is None  # no queue time reported


def test_start_servers_gives_every_server_the_tp_size(monkeypatch, tmp_path):
    started = []

    class FakeServer:
        base_url, startup_s = "http://fake", 1.0

        def __init__(self, model_path, extra_args, env, startup_timeout_s, log_path):
            started.append((list(extra_args), env))

        def start(self, wait):
            return self

        def wait_healthy(self):
            pass

        def stop(self):
            pass

    monkeypatch.setattr(ab_servers, "ServerProcess", FakeServer)
    systems = ab.resolve_systems("stock,hiradix", [], [], [])
    with ab.contextlib.ExitStack() as stack:
        ab.start_servers(stack, systems, "m", 2048, tmp_path, 60.0, tp_size=2)
    assert len(started) == 2
    for args, env in started:
        assert args[args.index("--tp-size") + 1] == "2" and env["SGLANG_CPU_OMP_THREADS_BIND"]


def test_ideal_pool_holds_the_working_set():
    sessions = synthetic_sessions(2, 3, seed=0, max_message_chars=100)
    own = ab.working_set_tokens(sessions, 32, lambda text: 10, own_answers=True)
    assert own == 2 * (3 * (10 + ab.TEMPLATE_TOKENS_PER_MESSAGE) + 2 * ab.TEMPLATE_TOKENS_PER_MESSAGE + 3 * 32)
    assert ab.ideal_pool_tokens(own) >= own * 1.25 and ab.ideal_pool_tokens(own) % 1024 == 0
    systems = ab.with_ideal_pool(ab.resolve_systems("stock,ideal,stock2", [], [], []), 8192)
    assert [(s.name, s.max_total_tokens, s.duplicate_of) for s in systems] == [
        ("stock", None, None), ("ideal", 8192, None), ("stock2", None, "stock")]
    with pytest.raises(ValueError, match="--max-total-tokens"):
        ab.check_fits(sessions, 32, 50, lambda text: 10, own_answers=True)


def test_hicache_without_its_ram_reserve_stops_before_any_server_starts():
    """SGLang keeps 10 GiB free when it sizes HiCache's host pool; with less available the run
    says so up front instead of ending in a dead server's traceback (review of issue 17)."""
    from bench.ab.systems import HICACHE_RESERVE_BYTES, hicache_memory_problem

    low = 8 << 30
    problem = hicache_memory_problem(["stock", "hiradix", "hicache"], low)
    assert problem is not None and "'hicache'" in problem and "8.0 GiB is available" in problem
    assert "--systems stock,ideal,hiradix,ideal2" in problem
    assert hicache_memory_problem(["stock", "hicache2"], low) is not None  # an A/A copy too
    assert hicache_memory_problem(["stock", "hiradix"], low) is None
    assert hicache_memory_problem(["hicache"], HICACHE_RESERVE_BYTES + 1) is None


def test_hiradix_fp8_system_gets_the_cold_format_and_the_same_nvme_bytes(tmp_path):
    """Issue 21: `hiradix-fp8` is hiradix's defaults plus fp8 cold pages, with the NVMe size every
    hiradix system of the run gets (the same bytes, so it holds more tokens)."""
    systems = ab.resolve_systems("hiradix,hiradix-fp8", [], [], [])
    sized = ab.with_tier_sizes(systems, 2.0, 0.5, 1 << 20, tmp_path)
    plain, fp8 = (list(s.server_args) for s in sized)
    assert fp8[fp8.index("--hiradix-cold-format") + 1] == "fp8" and "--hiradix-cold-format" not in plain
    assert fp8[fp8.index("--hiradix-nvme-gb") + 1] == plain[plain.index("--hiradix-nvme-gb") + 1]


BURN = """import sys, time, setproctitle
setproctitle.setproctitle(sys.argv[1])
start = time.process_time()
while time.process_time() - start < 0.3:
    pass
print("burnt", flush=True)
sys.stdin.read()
"""


def test_server_cpu_seconds_are_counted_per_role():
    """Processes titled as SGLang titles its scheduler and detokenizer, and hiradix's worker
    command line, each burn 0.3 s of CPU: each lands in its role; the root is the launcher."""
    import psutil

    titles = {"scheduler": "sglang::scheduler_TP0", "detokenizer": "sglang::detokenizer",
              "io_worker": "python -m hiradix.io.worker --spec {}"}
    procs = [subprocess.Popen([sys.executable, "-c", BURN, t], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for t in titles.values()]  # fmt: skip
    try:
        assert [p.stdout.readline() for p in procs] == ["burnt\n"] * 3
        me = psutil.Process()
        cpu = server_cpu.cpu_seconds_by_role([me, *(psutil.Process(p.pid) for p in procs)], me.pid)
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(timeout=30)
    for role in titles:
        assert 0.3 <= cpu[role] < 5.0, (role, cpu)
    assert cpu["launcher"] > 0 and cpu["other"] == 0.0
    assert server_cpu.cpu_delta(cpu, dict.fromkeys(server_cpu.ROLES, 0.1))["scheduler"] == pytest.approx(cpu["scheduler"] - 0.1)


# ---------------------------------------------------------------- open loop


def test_open_loop_sends_arrivals_in_order_bounded_in_flight_one_turn_per_session_at_a_time():
    """`--open-loop`: each arrival sends the next turn of the session ready longest, never more than
    max_in_flight requests at once, a session's turns in order with its own answers, and a request
    is never sent before its arrival."""
    sessions = synthetic_sessions(3, 3, seed=2, max_message_chars=40)
    config = OpenLoopConfig(WorkloadConfig(max_tokens=4, progress=False, seed=5), rate_per_s=200.0, max_in_flight=2)
    with FakeChatServer(("alpha",)) as server:
        records = asyncio.run(run_open_loop(f"http://127.0.0.1:{server.port}", "A", sessions, config))
    assert len(records) == 9 and all(r.ok for r in records)
    assert [r.round_index for r in records] == list(range(9))
    assert [r.arrival_s for r in records] == arrival_times_s(9, 200.0, 5)
    assert all(r.start_s >= r.arrival_s for r in records)
    assert [(r.session_index, r.turn_index) for r in records[:3]] == [(0, 0), (1, 0), (2, 0)]  # ready in order
    in_flight, peak, open_turns = 0, 0, {}
    for kind, first_user, n_messages in server.events:
        in_flight += 1 if kind == "start" else -1
        peak = max(peak, in_flight)
        if kind == "start":
            assert first_user not in open_turns, "two turns of one session in flight"
            open_turns[first_user] = n_messages
        else:
            del open_turns[first_user]
    assert peak == 2
    for session in range(3):
        turns = [r.turn_index for r in records if r.session_index == session]
        assert turns == [0, 1, 2]
    later = [body for body in server.requests if len(body["messages"]) == 5]
    assert len(later) == 3 and all(m["content"] == "alpha" for body in later for m in body["messages"]
                                   if m["role"] == "assistant")


def test_open_loop_runs_systems_alone_in_mirrored_orders_and_reports_means_and_p90s():
    assert mirrored_order(["a", "b", "c"], 0) == ["a", "b", "c"] and mirrored_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    runs = _runs(factor_aa=1.0, jitter=False)  # stock, ideal (0.25x), hiradix (0.3x), stock2 (1.0x)
    ratios = {(r["a"], r["b"]): r for r in open_report.open_loop_ratios(runs)}
    assert set(ratios) == {("hiradix", "ideal"), ("stock2", "stock")}
    assert ratios[("hiradix", "ideal")]["mean"]["ratio"] == pytest.approx(1.2)
    assert ratios[("hiradix", "ideal")]["p90"]["ratio"] == pytest.approx(1.2)
    assert ratios[("stock2", "stock")]["mean"]["ci"] == pytest.approx((1.0, 1.0))
    d = open_report.ttft_distribution(runs[0])  # stock, turns >= 2 (0-based): 1.0 + 0.1 s + 0.2 t, t = 2, 3
    assert d["n"] == 24 and d["mean"] == pytest.approx(1.75) and d["p50"] == pytest.approx(1.75)
    lines = open_report.open_loop_lines(runs, 1.0, 4)
    assert any(line.startswith("hiradix vs ideal, open loop, turns >= 2: TTFT mean 1.20x") for line in lines)
    assert open_report.stage_split(runs[0]) is None  # no /metrics figures in these runs
