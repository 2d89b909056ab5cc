"""End to end: real `sglang.launch_server` processes on the tiny model, hiradix vs stock.

* Foundation: 5 sessions x 4 turns through /v1/chat/completions at temperature 0 (float32):
  outputs token-identical to stock SGLang, cached_tokens > 0 from turn 2, hiradix in the log.
* Tiers: an HBM pool far smaller than the working set, a small DRAM tier and an NVMe tier;
  20 sessions x 4 turns interleaved so histories fall to NVMe; from turn 2 hits come from
  DRAM and NVMe (per-request cached_tokens_details), outputs identical to a stock server
  whose HBM holds everything.
* Faults (a slow disk, a crashing worker, ENOSPC, bad reads, a truncated file): see
  tests/e2e/test_e2e_faults.py.

Servers are stopped by PID (whole process group) also when an assertion fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.e2e import (
    SESSIONS,
    TURNS,
    WORDS,
    assert_same_outputs,
    metric,
    run_sessions,
    start,
    tier_hits,
    tiered_flags,
)

pytestmark = pytest.mark.e2e

# stock_outputs: tests/conftest.py (one stock run per session, shared by the e2e modules)


def test_foundation_sessions_match_stock(tiny_model: Path, tmp_path: Path, stock_outputs):
    """5 sessions x 4 turns, HBM-sized so nothing is evicted: hiradix == stock RadixAttention."""
    with start(tiny_model, tmp_path / "hiradix.log", 8192, ["--enable-hiradix", "--hiradix-dram-gb", "0.05"]) as srv:
        got = run_sessions(srv.base_url, 5, TURNS, WORDS)
        log = srv.log_text()
    assert "hiradix: HiRadixCache in use" in log
    assert_same_outputs(got, stock_outputs[:5])
    for s in range(5):
        for t in range(1, TURNS):
            assert got[s][t]["cached"] > 0, (s, t, got[s][t])


@pytest.fixture(scope="module")
def tiered_runs(tiny_model: Path, tmp_path_factory) -> dict[str, list[list[dict]]]:
    """The same queued workload on hiradix `lru` and `lookahead`, HBM << working set."""
    runs = {}
    for policy in ("lru", "lookahead"):
        tmp = tmp_path_factory.mktemp(policy)
        with start(tiny_model, tmp / "server.log", 2048, tiered_flags(tmp / "nvme", policy)) as srv:
            runs[policy] = run_sessions(srv.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS)
            runs[policy + "_prefetch_started"] = metric(srv.base_url, "hiradix_prefetch_tokens_total", outcome="started")
    return runs


def test_tiers_histories_return_from_dram_and_nvme(tiered_runs, stock_outputs):
    """Issue 3: from turn 2 hits come from DRAM and NVMe; outputs equal stock with a big HBM."""
    got = tiered_runs["lru"]
    assert_same_outputs(got, stock_outputs)
    hits = tier_hits(got)
    assert hits["host"] > 0, hits
    assert hits["storage"] > 0, hits


def test_lookahead_serves_more_hits_from_dram_than_lru(tiered_runs, stock_outputs):
    """Issue 4: with a queue, the look-ahead window prefetches and protects queued prefixes."""
    assert_same_outputs(tiered_runs["lookahead"], stock_outputs)
    la, lru = tier_hits(tiered_runs["lookahead"]), tier_hits(tiered_runs["lru"])
    share = {name: h["host"] / max(1, sum(h.values())) for name, h in (("lookahead", la), ("lru", lru))}
    assert share["lookahead"] > share["lru"], (la, lru)
    assert tiered_runs["lookahead_prefetch_started"] > 0
    assert tiered_runs["lru_prefetch_started"] == 0 or share["lookahead"] > share["lru"]
