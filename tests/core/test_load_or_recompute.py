"""Load or recompute (hiradix.core.load_or_recompute): exact answers on hand-computed cases.

Units: 1,000 bytes per token and 1,000 prefill tokens/s, so recomputing a token takes 1 ms and
reading it over a link of B bytes/s takes 1000/B s: the break-even link is 1 MB/s.
"""

from __future__ import annotations

import itertools
import math

import pytest

from hiradix.core.load_or_recompute import request_time_s, split_by_tier, tokens_worth_loading

BPT = 1000.0  # bytes per token
PREFILL = 1000.0  # tokens/s: 1 ms per token
BW = {"hbm": math.inf, "dram": 10e6, "nvme": 2e6, "store": 1e6, "slow": 0.1e6, "fast": 100e6}


def worth(runs, overlap=False, uncached=0, page=1, bw=BW):
    return tokens_worth_loading(runs, bw, BPT, PREFILL, overlap=overlap, uncached_tokens=uncached, page_size=page)


def test_without_overlap_loads_whole_runs_up_to_the_first_slower_than_recompute():
    # dram (0.1 ms/token) and nvme (0.5 ms) beat 1 ms of prefill; store at 1 ms does not (a tie recomputes)
    runs = [("hbm", 16), ("dram", 32), ("nvme", 64), ("store", 128)]
    assert worth(runs) == 16 + 32 + 64
    # stop at the first loser even if a faster tier follows
    assert worth([("dram", 10), ("slow", 10), ("fast", 10)]) == 10
    # HBM is free: always used, whatever follows
    assert worth([("hbm", 48), ("slow", 100)]) == 48
    assert worth([]) == 0 and worth([("dram", 0), ("nvme", 5)]) == 5


def test_slow_link_never_reads_fast_link_always_reads():
    runs = [("store", 1000)]
    assert worth(runs, bw={"store": 0.1e6}) == 0  # 10 ms/token to read vs 1 ms to recompute
    assert worth(runs, bw={"store": 100e6}) == 1000  # 0.01 ms/token
    assert worth(runs, overlap=True, uncached=100, bw={"store": 100e6}) == 1000


def test_overlap_reads_what_the_prefill_of_the_rest_hides():
    # store read 10 ms/token, compute 1 ms/token, 100 cached + 0 uncached: read x hidden while
    # 10x <= 100 - x -> x = 9.09: 9 (max(90, 91) ms) beats 10 (max(100, 90) ms)
    assert worth([("slow", 100)], overlap=True) == 9
    # 1000 uncached tokens (1 s of prefill) hide 100 slow tokens (1 s of read): all of them
    assert worth([("slow", 100)], overlap=True, uncached=1000) == 100
    # a page of 4 tokens: the cut falls on a page boundary: 8 (max(80, 92) ms) beats 12 (120 ms)
    assert worth([("slow", 100)], overlap=True, page=4) == 8
    # equal rates (1 ms each): x <= 200 - x -> half of 200 cached, the rest computed alongside
    assert worth([("store", 200)], overlap=True) == 100


def test_the_choice_is_the_best_leading_run():
    runs_sets = [[("dram", 300), ("store", 500)], [("hbm", 64), ("slow", 256), ("fast", 64)], [("nvme", 700)]]
    for runs, overlap, uncached in itertools.product(runs_sets, (False, True), (0, 50, 5000)):
        k = worth(runs, overlap=overlap, uncached=uncached)
        chosen = request_time_s(runs, k, BW, BPT, PREFILL, overlap=overlap, uncached_tokens=uncached)
        bounds = list(itertools.accumulate(n for _, n in runs))
        others = range(sum(bounds[-1:]) + 1) if overlap else [0, *bounds]  # any cut / whole runs
        for other in others:
            t = request_time_s(runs, other, BW, BPT, PREFILL, overlap=overlap, uncached_tokens=uncached)
            assert chosen <= t + 1e-12, (runs, overlap, uncached, k, other)


def test_request_time_by_hand():
    runs = [("hbm", 10), ("nvme", 20), ("store", 30)]
    # load hbm + nvme: read 20 x 0.5 ms = 10 ms; prefill 30 + 40 = 70 tokens = 70 ms
    assert request_time_s(runs, 30, BW, BPT, PREFILL, uncached_tokens=40) == pytest.approx(0.080)
    assert request_time_s(runs, 30, BW, BPT, PREFILL, overlap=True, uncached_tokens=40) == pytest.approx(0.070)
    assert request_time_s(runs, 0, BW, BPT, PREFILL) == pytest.approx(0.060)
    assert split_by_tier(runs, 35) == {"hbm": 10, "nvme": 20, "store": 5}
    with pytest.raises(ValueError):
        request_time_s(runs, 61, BW, BPT, PREFILL)


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="no read bandwidth for tier 'disk'; given: dram"):
        tokens_worth_loading([("disk", 4)], {"dram": 1.0}, BPT, PREFILL)
    with pytest.raises(ValueError):
        tokens_worth_loading([("dram", -1)], BW, BPT, PREFILL)
    with pytest.raises(ValueError):
        tokens_worth_loading([("dram", 1)], BW, BPT, 0.0)
    with pytest.raises(ValueError):
        tokens_worth_loading([("dram", 1)], {"dram": 0.0}, BPT, PREFILL)
