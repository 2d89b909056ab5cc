"""The soak (issue 6, item 5): its leak checks on their own, then `scripts/soak` for 32 seconds.

* Unit: `hiradix.testing.resources` sees an extra socket, fd and /dev/shm mapping of this very
  process; modes that others could reach are named; `bench.soak.run.end_checks` reports each kind
  of leak and nothing when the end equals the baseline; the tiers' gauges and summary parse.
* e2e: `scripts/soak --duration-s 32 --check-interval-s 2` on the tiny model (a real server, all tiers churning,
  invariants checked every scheduler step): exit status 0 and a report whose numbers show
  the load really churned every tier and everything came back.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import subprocess
import tempfile
from pathlib import Path

import psutil
import pytest

from bench.soak.run import SUMMARY_RE, Snapshot, SoakConfig, SoakReport, end_checks, parse_tier_tokens
from hiradix.testing.resources import TreeUsage, dir_modes, private_mode_problems, tree_usage

REPO_ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
# The short form of `scripts/soak` in the suite (the full one is 30 minutes, not run by scripts/test):
# 32 s of load (warm-up 4 s), checks every 2 s (~10 periodic checks).
SHORT_SOAK_S = 32


def test_tree_usage_sees_a_new_socket_fd_and_shm_mapping():
    me = [psutil.Process()]
    before = tree_usage(me)
    fd, name = tempfile.mkstemp(dir="/dev/shm", prefix="hiradix-test-")
    try:
        os.ftruncate(fd, mmap.PAGESIZE)
        mapping = mmap.mmap(fd, mmap.PAGESIZE)
        with socket.socket() as sock:
            during = tree_usage(me)
        mapping.close()
    finally:
        os.close(fd)
        os.unlink(name)
    assert during.processes == {os.getpid(): psutil.Process().name()}
    assert during.num_sockets == before.num_sockets + 1
    assert during.num_fds == before.num_fds + 3  # the socket, the shm file and mmap's dup of it
    assert name in during.shm_paths and name not in before.shm_paths
    assert during.rss_bytes >= during.rss_anon_bytes > 0
    assert sock.fileno() == -1  # closed again


def test_fd_kinds_name_the_process_and_each_socket_by_its_peer(tmp_path):
    me = psutil.Process()
    role = tree_usage([me]).fd_kinds
    with socket.socket() as server, socket.socket() as client, socket.socket(socket.AF_UNIX) as unix:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client.connect(("127.0.0.1", port))
        accepted, _ = server.accept()
        unix.bind(str(tmp_path / "u.sock"))
        with accepted:
            during = tree_usage([me])
    added = {k: n - role.get(k, 0) for k, n in during.fd_kinds.items() if n != role.get(k, 0)}
    name = next(iter(added)).split(" ")[0]
    assert name == "pytest" or name.startswith("python") or name.endswith(".py"), added
    assert added == {f"{name} tcp listen": 1, f"{name} tcp in": 1, f"{name} tcp out :{port}": 1, f"{name} unix": 1}
    assert sum(during.fd_kinds.values()) == during.num_fds


def test_dir_modes_and_what_is_not_private(tmp_path):
    root = tmp_path / "nvme"
    root.mkdir(mode=0o700)
    (root / "nvme.kv").touch(mode=0o600)
    (root / "open.kv").touch(mode=0o644)
    (root / "sub").mkdir(mode=0o755)
    (root / "link").symlink_to(root / "nvme.kv")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(root / "s.sock"))
        modes = dir_modes(root)
    assert modes["."] == "dir 0700" and modes["nvme.kv"] == "file 0600"
    assert modes["s.sock"].startswith("socket ")
    assert private_mode_problems(modes) == [
        "link: symlink 0777 (unexpected kind)",
        "open.kv: file 0644 (group/other bits set)",
        "sub: dir 0755 (group/other bits set)",
    ]
    assert dir_modes(tmp_path / "missing") == {}


def _usage(**changes) -> TreeUsage:
    base = dict(processes={1: "python", 2: "sglang::scheduler", 3: "python"}, rss_bytes=1000 * MIB,
                rss_anon_bytes=1500 * MIB, rss_shmem_bytes=12 * MIB, num_fds=179, num_sockets=32,
                shm_paths=["/dev/shm/sglang_loads_x.shm"])  # fmt: skip
    return TreeUsage(**{**base, **changes})


NVME = {".": "dir 0700", "lock": "file 0600", "nvme.kv": "file 0600"}
SOCKETS = {".": "dir 0700", "a-1.acks": "socket 0755", "a-1.jobs": "socket 0755"}
LIVE = ["a-1.acks", "a-1.jobs"]  # the live worker's sockets (generation 1)


def test_a_changed_fd_count_is_named_by_process_and_kind():
    config = SoakConfig(out_dir=Path("."), dram_gb=0.008, rss_slack_bytes=96 * MIB)
    kinds = {"hiradix.io.worker tcp out :50051": 1, "hiradix.io.worker unix": 4, "sglang::scheduler unix": 20}
    baseline = Snapshot(_usage(fd_kinds=kinds), NVME, SOCKETS, LIVE)
    fewer = {**kinds, "hiradix.io.worker tcp out :50051": 0}
    end = Snapshot(_usage(num_fds=178, num_sockets=31, fd_kinds={k: n for k, n in fewer.items() if n}), NVME, SOCKETS, LIVE)
    report = SoakReport(config={}, requests=10, integrity_checking=True, baseline=baseline, end=end)
    assert end_checks(report, config) == [
        "open fds: 179 at the baseline, 178 at the end",
        "sockets: 32 at the baseline, 31 at the end",
        "open fds by process and kind differs from the baseline: added {}, "
        "removed {'hiradix.io.worker tcp out :50051': 1}, changed {}",
    ]
    report.end = Snapshot(_usage(fd_kinds={**kinds, "sglang::scheduler unix": 19, "sglang::scheduler pipe": 1}),
                          NVME, SOCKETS, LIVE)
    assert end_checks(report, config) == []  # the same counts: kinds alone are not judged


def test_pooled_store_connections_are_bounded_not_compared():
    from bench.soak.observe import snapshot_diffs, store_connection_kinds, store_connection_problems

    kinds = {"hiradix.io.worker tcp out :5000": 8, "hiradix.io.worker tcp out :6000": 1,
             "hiradix.io.worker tcp out :7000": 1, "sglang::scheduler unix": 20}  # fmt: skip
    base_usage = _usage(num_fds=179, num_sockets=32, fd_kinds=kinds)
    store_ports = frozenset({5000, 6000})  # a holder's lanes, the master's RPC port; 7000 is not the store's
    assert store_connection_kinds(base_usage, store_ports) == {"hiradix.io.worker tcp out :5000": 8,
                                                               "hiradix.io.worker tcp out :6000": 1}
    baseline = Snapshot(base_usage, NVME, SOCKETS, LIVE, store_connection_kinds(base_usage, store_ports))
    # the pool grew to 16 lanes and the idle RPC connection closed: equal where it counts
    grown = {**kinds, "hiradix.io.worker tcp out :5000": 16}
    del grown["hiradix.io.worker tcp out :6000"]
    end_usage = _usage(num_fds=186, num_sockets=39, fd_kinds=grown)
    end = Snapshot(end_usage, NVME, SOCKETS, LIVE, store_connection_kinds(end_usage, store_ports))
    assert end.comparable() == baseline.comparable() and snapshot_diffs(baseline, end) == []
    assert store_connection_problems(end, 16) == []
    assert store_connection_problems(end, 8) == ["16 connections of the I/O worker to store port 5000, more than its pool's 8"]
    # a connection elsewhere is still compared and named
    leaked = _usage(num_fds=187, num_sockets=40, fd_kinds={**grown, "hiradix.io.worker tcp out :7000": 2})
    end = Snapshot(leaked, NVME, SOCKETS, LIVE, store_connection_kinds(leaked, store_ports))
    assert snapshot_diffs(baseline, end) == [
        "open fds: 170 at the baseline, 171 at the end", "sockets: 23 at the baseline, 24 at the end",
        "open fds by process and kind differs from the baseline: added {}, removed {}, "
        "changed {'hiradix.io.worker tcp out :7000': (1, 2)}"]  # fmt: skip


@pytest.mark.parametrize(
    "end, expected",
    [
        (Snapshot(_usage(num_fds=180), NVME, SOCKETS, LIVE), "open fds: 179 at the baseline, 180 at the end"),
        (Snapshot(_usage(num_sockets=33), NVME, SOCKETS, LIVE), "sockets: 32 at the baseline, 33 at the end"),
        (Snapshot(_usage(processes={1: "python", 2: "sglang::scheduler"}), NVME, SOCKETS, LIVE),
         "processes: 3 at the baseline, 2 at the end"),
        (Snapshot(_usage(shm_paths=["/dev/shm/sglang_loads_x.shm", "/dev/shm/leak"]), NVME, SOCKETS, LIVE),
         "/dev/shm entries held differs from the baseline: added ['/dev/shm/leak']"),
        (Snapshot(_usage(), {**NVME, "nvme.kv.tmp": "file 0600"}, SOCKETS, LIVE), "NVMe directory differs"),
        (Snapshot(_usage(), NVME, {**SOCKETS, "a-0.acks": "socket 0755", "a-0.jobs": "socket 0755"}, LIVE),
         "worker socket directory differs from the baseline: added {'a-0.acks'"),
        (Snapshot(_usage(), NVME, {".": "dir 0700", "a-2.acks": "socket 0755", "a-2.jobs": "socket 0755"},
                  ["a-2.acks", "a-2.jobs"]), "the I/O worker was started again 1 time(s) (generation 1 at the baseline, 2"),
        (Snapshot(_usage(), NVME, {".": "dir 0700"}, []), "worker socket directory differs from the baseline: "
         "added {}, removed {'live worker.acks'"),
        (Snapshot(_usage(rss_bytes=1200 * MIB), NVME, SOCKETS, LIVE), "RSS grew by 200.0 MiB, bound 111.3 MiB"),
    ],
    ids=["fd", "socket", "process", "shm", "nvme-file", "old-worker-sockets-left", "worker-respawned", "no-live-worker", "rss"],
)  # fmt: skip
def test_end_checks_report_each_leak(end, expected):
    config = SoakConfig(out_dir=Path("."), dram_gb=0.008, rss_slack_bytes=96 * MIB)  # bound 2 x 8 MB + 96 MiB
    baseline = Snapshot(_usage(), NVME, SOCKETS, LIVE)
    report = SoakReport(config={}, requests=10, integrity_checking=True, baseline=baseline, end=baseline)
    assert end_checks(report, config) == []
    report.end = end
    problems = end_checks(report, config)
    if not end.worker_sockets:
        assert problems.pop() == "the live I/O worker's sockets not found at the end: []"
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_end_checks_report_failed_requests_missing_checks_and_open_dirs():
    baseline = Snapshot(_usage(), {**NVME, ".": "dir 0755"}, SOCKETS, LIVE)
    report = SoakReport(config={}, requests=10, failed_requests=2, error_samples=["x: HTTP 500"],
                        baseline=baseline, end=baseline)  # fmt: skip
    problems = end_checks(report, SoakConfig(out_dir=Path(".")))
    assert problems == [
        "NVMe directory not private: .: dir 0755 (group/other bits set)",
        "2 of 10 requests failed: ['x: HTTP 500']",
        "HIRADIX_CHECK_INTEGRITY=1 not seen in the scheduler's environment",
    ]


def test_gauges_and_summary_line_parse():
    metrics = (
        '# TYPE sglang:hiradix_tier_used_tokens gauge\n'
        'sglang:hiradix_tier_used_tokens{tier="HBM",tp_rank="0"} 0.0\n'
        'sglang:hiradix_tier_used_tokens{tier="DRAM",tp_rank="0"} 32.0\n'
        'sglang:hiradix_tier_used_tokens{tier="NVMe",tp_rank="0"} 0.0\n'
        'sglang:hiradix_tier_used_tokens_other{tier="HBM"} 7.0\n'
    )
    assert parse_tier_tokens(metrics) == {"HBM": 0.0, "DRAM": 32.0, "NVMe": 0.0}
    line = ("hiradix: tokens per tier HBM/DRAM/NVMe=[0, 16, 0] DRAM pages=1/183 NVMe slots=0/542 "
            "in-flight={'BACKUP': 0}")  # fmt: skip
    assert SUMMARY_RE.findall(line) == [("0", "16", "0", "1", "183", "0", "542")]


def test_config_refuses_a_concurrency_that_forms_no_queue():
    with pytest.raises(ValueError, match="--concurrency 4 must exceed --max-running-requests 4"):
        SoakConfig(out_dir=Path("."), concurrency=4).validate()
    assert SoakConfig(out_dir=Path("."), duration_s=120).warmup == 15.0
    assert SoakConfig(out_dir=Path(".")).warmup == 60.0


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_short_soak_returns_to_baseline(tiny_model, tmp_path):
    out = tmp_path / "soak"
    proc = subprocess.run(
        [str(REPO_ROOT / "scripts" / "soak"), "--duration-s", str(SHORT_SOAK_S), "--check-interval-s", "2", "--model", str(tiny_model),
         "--out-dir", str(out), "--no-progress"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    report = json.loads((out / "soak_report.json").read_text())
    assert proc.returncode == 0, (report["violations"], proc.stdout[-3000:], proc.stderr[-3000:])
    assert report["ok"] and report["violations"] == []
    # The load was real: many requests, queued (concurrency 8 > batch 4), none failed, and
    # histories came back from every tier (NVMe included).
    assert report["requests"] >= 100 and report["failed_requests"] == 0
    assert report["sessions_started"] > report["config"]["concurrency"]  # sessions ended, new ones began
    hits = report["cached_tokens_by_tier"]
    assert hits["device"] > 0 and hits["host"] > 0 and hits["storage"] > 0, hits
    # Checked while it ran: the scheduler proved its invariants every step; periodic checks ran.
    assert report["integrity_checking"] is True
    assert report["periodic_checks"] >= 8 and len(report["rss_samples"]) == report["periodic_checks"]
    assert report["log_errors"] == []
    # After /flush_cache every tier is empty, also in the books.
    assert report["tier_tokens_after_flush"] == {"HBM": 0.0, "DRAM": 0.0, "NVMe": 0.0, "store": 0.0}
    summary = report["summary_after_flush"]
    assert summary["dram_pages_used"] == 0 and summary["nvme_slots_used"] == 0 and summary["nvme_slots"] > 0
    # Everything returned to the baseline; the private directories stayed private.
    baseline, end = report["baseline"], report["end"]
    assert len(baseline["usage"]["processes"]) >= 4  # launcher, scheduler, detokenizer, I/O worker
    assert len(end["usage"]["processes"]) == len(baseline["usage"]["processes"])
    for key in ("num_fds", "num_sockets", "shm_paths"):
        assert end["usage"][key] == baseline["usage"][key], key
    assert end["nvme_dir"] == baseline["nvme_dir"] and end["socket_dir"] == baseline["socket_dir"]
    assert baseline["nvme_dir"]["."] == "dir 0700" and baseline["nvme_dir"]["nvme.kv"] == "file 0600"
    assert baseline["socket_dir"]["."] == "dir 0700" and len(baseline["socket_dir"]) == 3  # two ipc sockets
    assert 0 < report["rss_bound_bytes"] and report["rss_growth_bytes"] <= report["rss_bound_bytes"]
