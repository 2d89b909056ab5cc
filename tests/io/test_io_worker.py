"""The NVMe I/O worker: protocol, a real worker process over real ipc:// sockets, death and respawn.

Every worker here is a real process on real sockets; the NVMe file sits on the temp dir's
disk. Races are made deterministic with events, never sleeps: a ``Pong`` proves that every
job sent before its ``Ping`` is in the worker's hands (the fault switch's delay keeps it
there), and a process's exit is awaited through a pidfd.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import psutil
import pytest
import zmq

from hiradix.io.client import IOWorkerClient, WorkerStartError
from hiradix.io.protocol import (
    JobDone,
    LoadPages,
    Ping,
    Pong,
    ProtocolError,
    Ready,
    Rejected,
    Shutdown,
    StartFailed,
    StorePages,
    WorkerSpec,
    decode_reply,
    decode_request,
    encode,
    make_endpoints,
    validate_job,
)
from hiradix.io.worker import Faults
from hiradix.tiers.files import ensure_private_dir

from tests.helpers.io import NUM_DRAM_PAGES, NUM_NVME_SLOTS, WAIT_S, fill, kill_and_reap, page_bytes, wait_exit, wait_for


# ---- protocol (no process) ------------------------------------------------------------------

REQUESTS = [
    StorePages(job_id=1, dram_pages=[0, 5], nvme_slots=[63, 2]),
    LoadPages(job_id=2, nvme_slots=[7], dram_pages=[31]),
    Ping(seq=9),
    Shutdown(),
]
REPLIES = [
    Ready(pid=1234),
    StartFailed(reason="no such file"),
    JobDone(job_id=1, ok=[True, False], error="", duration_s=0.5),
    Pong(seq=9),
    Rejected(job_id=-1, reason="malformed"),
]


_BASELINE_CHILDREN: set[int] = set()


@pytest.fixture(autouse=True)
def _children_baseline():
    """Processes this test process already had (e.g. multiprocessing's resource tracker)."""
    _BASELINE_CHILDREN.clear()
    _BASELINE_CHILDREN.update(p.pid for p in psutil.Process().children(recursive=True))
    yield


def new_children() -> list[psutil.Process]:
    """Child processes started since the test began, not by a process it already had (the
    session's servers, started at collection's end, may still be spawning theirs)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.pid not in _BASELINE_CHILDREN and not {a.pid for a in p.parents()} & _BASELINE_CHILDREN:
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_request_round_trip(msg):
    # encode -> decode gives the same message back; a reply decoder refuses it
    assert decode_request(encode(msg)) == msg
    with pytest.raises(ProtocolError):
        decode_reply(encode(msg))


@pytest.mark.parametrize("msg", REPLIES, ids=lambda m: type(m).__name__)
def test_reply_round_trip(msg):
    assert decode_reply(encode(msg)) == msg
    with pytest.raises(ProtocolError):
        decode_request(encode(msg))


BAD_REQUESTS = {
    "empty": b"",
    "not-msgpack": b"\xc1\xc1\xc1",
    "truncated": encode(StorePages(job_id=1, dram_pages=[1, 2], nvme_slots=[3, 4]))[:-1],
    "unknown-tag": msgspec.msgpack.encode(["EvictAll", 1]),
    "wrong-field-type": msgspec.msgpack.encode(["StorePages", 1, ["a"], [2]]),
    "missing-field": msgspec.msgpack.encode(["LoadPages", 1, [2]]),
    "trailing-bytes": encode(Ping(seq=1)) + b"\x00",
}


@pytest.mark.parametrize("buf", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_decode_rejects_malformed(buf):
    with pytest.raises(ProtocolError, match="malformed request"):
        decode_request(buf)


def test_encode_refuses_non_messages():
    with pytest.raises(TypeError):
        encode({"job_id": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("job", "expected"),
    [
        (StorePages(job_id=0, dram_pages=[0, 31], nvme_slots=[0, 63]), ""),
        (StorePages(job_id=-1, dram_pages=[0], nvme_slots=[0]), "job_id must be >= 0"),
        (StorePages(job_id=1, dram_pages=[32], nvme_slots=[0]), "dram_pages out of range"),
        (LoadPages(job_id=1, nvme_slots=[64], dram_pages=[0]), "nvme_slots out of range"),
        (LoadPages(job_id=1, nvme_slots=[-1], dram_pages=[0]), "nvme_slots out of range"),
        (LoadPages(job_id=1, nvme_slots=[1, 2], dram_pages=[0]), "2 nvme_slots"),
        (LoadPages(job_id=1, nvme_slots=[1, 2], dram_pages=[3, 3]), "dram_pages has duplicates"),
        (StorePages(job_id=1, dram_pages=[1, 2], nvme_slots=[5, 5]), "nvme_slots has duplicates"),
    ],
)
def test_validate_job(job, expected):
    reason = validate_job(job, NUM_DRAM_PAGES, NUM_NVME_SLOTS)
    assert (reason == "") if expected == "" else (expected in reason), reason


def test_spec_json_round_trip(spec):
    assert WorkerSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ProtocolError):
        WorkerSpec.from_json('{"dram_path": 3}')


def test_fault_switch_syntax():
    assert Faults.parse("") == Faults()
    assert Faults.parse("crash_on_job=3, delay_s=0.5") == Faults(crash_on_job=3, delay_s=0.5)
    assert Faults.parse("crash_mid_job=2") == Faults(crash_mid_job=2)
    for bad in ("crash=1", "delay_s", "delay_s=abc", "crash_on_job=-1"):
        with pytest.raises(ValueError, match="HIRADIX_FAULTS"):
            Faults.parse(bad)


def test_endpoint_paths_are_bounded():
    with pytest.raises(ValueError, match="shorter socket_dir"):
        make_endpoints("/tmp/" + "x" * 120, "abcd", 1)


# ---- a worker driven by hand over raw sockets -----------------------------------------------


def test_worker_rejects_bad_messages_and_keeps_serving(spec, pool):
    # A raw peer (no client) so that garbage reaches the worker exactly as sent.
    ensure_private_dir(Path(spec.socket_dir))
    ends = make_endpoints(spec.socket_dir, "raw", 1)
    ctx = zmq.Context()
    acks = ctx.socket(zmq.PULL)
    acks.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
    acks.bind(ends.acks)
    proc = subprocess.Popen([sys.executable, "-m", "hiradix.io.worker", "--spec", spec.to_json(),
                             "--jobs", ends.jobs, "--acks", ends.acks])
    jobs = ctx.socket(zmq.PUSH)
    try:
        assert decode_reply(acks.recv()) == Ready(pid=proc.pid)
        jobs.connect(ends.jobs)
        for buf in (b"\xc1garbage", msgspec.msgpack.encode(["EvictAll", 1]), encode(Pong(seq=1))):
            jobs.send(buf)
        jobs.send(encode(StorePages(job_id=11, dram_pages=[0, 99], nvme_slots=[0, 1])))
        jobs.send(encode(LoadPages(job_id=12, nvme_slots=[0, 1], dram_pages=[2])))
        jobs.send(encode(LoadPages(job_id=13, nvme_slots=[0, 1], dram_pages=[4, 4])))
        jobs.send(encode(Ping(seq=7)))
        replies = [decode_reply(acks.recv()) for _ in range(7)]
        # three undecodable messages -> Rejected(-1); three invalid jobs -> Rejected(id); Pong last
        assert [type(r) for r in replies] == [Rejected] * 6 + [Pong]
        assert [r.job_id for r in replies[:6]] == [-1, -1, -1, 11, 12, 13]
        assert "dram_pages out of range" in replies[3].reason
        assert replies[6] == Pong(seq=7)
        # ... and it still does real work: store 2 pages
        fill(pool, range(2), seed=1)
        jobs.send(encode(StorePages(job_id=14, dram_pages=[0, 1], nvme_slots=[0, 1])))
        assert decode_reply(acks.recv()).ok == [True, True]
        jobs.send(encode(Shutdown()))
        assert proc.wait(timeout=WAIT_S) == 0  # Shutdown -> exit 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        jobs.close(linger=0)
        acks.close(linger=0)
        ctx.term()


# ---- through the client ---------------------------------------------------------------------


def test_store_then_load_is_byte_identical(make_client, pool):
    client = make_client()
    fill(pool, range(8), seed=42)
    originals = [page_bytes(pool, p) for p in range(8)]
    assert all(page_bytes(pool, 16 + i) != originals[i] for i in range(8))  # zeros before the load
    # store DRAM [0..7] -> NVMe [40..47]
    client.submit(StorePages(job_id=1, dram_pages=list(range(8)), nvme_slots=list(range(40, 48))))
    assert client.in_flight() == {1}
    assert wait_for(client, {1})[1].ok == [True] * 8
    # load NVMe [40..47] -> other DRAM pages [16..23], plus a never-written slot 5 -> page 24
    pool.tensor[24].fill_(7.0)
    before_24 = page_bytes(pool, 24)
    client.submit(LoadPages(job_id=2, nvme_slots=[*range(40, 48), 5], dram_pages=[*range(16, 24), 24]))
    done = wait_for(client, {2})[2]
    assert done.ok == [True] * 8 + [False]  # slot 5 fails its checksum
    assert done.error == ""
    assert [page_bytes(pool, 16 + i) for i in range(8)] == originals
    assert page_bytes(pool, 24) == before_24  # a failed load leaves the page untouched
    assert client.in_flight() == set()


def test_a_worker_without_a_compressed_tier_moves_pages_without_torch(make_client, pool):
    # Pages are opaque bytes to the worker: it imports torch (~2 s of CPU, ~0.3 GB per TP rank)
    # only for a compressed tier's codec.
    client = make_client()
    fill(pool, range(2), seed=7)
    client.submit(StorePages(job_id=1, dram_pages=[0, 1], nvme_slots=[3, 4]))
    assert wait_for(client, {1})[1].ok == [True, True]
    client.submit(LoadPages(job_id=2, nvme_slots=[3, 4], dram_pages=[10, 11]))
    assert wait_for(client, {2})[2].ok == [True, True]
    assert [page_bytes(pool, p) for p in (10, 11)] == [page_bytes(pool, p) for p in (0, 1)]
    assert "libtorch" not in Path(f"/proc/{client.pid}/maps").read_text()  # tests/io/test_cold_pages: with one


def test_invalid_job_comes_back_as_rejected_failure(make_client):
    client = make_client()
    client.submit(StorePages(job_id=3, dram_pages=[0, NUM_DRAM_PAGES], nvme_slots=[0, 1]))
    done = wait_for(client, {3})[3]
    assert done.ok == [False, False]
    assert done.error.startswith("rejected: dram_pages out of range")
    with pytest.raises(ValueError, match="already in flight"):
        client.submit(LoadPages(job_id=4, nvme_slots=[0], dram_pages=[0]))
        client.submit(LoadPages(job_id=4, nvme_slots=[1], dram_pages=[1]))
    assert client.ping(WAIT_S)  # still up


def test_kill_while_in_flight_fails_jobs_and_respawns(make_client, pool, monkeypatch):
    client = make_client(faults="delay_s=600")  # every job parks for 10 min: surely in flight
    client.submit(StorePages(job_id=1, dram_pages=[0, 1, 2], nvme_slots=[0, 1, 2]))
    client.submit(LoadPages(job_id=2, nvme_slots=[10], dram_pages=[9]))
    assert client.ping(WAIT_S)  # Pong -> jobs 1 and 2 reached the worker
    assert client.poll() == [] and client.in_flight() == {1, 2}
    monkeypatch.setenv("HIRADIX_FAULTS", "")  # the successor runs without the delay
    old_pid = kill_and_reap(client)
    # both in-flight jobs come back as failures, once each
    got = {d.job_id: d for d in client.poll()}
    assert got == {
        1: JobDone(job_id=1, ok=[False] * 3, error="worker died"),
        2: JobDone(job_id=2, ok=[False], error="worker died"),
    }
    assert client.in_flight() == set() and client.poll() == []
    assert client.pid not in (None, old_pid) and client.respawns == 1 and not client.disabled
    # the new worker serves the next job
    fill(pool, range(1), seed=3)
    client.submit(StorePages(job_id=3, dram_pages=[0], nvme_slots=[0]))
    assert wait_for(client, {3})[3].ok == [True]
    assert client.check_alive() is True


def test_crash_mid_store_leaves_no_wrong_kv(make_client, pool, monkeypatch):
    client = make_client(faults="crash_mid_job=1")  # job #1 writes 4 of its 8 pages, then dies
    fill(pool, range(8), seed=5)
    client.submit(StorePages(job_id=1, dram_pages=list(range(8)), nvme_slots=list(range(8))))
    pid = client.pid
    assert wait_exit(pid)
    monkeypatch.setenv("HIRADIX_FAULTS", "")
    assert client.check_alive() is False
    assert client.poll() == [JobDone(job_id=1, ok=[False] * 8, error="worker died")]
    # the successor reads back the half that reached the disk; the rest are misses
    client.submit(LoadPages(job_id=2, nvme_slots=list(range(8)), dram_pages=list(range(16, 24))))
    assert wait_for(client, {2})[2].ok == [True] * 4 + [False] * 4
    assert [page_bytes(pool, 16 + i) for i in range(4)] == [page_bytes(pool, i) for i in range(4)]
    assert all(not any(page_bytes(pool, 16 + i)) for i in range(4, 8))  # untouched zeros


def test_respawn_is_bounded(make_client):
    client = make_client(faults="crash_on_job=1", max_respawns=2)  # every worker dies on its 1st job
    pids = []
    for job_id in (1, 2, 3):
        pids.append(client.pid)
        client.submit(LoadPages(job_id=job_id, nvme_slots=[0], dram_pages=[0]))
        assert wait_exit(pids[-1])
        assert client.check_alive() is False
        assert client.poll() == [JobDone(job_id=job_id, ok=[False], error="worker died")]
        # deaths 1 and 2 -> respawned; death 3 exceeds max_respawns=2 -> disabled
        assert client.disabled is (job_id == 3)
    assert len(set(pids)) == 3 and client.respawns == 2 and client.pid is None
    assert new_children() == []
    client.submit(StorePages(job_id=4, dram_pages=[1], nvme_slots=[1]))  # fails at once
    assert client.poll() == [JobDone(job_id=4, ok=[False], error="worker disabled")]
    assert client.check_alive() is False


def test_socket_dir_is_private_and_close_leaves_nothing(make_client, spec):
    client = make_client()
    socket_dir = Path(spec.socket_dir)
    assert stat.S_IMODE(socket_dir.stat().st_mode) == 0o700
    socket_files = client.endpoints.paths()
    assert all(p.is_socket() and p.parent == socket_dir for p in socket_files)
    worker = psutil.Process(client.pid)
    assert new_children() == [worker]
    client.close()
    assert not worker.is_running()
    assert new_children() == []
    assert not any(p.exists() for p in socket_files) and not socket_dir.exists()
    client.close()  # idempotent


def test_start_failures_are_reported(spec, monkeypatch):
    # a missing DRAM file -> StartFailed from the worker -> WorkerStartError naming the cause
    missing = msgspec.structs.replace(spec, dram_path=spec.dram_path + ".missing")
    with pytest.raises(WorkerStartError, match="FileNotFoundError"):
        IOWorkerClient(missing, ready_timeout_s=WAIT_S).start()
    # a bad fault switch is refused, not ignored
    monkeypatch.setenv("HIRADIX_FAULTS", "explode=1")
    with pytest.raises(WorkerStartError, match="HIRADIX_FAULTS"):
        IOWorkerClient(spec, ready_timeout_s=WAIT_S).start()
    assert new_children() == []
    # a socket dir others can enter is refused before anything is spawned
    open_dir = Path(spec.socket_dir).with_name("open")
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    with pytest.raises(PermissionError, match="0700"):
        IOWorkerClient(msgspec.structs.replace(spec, socket_dir=str(open_dir))).start()


def test_spec_must_name_this_process_as_parent(spec):
    with pytest.raises(ValueError, match="parent_pid"):
        IOWorkerClient(msgspec.structs.replace(spec, parent_pid=1))


PARENT_SCRIPT = """
import os, sys, msgspec
from hiradix.io.client import IOWorkerClient
from hiradix.io.protocol import WorkerSpec
spec = msgspec.structs.replace(WorkerSpec.from_json(sys.argv[1]), parent_pid=os.getpid())
client = IOWorkerClient(spec, ready_timeout_s=60)
client.start()
print(client.pid, flush=True)
sys.stdin.read()  # block until the test kills this process
"""


def test_worker_exits_when_its_parent_dies(spec):
    parent = subprocess.Popen([sys.executable, "-c", PARENT_SCRIPT, spec.to_json()],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    worker_pid = None
    try:
        line = parent.stdout.readline()
        assert line.strip().isdigit(), f"parent did not start its worker: {line!r}"
        worker_pid = int(line)
        assert psutil.Process(worker_pid).ppid() == parent.pid
        parent.kill()  # SIGKILL: no close(), no Shutdown
        parent.wait()
        assert wait_exit(worker_pid), "the orphaned worker kept running"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdin.close()
        parent.stdout.close()
        if worker_pid is not None and psutil.pid_exists(worker_pid) and not wait_exit(worker_pid, 0):
            os.kill(worker_pid, signal.SIGKILL)  # the worker this test started, by pid


def test_wait_returns_when_a_wake_socket_is_readable(make_client):
    """The scheduler waits on the I/O results and on its own request socket: a request arriving
    ends the wait at once, with no result; a result ends it too, whatever the timeout."""
    client = make_client(faults="load_delay_s=600")  # the read parks: no result for 10 min
    client.submit(LoadPages(job_id=1, nvme_slots=[0], dram_pages=[0]))
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        start = time.monotonic()
        assert client.wait(0.2, wake=[pull]) == []  # nothing: the timeout
        assert time.monotonic() - start >= 0.2
        push.send(b"request")
        start = time.monotonic()
        assert client.wait(WAIT_S, wake=[pull]) == []  # the request: at once
        assert time.monotonic() - start < WAIT_S / 2
        client.submit(StorePages(job_id=2, dram_pages=[1], nvme_slots=[1]))  # not delayed: lands
        pull.recv()  # served: no longer readable
        done = client.wait(WAIT_S, wake=[pull])
        assert [d.job_id for d in done] == [2] and done[0].ok == [True]
    finally:
        pull.close(0)
        push.close(0)
        ctx.term()
