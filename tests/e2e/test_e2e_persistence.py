"""End to end: the NVMe tier survives a server restart (issue 6, restart persistence).

Server 1 (tiny model, HBM 2,048 tokens, DRAM 0.006 GB, NVMe, ``write_back``) runs 8 sessions
x 3 turns, then a 4th turn of every session; small requests drive the scheduler until no
transfer is in flight; it is stopped. Server 2, same flags and NVMe path, must re-index the
durable index (log line and metric), serve the 4th-turn prompts again with hits that can only
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
from pathlib import Path

import psutil
import pytest

from hiradix.persistence.index import Put, _read_records, _replay

from tests.helpers.e2e import chat, flush_tiers, metric, run_sessions, settle_transfers, shm_dirs_of, start, user_turn

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


def test_nvme_tier_survives_restart_and_other_fingerprint_is_not_reused(tiny_model: Path, tmp_path: Path):
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    with start(tiny_model, tmp_path / "s1.log", 2048, flags(nvme_dir)) as s1:
        prompts = last_turn_prompts(run_sessions(s1.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS))
        before = [chat(s1.base_url, p) for p in prompts]
        settle_transfers(s1.base_url)
        nvme_tokens = metric(s1.base_url, "sglang:hiradix_tier_used_tokens", tier="NVMe")
        shm = {"s1": shm_dirs_of(s1)}
        pids = [s1.pid] + [p.pid for p in s1.descendants()]
        assert len(pids) >= 4  # launcher + scheduler + detokenizer + I/O worker
    # ServerProcess.stop (the with block) leaves no process of the server behind.
    assert [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE] == []
    assert nvme_tokens > 0
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
    logged = re.search(r"same fingerprint; re-indexed (\d+) pages", log)
    assert logged and int(logged.group(1)) == restored > 0, log[-3000:]
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
