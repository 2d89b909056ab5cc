"""End to end: the NVMe tier survives a server restart (issue 6, restart persistence).

Server 1 (tiny model, HBM 2,048 tokens, DRAM 0.006 GB, NVMe, ``write_back``) runs 8 sessions
x 3 turns, then a 4th turn of every session; then its NVMe writes are held (the fault switch's
hold file) and two new sessions push pages down, so that the group SIGTERM of issue 30 comes
mid-demotion: the scheduler drains (its log says it waits), the hold is released, the writes
land and the log reports them kept, none lost; the server is gone within ``ServerProcess``'s grace
period. Every page the durable index lists then reads back from ``nvme.kv`` (checksums) and none
is an orphan. Server 2, same flags and NVMe path, must re-index exactly those pages (log line
with 0 orphans, metric), serve the 4th-turn prompts again with hits that can only
come from the restored NVMe pages (HBM and DRAM start empty), first page included, and give
token-identical greedy outputs; then ``/flush_cache`` empties every tier (gauges at 0, the prompt
misses) and frees every slot in the durable index (the file on disk has no live page); it is
stopped with Ctrl-C's SIGINT. Server 3 changes ``--page-size`` (another fingerprint): the
slots are not reused, with one log line naming what changed, and nothing hits; it is stopped by
SIGTERM to its launcher. No server leaves its ``/dev/shm`` socket directory behind.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import time
from pathlib import Path

import psutil
import pytest

from hiradix.io.faults import FAULTS_ENV
from hiradix.persistence.index import INDEX_FILE_NAME, Put, _chain, _read_records, _replay
from hiradix.tiers.nvme import NVME_FILE_NAME, NvmeStore

from tests.helpers.e2e import chat, flush_tiers, metric, run_sessions, settled, shm_dirs_of, start, user_turn

pytestmark = pytest.mark.e2e

SESSIONS, TURNS, WORDS = 8, 3, 25
SYSTEM = {"role": "system", "content": "You are a terse assistant."}


def flags(nvme_dir: Path, page_size: int = 16) -> list[str]:
    return [
        "--max-running-requests", "2", "--page-size", str(page_size),
        "--enable-hiradix", "--hiradix-dram-gb", "0.006", "--hiradix-write-policy", "write_back",
        "--hiradix-nvme-path", str(nvme_dir), "--hiradix-nvme-gb", "0.2",
    ]  # fmt: skip


def last_turn_prompts(results: list[list[dict]]) -> list[list[dict]]:
    """Every session's history (dataset of this test: its own answers) plus a new user turn."""
    prompts = []
    for s, session in enumerate(results):
        messages = [SYSTEM]
        for t, r in enumerate(session):
            messages += [{"role": "user", "content": user_turn(s, t, WORDS)}, {"role": "assistant", "content": r["text"]}]
        prompts.append(messages + [{"role": "user", "content": user_turn(s, TURNS, WORDS)}])
    return prompts


def flush_and_repeat(base_url: str, prompt: list[dict]) -> dict:
    """POST /flush_cache; wait (no requests) until every tier gauge reads 0; send ``prompt`` again."""
    flush_tiers(base_url)
    return chat(base_url, prompt)


def stop_mid_demotion(server, hold: Path) -> tuple[float, str]:
    """Hold the NVMe writes, push pages down with two new sessions, SIGTERM the process group while
    writes are held, release them once the scheduler says it drains; (seconds to exit, log)."""
    hold.touch()
    for s in (SESSIONS, SESSIONS + 1):
        chat(server.base_url, [SYSTEM, {"role": "user", "content": user_turn(s, 0, 8 * WORDS)}])
    held = settled(lambda: metric(server.base_url, "sglang:hiradix_transfers_in_flight", kind="DEMOTE"), bool)
    assert held > 0, "no NVMe write in flight"
    server.signal_group(signal.SIGTERM)  # as ServerProcess.stop, systemd
    sent_s = time.monotonic()
    while "hiradix: stop: waiting at most" not in server.log_text():
        assert time.monotonic() - sent_s < server.stop_grace_s, server.log_text()[-3000:]
        time.sleep(0.1)
    hold.unlink()
    assert server.wait_exit(server.stop_grace_s) is not None, "not stopped within the grace period"
    return time.monotonic() - sent_s, server.log_text()


def read_back(nvme_dir: Path, log: str) -> list:
    """The pages the durable index lists, each read from ``nvme.kv`` and verified (its checksum)."""
    rank_dir = nvme_dir / "hiradix-rank0"
    records, _ = _read_records((rank_dir / INDEX_FILE_NAME).read_bytes(), rank_dir)
    pages, orphans = _chain(_replay(records, 1 << 30, 16))
    assert orphans == []
    slots, page_bytes = map(int, re.search(r"NVMe (\d+) slots \((\d+) B pages\)", log).groups())
    with NvmeStore.open(rank_dir / NVME_FILE_NAME, page_bytes, slots, backend="posix") as store:
        bufs = [memoryview(bytearray(page_bytes)) for _ in pages]
        assert store.read_slots([p.slot for p in pages], bufs) == [True] * len(pages)
    return pages


def test_nvme_tier_survives_restart_and_other_fingerprint_is_not_reused(tiny_model: Path, tmp_path: Path):
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    hold = tmp_path / "hold-nvme-writes"
    faults = {FAULTS_ENV: f"store_hold_path={hold}"}
    with start(tiny_model, tmp_path / "s1.log", 2048, flags(nvme_dir), env=faults) as s1:
        prompts = last_turn_prompts(run_sessions(s1.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS))
        before = [chat(s1.base_url, p) for p in prompts]
        nvme_tokens = metric(s1.base_url, "sglang:hiradix_tier_used_tokens", tier="NVMe")
        shm = {"s1": shm_dirs_of(s1)}
        pids = [s1.pid] + [p.pid for p in s1.descendants()]
        assert len(pids) >= 4  # launcher + scheduler + detokenizer + I/O worker
        took_s, log = stop_mid_demotion(s1, hold)
    # The group SIGTERM left no process of the server behind, within the grace period.
    assert [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE] == []
    assert nvme_tokens > 0 and took_s < s1.stop_grace_s
    # The writes in flight landed during the drain: all kept, and counted.
    stopped = re.search(r"hiradix: stop: NVMe writes in flight: (\d+) jobs, (\d+) pages \(\+(\d+) pages of ancestors"
                        r".*; kept (\d+) pages .*, lost (\d+) .*the durable index lists (\d+) pages", log)
    assert stopped, log[-3000:]
    jobs, pages_in_flight, ancestors, kept, lost, listed = map(int, stopped.groups())
    assert jobs > 0 and kept == pages_in_flight + ancestors > 0 and lost == 0, stopped.group(0)
    assert len(read_back(nvme_dir, log)) == listed > 0
    index = nvme_dir / "hiradix-rank0" / "index.log"
    assert stat.S_IMODE(index.stat().st_mode) == 0o600

    with start(tiny_model, tmp_path / "s2.log", 2048, flags(nvme_dir)) as s2:
        after = [chat(s2.base_url, p) for p in prompts]
        restored = metric(s2.base_url, "sglang:hiradix_nvme_restored_pages")
        log = s2.log_text()
        flushed = flush_and_repeat(s2.base_url, prompts[0])
        shm["s2"] = shm_dirs_of(s2)
        s2.signal_group(signal.SIGINT)  # stopped as Ctrl-C in a terminal stops it
        assert s2.wait_exit(60) is not None
    assert flushed["cached"] == 0 and flushed["text"] == before[0]["text"], flushed
    # /flush_cache freed every NVMe slot in the durable index: a restart re-indexes nothing.
    # The slot file keeps its pre-allocated size.
    records, _ = _read_records(index.read_bytes(), index)
    assert any(isinstance(r, Put) for r in records) and _replay(records, 1 << 30, 16) == {}
    assert (nvme_dir / "hiradix-rank0" / "nvme.kv").stat().st_size > 0
    logged = re.search(r"same fingerprint; re-indexed (\d+) pages \((\d+) orphan pages dropped\)", log)
    assert logged and int(logged.group(1)) == restored == listed and logged.group(2) == "0", log[-3000:]
    # Nothing but the restored pages can serve the first request after a restart.
    assert after[0]["cached"] >= 16 and after[0]["cached"] >= after[0]["prompt_tokens"] // 2, after[0]
    assert after[0]["details"].get("device", 0) == 0
    assert sum(r["cached"] for r in after) >= sum(r["prompt_tokens"] for r in after) // 2
    assert [r["text"] for r in after] == [r["text"] for r in before]
    assert [r["completion_tokens"] for r in after] == [r["completion_tokens"] for r in before]

    with start(tiny_model, tmp_path / "s3.log", 2048, flags(nvme_dir, page_size=32)) as s3:
        first = chat(s3.base_url, prompts[0])
        restored = metric(s3.base_url, "sglang:hiradix_nvme_restored_pages")
        log = s3.log_text()
        shm["s3"] = shm_dirs_of(s3)
        os.kill(s3.pid, signal.SIGTERM)  # SGLang's graceful shutdown: SIGTERM to the launcher only
        assert s3.wait_exit(60) == 0
    # Issue 14: a normal shutdown (group SIGTERM, Ctrl-C, launcher SIGTERM) leaves no socket directory.
    assert all(shm[s] for s in shm) and not [d for dirs in shm.values() for d in dirs if d.exists()], shm
    assert restored == 0
    assert len(re.findall(r"was written for another setup \(.*page_size: 16 -> 32", log)) == 1, log[-3000:]
    assert first["cached"] == 0 and first["text"] == before[0]["text"]
