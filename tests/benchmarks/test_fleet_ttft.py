"""TTFT per phase of the fleet soak (bench/soak/fleet_ttft.py): turns split at the soak's events."""

from __future__ import annotations

from bench.soak.fleet_ttft import TtftSample, phase_line, ttft_by_phase

ORIGIN_S = 5000.0  # the monotonic time the soak's events are counted from


def test_turns_fall_into_the_phase_their_routed_request_started_in():
    events = [("holder 0 restart", 600.0, 10.4), ("server b restart", 1200.0, 62.9)]
    samples = ([TtftSample(ORIGIN_S + t, 0.010, 0.008) for t in range(0, 600, 6)]  # 100 turns, 10 ms
               + [TtftSample(ORIGIN_S + 600.0, 0.500, 0.009), TtftSample(ORIGIN_S + 700.0, 0.020, None)]  # the restart's slow turn
               + [TtftSample(ORIGIN_S + 1500.0, None, 0.007)])  # fmt: skip
    rows = ttft_by_phase(samples, events, ORIGIN_S)
    assert [r["phase"] for r in rows] == ["from start", "from holder 0 restart", "from server b restart"]
    assert [(r["begin_s"], r["end_s"], r["turns"]) for r in rows] == [(0.0, 600.0, 100), (600.0, 1200.0, 2),
                                                                      (1200.0, None, 1)]  # fmt: skip
    first, second, third = rows
    assert first["routed_p50_ms"] == first["routed_p99_ms"] == 10.0 and first["stock_p99_ms"] == 8.0
    # numpy's linear percentiles of [20, 500] ms
    assert second["routed_p50_ms"] == 260.0 and second["routed_p99_ms"] == 495.2 and second["stock_p50_ms"] == 9.0
    assert third["routed_p99_ms"] is None and third["stock_p99_ms"] == 7.0  # no content: no routed TTFT
    assert phase_line(second) == ("TTFT from holder 0 restart (600 s - 1200 s, 2 turns): fleet p50/p99 "
                                  "260.0/495.2 ms, stock 9.0/9.0 ms")  # fmt: skip
    # a turn before the origin belongs to no phase
    assert [r["turns"] for r in ttft_by_phase([TtftSample(ORIGIN_S - 1, 0.01, 0.01)], events, ORIGIN_S)] == [0, 0, 0]
