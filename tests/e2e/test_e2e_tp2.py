"""TP = 2 end to end: hiradix with every tier churning, one rank's NVMe reads slower, vs stock TP = 2.

SGLang 0.5.23's CPU path runs ``--tp-size 2`` once ``SGLANG_CPU_OMP_THREADS_BIND`` gives each
rank its cores (``hiradix.testing.server.cpu_env(tp_size=2)``). Each rank keeps its own tree,
tiers and I/O worker over its own shard of the KV heads; the ranks agree on every asynchronous
outcome once per step (``hiradix.runtime.rank_sync``). The fault switch ``only_rank=1`` makes
rank 1's worker take ``load_delay_s`` longer for every NVMe read, so the two ranks' reads land
at different times: the agreement must wait for the slower rank, never diverge, never hang.

| server                                   | expected                                                |
|------------------------------------------|---------------------------------------------------------|
| stock RadixAttention, TP 2, big HBM       | the reference outputs                                   |
| hiradix, TP 2, HBM << working set, DRAM + NVMe, rank 1's reads +0.3 s, invariants every step | the same tokens, hits from DRAM and NVMe, every request answered in time, both ranks' workers alive |
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from hiradix.testing.server import ServerProcess, cpu_args, cpu_env
from tests.helpers.e2e import TURNS, WORDS, assert_same_outputs, metric, run_sessions, tier_hits

pytestmark = pytest.mark.e2e

SESSIONS = 8
ANSWER_WITHIN_S = 60.0  # a tiny-model request takes ~1 s here; a hang would take the client's 300 s


def tp2(model: Path, log: Path, max_total_tokens: int, extra: list[str], env: dict | None = None) -> ServerProcess:
    return ServerProcess(model, extra_args=cpu_args(max_total_tokens) + ["--tp-size", "2"] + extra,
                         env={**cpu_env(tp_size=2), **(env or {})}, log_path=log, startup_timeout_s=600)


def test_tp2_tiers_churning_with_one_slow_rank_match_stock(tiny_model, tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    flags = ["--max-running-requests", "2", "--enable-hiradix",
             "--hiradix-dram-gb", "0.003", "--hiradix-nvme-path", str(nvme), "--hiradix-nvme-gb", "0.2",
             "--hiradix-load-timeout-s", "5"]  # fmt: skip
    env = {"HIRADIX_CHECK_INTEGRITY": "1", "HIRADIX_FAULTS": "load_delay_s=0.3,only_rank=1"}
    stock = tp2(tiny_model, tmp_path / "stock.log", 32768, ["--max-running-requests", "2"])
    hiradix = tp2(tiny_model, tmp_path / "server.log", 2048, flags, env)
    with contextlib.ExitStack() as stack:
        for server in (stock, hiradix):  # both start at once; the workloads run one after the other
            stack.callback(server.stop)
            server.start(wait=False)
        stock.wait_healthy()
        expected = run_sessions(stock.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS)
        stock.stop()
        hiradix.wait_healthy()
        got = run_sessions(hiradix.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS)
        read = metric(hiradix.base_url, "sglang:hiradix_prefetch_tokens_total", outcome="completed")
        workers = [p for p in hiradix.descendants() if "hiradix.io.worker" in " ".join(p.cmdline())]
        log = hiradix.log_text()
    assert_same_outputs(got, expected)
    hits = tier_hits(got)
    assert hits["host"] + hits["storage"] > 0 and read > 0, (hits, read)  # DRAM and NVMe served turns
    assert all(r["latency_s"] < ANSWER_WITHIN_S for session in got for r in session)
    assert len(workers) == 2  # one I/O worker per rank, none died
    assert "TP ranks disagree" not in log and "Traceback" not in log
