"""TP = 2 end to end: hiradix with every tier churning vs stock TP = 2, with one rank slower, and
with one rank's I/O worker dying again and again.

SGLang 0.5.23's CPU path runs ``--tp-size 2`` once ``SGLANG_CPU_OMP_THREADS_BIND`` gives each
rank its cores (``hiradix.testing.server.cpu_env(tp_size=2)``). Each rank keeps its own tree,
tiers and I/O worker over its own shard of the KV heads; the ranks agree on every asynchronous
outcome, and on the two switches a rank-local signal flips (NVMe off after worker deaths, the
store's retry), once per step (``hiradix.core.agreement``). The fault switch ``only_rank=1``
applies a fault to rank 1's worker only: ``load_delay_s`` makes its NVMe reads land later than
rank 0's (the agreement must wait for the slower rank, never diverge, never hang);
``crash_mid_job=1`` kills every incarnation of it halfway through its first job, so its client
gives up after 3 respawns while rank 0's worker lives (NVMe must go off on both ranks in the same
step, or their books split and the next step stops the server with "TP ranks disagree").

| server                                   | expected                                                |
|------------------------------------------|---------------------------------------------------------|
| stock RadixAttention, TP 2, big HBM       | the reference outputs                                   |
| hiradix, TP 2, HBM << working set, DRAM + NVMe, rank 1's reads +0.3 s, invariants every step | the same tokens, hits from DRAM and NVMe, every request answered in time, both ranks' workers alive |
| the same, rank 1's worker dies in every job | the same tokens (also after the switch-off), 4 deaths, NVMe off on both ranks, rank 0's worker alive |

The stock server starts with the slow-rank one and stops once it answered; the dying-rank server
starts then, while the slow-rank one serves (never more than two starting at once).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest

from hiradix.testing.server import ServerProcess, cpu_args, cpu_env
from tests.helpers.e2e import TURNS, WORDS, assert_same_outputs, metric, run_sessions, tier_hits

pytestmark = pytest.mark.e2e

SESSIONS = 8
LATER_SESSIONS = 4  # sent to the dying-rank server once NVMe is off on both ranks
ANSWER_WITHIN_S = 60.0  # a tiny-model request takes ~1 s here; a hang would take the client's 300 s
SWITCH_OFF = "NVMe tier switched off"
DEATH = "died with status 86"  # the client's warning about a worker killed by the fault switch
EVENT_TIMEOUT_S = 120.0  # bound for an awaited log line; the idle scheduler steps every 1 s


def tp2(model: Path, log: Path, max_total_tokens: int, extra: list[str], env: dict | None = None) -> ServerProcess:
    return ServerProcess(model, extra_args=cpu_args(max_total_tokens) + ["--tp-size", "2"] + extra,
                         env={**cpu_env(tp_size=2), **(env or {})}, log_path=log, startup_timeout_s=600)


def tiered(model: Path, tmp: Path, name: str, faults: str) -> ServerProcess:
    """hiradix at TP 2: HBM << working set, DRAM + NVMe, invariants every step, ``faults`` on."""
    nvme = tmp / f"nvme-{name}"
    nvme.mkdir()
    flags = ["--max-running-requests", "2", "--enable-hiradix",
             "--hiradix-dram-gb", "0.003", "--hiradix-nvme-path", str(nvme), "--hiradix-nvme-gb", "0.2",
             "--hiradix-load-timeout-s", "5"]  # fmt: skip
    env = {"HIRADIX_CHECK_INTEGRITY": "1", "HIRADIX_FAULTS": faults}
    return tp2(model, tmp / f"{name}.log", 2048, flags, env)


@pytest.fixture(scope="module")
def tp2_servers(tiny_model, tmp_path_factory, request):
    """``(stock outputs of SESSIONS + LATER_SESSIONS sessions, {"slow_rank": ..., "dying_rank": ...})``.

    The stock server and the first hiradix one start at once; the second starts once stock has
    answered (it boots while the first serves). A hiradix server starts only if a selected test
    uses it (its key is part of the test's name)."""
    tmp = tmp_path_factory.mktemp("tp2")
    stock = tp2(tiny_model, tmp / "stock.log", 32768, ["--max-running-requests", "2"])
    servers = {"slow_rank": tiered(tiny_model, tmp, "slow_rank", "load_delay_s=0.3,only_rank=1"),
               "dying_rank": tiered(tiny_model, tmp, "dying_rank", "crash_mid_job=1,only_rank=1")}
    selected = " ".join(item.name for item in request.session.items)
    wanted = [server for name, server in servers.items() if name in selected]
    with contextlib.ExitStack() as stack:
        for server in (stock, *wanted):
            stack.callback(server.stop)
        for server in (stock, *wanted[:1]):  # both start at once; the workloads run one after the other
            server.start(wait=False)
        stock.wait_healthy()
        expected = run_sessions(stock.base_url, SESSIONS + LATER_SESSIONS, TURNS, WORDS,
                                parallel=SESSIONS + LATER_SESSIONS)
        stock.stop()
        for server in wanted[1:]:
            server.start(wait=False)
        yield expected, servers


def io_workers(server: ServerProcess) -> list[str]:
    return [" ".join(p.cmdline()) for p in server.descendants() if "hiradix.io.worker" in " ".join(p.cmdline())]


def test_tp2_tiers_churning_with_one_slow_rank_match_stock(tp2_servers):
    expected, servers = tp2_servers
    hiradix = servers["slow_rank"]
    hiradix.wait_healthy()
    got = run_sessions(hiradix.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS)
    read = metric(hiradix.base_url, "sglang:hiradix_prefetch_tokens_total", outcome="completed")
    workers = io_workers(hiradix)
    log = hiradix.log_text()
    hiradix.stop()  # its cores go to the next server
    assert_same_outputs(got, expected)
    hits = tier_hits(got)
    assert hits["host"] + hits["storage"] > 0 and read > 0, (hits, read)  # DRAM and NVMe served turns
    assert all(r["latency_s"] < ANSWER_WITHIN_S for session in got for r in session)
    assert len(workers) == 2  # one I/O worker per rank, none died
    assert "TP ranks disagree" not in log and "Traceback" not in log


def test_tp2_worker_of_one_dying_rank_switches_nvme_off_on_both_ranks(tp2_servers):
    """Rank 1's worker dies in every job: after its 4th death NVMe goes off on both ranks in the
    same step (rank 0's worker lives on); the server keeps answering with stock's tokens."""
    expected, servers = tp2_servers
    hiradix = servers["dying_rank"]
    hiradix.wait_healthy()
    got = run_sessions(hiradix.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS)
    deadline_s = time.monotonic() + EVENT_TIMEOUT_S
    while hiradix.log_text().count(SWITCH_OFF) < 2:  # one warning per rank
        assert time.monotonic() < deadline_s, f"NVMe not switched off on both ranks:\n{hiradix.log_tail()}"
        time.sleep(0.5)
    later = run_sessions(hiradix.base_url, LATER_SESSIONS, TURNS, WORDS, parallel=LATER_SESSIONS,
                         first_session=SESSIONS)
    nvme_on = [metric(hiradix.base_url, "sglang:hiradix_nvme_enabled", tp_rank=str(r)) for r in (0, 1)]
    workers = io_workers(hiradix)
    log = hiradix.log_text()
    assert_same_outputs(got + later, expected)
    assert all(r["latency_s"] < ANSWER_WITHIN_S for session in got + later for r in session)
    assert "TP ranks disagree" not in log and "Traceback" not in log
    assert log.count(DEATH) == 4  # rank 1's: max_respawns (3) + the death that disables its client
    offs = [line for line in log.splitlines() if SWITCH_OFF in line]
    assert len(offs) == 2 and sum("another TP rank's I/O worker keeps dying" in line for line in offs) == 1, offs
    assert nvme_on == [0, 0]
    assert len(workers) == 1 and '"tp_rank":0' in workers[0], workers  # rank 0's worker never died
