"""End to end under injected NVMe faults (issue 6, reliability): the server keeps serving right tokens.

Real ``sglang.launch_server`` processes on the tiny model with a small HBM pool (1,024 tokens),
a small DRAM tier (0.004 GB, ~120 pages) and an NVMe tier, each with one fault switch
(``HIRADIX_FAULTS`` in the server's environment, read by the I/O worker; see
``hiradix/io/worker.py``). Workload: phase 1 = sessions 0-9 x 4 turns, 10 in flight and 2
running, so histories fall to NVMe and come back from turn 3 on; where the fault switches
the NVMe tier off, phase 2 = sessions 10-13 x 4 turns, sent only once the switch-off warning
is in the log (an event; the idle scheduler still steps every second). Every greedy output
of both phases must equal stock SGLang's (``stock_outputs``).

| fault (switch)                          | the server                          | asserted besides outputs == stock        |
|-----------------------------------------|-------------------------------------|------------------------------------------|
| crash mid-load, once                    | fails the load, respawns the worker | 1 death, generation 2, NVMe hits after it|
| crash mid-transfer, every incarnation   | respawns 3 times, then NVMe off     | 4 deaths, 1 warning, DRAM hits after it  |
| ENOSPC on every store                   | rolls stores back, then NVMe off    | ENOSPC logged, no NVMe hit, 1 warning    |
| short reads                             | misses, then NVMe off               | short reads logged, no NVMe hit, 1 warning|
| one flipped byte per read               | checksum misses, then NVMe off      | mismatches logged, no NVMe hit, 1 warning|
| nvme.kv truncated to 0 at job 20        | misses for the lost slots           | truncation + misses logged, failed loads |
| reads parked 600 s (load timeout 0.5 s) | requests stop waiting, recompute    | latency <= timeout + margin, no NVMe hit |

The six fault servers run one after the other (:class:`Fleet`): the next one starts while
the current one serves, the current one stops in the background; the slow-disk server runs
alone (its latencies are measured). All are stopped by process group also when an assertion
fails.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

from hiradix.testing.server import ServerProcess, cpu_args, cpu_env
from hiradix.core.nvme_link import MAX_NVME_FAILURES_IN_ROW
from hiradix.sglang_plugin.sched_hooks import HELD_WAIT_S
from tests.helpers.e2e import TURNS, WORDS, assert_same_outputs, metric, run_sessions, tiered_flags

pytestmark = pytest.mark.e2e

HBM_TOKENS = 1024
DRAM_GB = "0.004"
PHASE1, PHASE2 = 10, 4  # sessions; phase 2 are sessions 10..13
SWITCH_OFF = b"NVMe tier switched off"
DEATH = b"died with status 86"  # the client's warning about a worker killed by the fault switch
EVENT_TIMEOUT_S = 60.0  # bound for an awaited log line; the idle scheduler steps every 1 s
# Slow disk: a request waits at most LOAD_TIMEOUT_S for its reads, then recomputes. Its whole
# latency (>= TTFT) adds a recompute of <= ~700 tokens and 12 decode steps on the tiny model:
# ~0.3 s on an idle 2-core machine; LATENCY_MARGIN_S leaves 15x that for a busy CI runner and
# still sits far below the 600 s a request would wait if the timeout did not work.
LOAD_TIMEOUT_S = 0.5
LATENCY_MARGIN_S = 5.0


@dataclass
class FaultRun:
    """What one faulty server did (read after its workload, before it stops)."""

    results: list[list[dict]]  # per session (phase 1, then phase 2), per turn
    turn_offsets: list[int]  # log size in bytes before each phase-1 turn was sent
    phase2_offset: Optional[int]  # log size before phase 2 (None: no phase 2)
    metrics: dict[str, float]
    log: bytes
    healthy: bool

    def hits(self, sessions: range, turns: range) -> dict[str, int]:
        """Cached tokens by tier (device/host/storage = HBM/DRAM/NVMe) of those requests."""
        out = {"device": 0, "host": 0, "storage": 0}
        for s in sessions:
            for t in turns:
                for tier in out:
                    out[tier] += self.results[s][t]["details"].get(tier, 0) or 0
        return out


def fault_server(model: Path, tmp: Path, faults: str, hbm_tokens: int = HBM_TOKENS, dram_gb: str = DRAM_GB,
                 timeout_s: float = 2.0) -> ServerProcess:
    flags = tiered_flags(tmp / "nvme", "lru", timeout_s)
    flags[flags.index("--hiradix-dram-gb") + 1] = dram_gb
    env = dict(cpu_env(), HIRADIX_FAULTS=faults)
    return ServerProcess(model, extra_args=cpu_args(hbm_tokens) + flags, env=env, log_path=tmp / "server.log")


def wait_for_log(srv: ServerProcess, text: bytes) -> int:
    """Block until ``text`` is in the server log (polled); returns its offset."""
    deadline_s = time.monotonic() + EVENT_TIMEOUT_S
    while (at := srv.log_path.read_bytes().find(text)) < 0:
        assert time.monotonic() < deadline_s, f"no {text!r} in the log within {EVENT_TIMEOUT_S} s:\n{srv.log_tail()}"
        time.sleep(0.2)
    return at


def run_workload(srv: ServerProcess, phase2_after: Optional[bytes] = None) -> FaultRun:
    """Phase 1; then, if ``phase2_after`` is given, wait for that log line and run phase 2."""
    offsets: list[int] = []
    results = run_sessions(srv.base_url, PHASE1, TURNS, WORDS, parallel=PHASE1,
                           before_turn=lambda t: offsets.append(srv.log_path.stat().st_size))
    phase2_offset = None
    if phase2_after is not None:
        wait_for_log(srv, phase2_after)
        phase2_offset = srv.log_path.stat().st_size
        results += run_sessions(srv.base_url, PHASE2, TURNS, WORDS, parallel=PHASE2, first_session=PHASE1)
    metrics = {
        f"prefetch_{k}": metric(srv.base_url, "sglang:hiradix_prefetch_tokens_total", outcome=k)
        for k in ("started", "completed", "failed")
    }
    for kind in ("DEMOTE", "PREFETCH"):
        metrics[f"failed_{kind}"] = metric(srv.base_url, "sglang:hiradix_failed_transfers_total", kind=kind)
    metrics["skips"] = metric(srv.base_url, "sglang:hiradix_admission_skips_total")
    metrics["nvme_tokens"] = metric(srv.base_url, "sglang:hiradix_tier_used_tokens", tier="NVMe")
    return FaultRun(results, offsets, phase2_offset, metrics, srv.log_path.read_bytes(), srv.is_healthy())


# name -> (HIRADIX_FAULTS, whether phase 2 follows the switch-off), in the order they run
FAULTS = {
    "crash_once": ("crash_mid_load=1,crash_limit=1", False),
    "crash_always": ("crash_mid_job=1", True),
    "enospc": ("enospc_on_store=1", True),
    "short": ("short_read=1", True),
    "corrupt": ("corrupt_read=1", True),
    "truncate": ("truncate_on_job=20,truncate_keep=0", False),
}


class Fleet:
    """The fault servers of this module, run one after the other as the tests ask for them.

    Server k+1 starts (imports, ~25 s of one core) while server k serves its workload, and
    server k stops in the background: never two servers starting at once, as a starting
    scheduler binds ephemeral ports and could take the HTTP port another one picked but has
    not bound yet.
    """

    def __init__(self, model: Path, tmp_path_factory: Any):
        self.model = model
        self.tmp_path_factory = tmp_path_factory
        self.servers: dict[str, ServerProcess] = {}
        self.runs: dict[str, FaultRun] = {}
        self.stoppers: list[threading.Thread] = []

    def _start(self, name: str) -> None:
        srv = fault_server(self.model, self.tmp_path_factory.mktemp(name), FAULTS[name][0])
        self.servers[name] = srv
        srv.start(wait=False)

    def run(self, name: str) -> FaultRun:
        """The workload's outcome on the server with fault ``name`` (run once, then cached)."""
        if name not in self.runs:
            if name not in self.servers:
                self._start(name)
            srv = self.servers[name]
            try:
                srv.wait_healthy()
                later = list(FAULTS)[list(FAULTS).index(name) + 1 :]
                if later and later[0] not in self.servers:
                    self._start(later[0])
                self.runs[name] = run_workload(srv, SWITCH_OFF if FAULTS[name][1] else None)
            finally:
                self.stoppers.append(threading.Thread(target=srv.stop))
                self.stoppers[-1].start()
        return self.runs[name]

    def close(self) -> None:
        """Stop every server (also those started ahead and never used)."""
        for srv in self.servers.values():
            self.stoppers.append(threading.Thread(target=srv.stop))
            self.stoppers[-1].start()
        for stopper in self.stoppers:
            stopper.join()


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory) -> Iterator[Fleet]:
    fleet = Fleet(tiny_model, tmp_path_factory)
    try:
        yield fleet
    finally:
        fleet.close()


def assert_served_right(run: FaultRun, stock: list[list[dict]]) -> None:
    """Still healthy, no scheduler exception, every output equal to stock's."""
    assert run.healthy
    assert b"Traceback" not in run.log
    assert_same_outputs(run.results, stock[: len(run.results)])
    assert all(len(session) == TURNS for session in run.results)


def assert_switched_off_once(run: FaultRun, reason: str) -> None:
    """One switch-off warning naming ``reason``; phase 2 (after it) hits DRAM, never NVMe."""
    lines = [line for line in run.log.splitlines() if SWITCH_OFF in line]
    assert len(lines) == 1, lines
    assert reason.encode() in lines[0], lines[0]
    assert run.phase2_offset is not None and run.log.find(SWITCH_OFF) < run.phase2_offset
    later = run.hits(range(PHASE1, PHASE1 + PHASE2), range(1, TURNS))
    assert later["host"] > 0 and later["storage"] == 0, later
    assert run.metrics["nvme_tokens"] == 0


# ---- the worker crashes ---------------------------------------------------------------------


def test_worker_crash_mid_load_is_respawned_and_nvme_serves_on(fleet, stock_outputs):
    """The first read job dies halfway; its request recomputes; the successor serves reads."""
    run = fleet.run("crash_once")
    assert_served_right(run, stock_outputs)
    assert run.log.count(b"fault switch: halfway through job") == 1 and run.log.count(DEATH) == 1
    assert b"ready (generation 2)" in run.log and b"(generation 3)" not in run.log
    assert run.metrics["failed_PREFETCH"] >= 1  # the load in flight failed (a miss), nothing served from it
    assert SWITCH_OFF not in run.log
    died_at = run.log.find(DEATH)
    after = [t for t, offset in enumerate(run.turn_offsets) if offset > died_at]
    assert after, f"the worker died in the last turn; offsets {run.turn_offsets}, death at {died_at}"
    assert run.hits(range(PHASE1), range(after[0], TURNS))["storage"] > 0  # read by the successor


def test_worker_that_keeps_crashing_is_bounded_and_nvme_switched_off(fleet, stock_outputs):
    """Every incarnation dies mid-transfer: 3 respawns, then NVMe off with one warning."""
    run = fleet.run("crash_always")
    assert_served_right(run, stock_outputs)
    assert run.log.count(DEATH) == 4  # max_respawns (3) + the death that disables the worker
    assert b"ready (generation 4)" in run.log and b"(generation 5)" not in run.log
    assert_switched_off_once(run, "the I/O worker keeps dying")


# ---- the disk fails writes, returns short reads ---------------------------------------------


def test_enospc_rolls_stores_back_then_switches_nvme_off(fleet, stock_outputs):
    """Every NVMe write fails with ENOSPC: nothing lands, 5 failed writes in a row -> NVMe off."""
    run = fleet.run("enospc")
    assert_served_right(run, stock_outputs)
    assert b"No space left on device" in run.log  # the store's own write-error path
    assert run.metrics["failed_DEMOTE"] >= MAX_NVME_FAILURES_IN_ROW
    assert run.metrics["prefetch_started"] == 0 and run.hits(range(PHASE1 + PHASE2), range(TURNS))["storage"] == 0
    assert_switched_off_once(run, f"{MAX_NVME_FAILURES_IN_ROW} NVMe writes in a row failed")


@pytest.mark.parametrize("fault, logged", [
    ("short", rb"short read \(\d+ of \d+ bytes"),  # every read returns half a slot
    ("corrupt", rb"checksum mismatch"),  # one byte of every slot read flipped before verification
], ids=["short-reads", "corrupted-bytes"])
def test_bad_reads_are_misses_never_served_then_switch_nvme_off(fleet, stock_outputs, fault, logged):
    """Short reads and corrupted bytes: every read is a miss (recomputed, caught by the length
    check or the checksum), no such page reaches attention, 5 in a row -> NVMe off."""
    run = fleet.run(fault)
    assert_served_right(run, stock_outputs)
    assert re.search(logged, run.log)
    assert run.metrics["failed_PREFETCH"] >= MAX_NVME_FAILURES_IN_ROW and run.metrics["prefetch_completed"] == 0
    assert run.hits(range(PHASE1 + PHASE2), range(TURNS))["storage"] == 0  # no bad page ever served
    assert_switched_off_once(run, f"{MAX_NVME_FAILURES_IN_ROW} NVMe reads in a row failed")


# ---- the file goes bad ----------------------------------------------------------------------


def test_truncated_file_reads_are_misses(fleet, stock_outputs):
    """nvme.kv is cut to 0 bytes at job 20: slots written before are gone; reading them misses."""
    run = fleet.run("truncate")
    assert_served_right(run, stock_outputs)
    assert b"fault switch: truncated" in run.log
    truncated_at = run.log.find(b"fault switch: truncated")
    after = run.log[truncated_at:]
    assert after.count(b"file truncated?") + after.count(b"bad magic") > 0  # read past the end / in a hole
    assert run.metrics["failed_PREFETCH"] > 0 and run.metrics["prefetch_failed"] > 0
    assert run.log.count(SWITCH_OFF) <= 1


# ---- the disk is slow -----------------------------------------------------------------------


def test_slow_disk_load_never_waits_past_its_timeout(tiny_model: Path, tmp_path: Path, stock_outputs):
    """Every NVMe read is held 30 s; each request waits at most the load timeout, then recomputes.

    HBM 1,024 tokens and DRAM 0.002 GB: the held reads also hold the demotions queued behind
    them in the worker, so DRAM-only nodes stay pinned under HBM-only parents that must be
    evicted. Those evictions abandon the pinned subtrees (``TierBooks.abandon_subtree``); before
    that fix SGLang admitted a prefill it could not allocate ("Prefill out of memory").
    """
    srv = fault_server(tiny_model, tmp_path, "load_delay_s=30", hbm_tokens=1024, dram_gb="0.002", timeout_s=LOAD_TIMEOUT_S)
    with srv:
        got = run_sessions(srv.base_url, 6, TURNS, WORDS)  # one at a time: latency = this request's own
        skips = metric(srv.base_url, "sglang:hiradix_admission_skips_total")
        started = metric(srv.base_url, "sglang:hiradix_prefetch_tokens_total", outcome="started")
        completed = metric(srv.base_url, "sglang:hiradix_prefetch_tokens_total", outcome="completed")
        healthy = srv.is_healthy()
    assert healthy
    assert_same_outputs(got, stock_outputs[:6])
    assert started > 0 and skips > 0, (started, skips)  # requests did wait for reads
    # ... on the I/O results, not in a loop: a held request is skipped at most once per
    # HELD_WAIT_S of its hold (bounded by the load timeout); spinning, this run skipped ~13,000
    requests = sum(len(session) for session in got)
    assert skips <= requests * LOAD_TIMEOUT_S / HELD_WAIT_S, (skips, requests)
    storage = sum(r["details"].get("storage", 0) or 0 for session in got for r in session)
    assert storage <= completed < started  # hits only from reads that landed (late, 30 s on)
    slowest = max(r["latency_s"] for session in got for r in session)
    assert slowest <= LOAD_TIMEOUT_S + LATENCY_MARGIN_S, slowest
