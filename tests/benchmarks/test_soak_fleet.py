"""The fleet soak's checks on their own (no servers; the soak itself is `scripts/soak-fleet`, 30
minutes, not run by scripts/test): flat series by quarter medians, the store's page size from a
server's gauges, the retry window, and what counts as the same answer."""

from __future__ import annotations

import time

from bench.common.multiturn import RequestRecord
from bench.soak.fleet_checks import flat_violations, flatness, page_bytes, quarter_medians
from bench.soak.fleet_load import FleetLoadStats, RetryWindow, same_answer


def test_flat_and_growing_series():
    assert quarter_medians([5, 1, 3, 9, 9, 9, 9, 2, 4, 6, 8, 7]) == (3, 7)
    flat = flatness("rss", [100, 102, 99, 101] * 3, bound=5)  # first quarter 100, last 101
    growing = flatness("fds", list(range(100, 112)), bound=5)  # first quarter 101, last 110
    assert flat.ok and flat.judged and flat.growth == 1
    assert not growing.ok and growing.growth == 9
    assert flat_violations([flat, growing]) == [
        "fds not flat: first-quarter median 101, last-quarter 110 (growth 9 > bound 5)"]
    short = flatness("short", [1, 100], bound=0)
    assert short.ok and not short.judged  # too few samples to judge
    assert flatness("empty", [], bound=0) is None


def test_page_bytes_from_the_dram_gauges():
    metrics = ('sglang:hiradix_tier_capacity_tokens{tier="DRAM",tp_rank="0"} 2048.0\n'
               'sglang:hiradix_tier_capacity_bytes{tier="DRAM",tp_rank="0"} 4194304.0\n'
               'sglang:hiradix_tier_capacity_bytes{tier="NVMe",tp_rank="0"} 9.0\n')  # fmt: skip
    assert page_bytes(metrics, page_tokens=16) == 32768.0  # 2 KiB per token x 16
    assert page_bytes("", page_tokens=16) is None


def test_retry_window_covers_requests_in_flight_while_open():
    window = RetryWindow()
    before = time.monotonic()
    window.open()
    window.close()
    opened, closed = window.intervals[0]
    assert window.overlaps(before - 5, opened)  # sent before, failed while open
    assert window.overlaps(closed, closed + 1)
    assert not window.overlaps(before - 5, before - 1) and not window.overlaps(closed + 1, closed + 2)


def test_same_answer_compares_text_length_and_token_ids():
    def record(text, ids, n=3):
        r = RequestRecord("x", "s", 0, 0, output_text=text, output_token_ids=ids, completion_tokens=n)
        return r

    assert same_answer(record("ab", [1, 2, 3]), record("ab", [1, 2, 3]))
    assert same_answer(record("ab", None), record("ab", [1, 2, 3]))  # ids compared only when both have them
    assert not same_answer(record("ab", [1, 2, 4]), record("ab", [1, 2, 3]))
    assert not same_answer(record("ab", None, 2), record("ab", None, 3))
    assert not same_answer(record("ab", None), record("ac", None))
    stats = FleetLoadStats(turns=3, failures_outside_window=1, mismatches=1, mismatch_samples=["s turn 0"])
    assert stats.violations()[:2] == ["1 routed requests failed outside a restart window",
                                      "1 routed answers differ from stock: ['s turn 0']"]
