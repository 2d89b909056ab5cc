"""Scheduler-side handle of the NVMe I/O worker: spawn, submit, poll, liveness, respawn.

The client never blocks on disk. ``submit`` queues a job id and its page ids on a socket;
``poll`` drains the replies. Every submitted job gets exactly one ``JobDone`` from ``poll``:
the worker's, or one synthesized here when the worker rejected the job (``"rejected: ..."``),
died with the job in flight (``"worker died"``), or is disabled (``"worker disabled"``).
A synthesized failure is always safe for the cache: a failed store is rolled back, a failed
load is a miss. It is issued only after the dead worker's exit status was read, so the
worker can no longer write into the pages involved.

Respawn is bounded: when the worker has died ``max_respawns`` times within
``respawn_window_s`` seconds, the client stops respawning and ``disabled`` turns True (the
cache then switches the NVMe tier off). An exit with ``WEDGED_STORE_EXIT_CODE`` (a cluster-store
call ran past its limit) is not counted: the store failed, not the worker or the disk, and the
jobs it fails count against the store, which switches itself off and backs off
(:mod:`hiradix.core.store_tier`); ``store_wedges`` counts those exits. Each incarnation gets
fresh socket names, so a job queued for a dead worker never reaches its successor.

Blocking calls: ``start``, ``check_alive`` when it respawns (up to ``ready_timeout_s``),
``ping`` (up to its timeout) and ``close`` (up to ``shutdown_timeout_s`` + kill).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Sequence

import zmq

import hiradix
from hiradix.io.protocol import (
    Endpoints,
    Job,
    GetStore,
    JobDone,
    LoadPages,
    Ping,
    Pong,
    ProtocolError,
    PullQueue,
    PushQueue,
    PutStore,
    QueryStore,
    Ready,
    Rejected,
    Shutdown,
    StartFailed,
    StorePages,
    WorkerReply,
    WorkerRequest,
    WEDGED_STORE_EXIT_CODE,
    WorkerSpec,
    decode_reply,
    job_pages,
    make_endpoints,
)
from hiradix.tiers.files import ensure_private_dir

logger = logging.getLogger(__name__)


def exit_description(returncode: int) -> str:
    """``status N`` for an exit, ``signal SIGSEGV (11)`` for a death by signal (Popen's negative
    code): a segfault in a native library prints every thread's Python stack into the log above."""
    if returncode >= 0:
        return f"status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "signal"
    return f"signal {name} ({-returncode})"


class WorkerStartError(RuntimeError):
    """The worker process did not become ready (it failed, exited or timed out)."""


class _Incarnation:
    """One worker process and the two sockets that talk to it."""

    def __init__(self, ctx: zmq.Context, spec: WorkerSpec, endpoints: Endpoints, env: dict[str, str]):
        self.endpoints = endpoints
        self.replies: PullQueue[WorkerReply] = PullQueue(ctx, endpoints.acks, decode_reply)
        self.requests: PushQueue[WorkerRequest] | None = None  # connected once Ready arrives
        cmd = [sys.executable, "-m", "hiradix.io.worker", "--spec", spec.to_json(),
               "--jobs", endpoints.jobs, "--acks", endpoints.acks]
        try:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        except BaseException:
            self.replies.close()
            raise
        self.exit_fd = os.pidfd_open(self.proc.pid) if hasattr(os, "pidfd_open") else -1

    def exited(self) -> bool:
        """True once the process has exited (reaps it; never blocks)."""
        return self.proc.poll() is not None

    def wait_exit(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for the process to exit; True if it did."""
        try:
            self.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def dispose(self) -> None:
        """Kill the process if needed, reap it, close the sockets, remove the socket files."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self.requests is not None:
            self.requests.close()
        self.replies.close()
        if self.exit_fd >= 0:
            os.close(self.exit_fd)
        for path in self.endpoints.paths():
            path.unlink(missing_ok=True)


class IOWorkerClient:
    """Owns one I/O worker process (one per TP rank) and its in-flight jobs."""

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        ready_timeout_s: float = 60.0,
        shutdown_timeout_s: float = 10.0,
        max_respawns: int = 3,
        respawn_window_s: float = 300.0,
    ):
        """Set up the client; nothing is spawned until :meth:`start`.

        Args:
            spec: What the worker attaches to; ``parent_pid`` must be this process.
            ready_timeout_s: How long a (re)spawned worker may take to answer Ready, in seconds.
            shutdown_timeout_s: How long ``close`` waits after Shutdown before killing, in seconds.
            max_respawns: Deaths tolerated within ``respawn_window_s``; one more disables.
            respawn_window_s: Sliding window for counting deaths, in seconds.

        Raises:
            ValueError: ``spec.parent_pid`` is not this process, or a bound is not positive.
        """
        if spec.parent_pid != os.getpid():
            raise ValueError(f"spec.parent_pid {spec.parent_pid} is not this process {os.getpid()}")
        if ready_timeout_s <= 0 or shutdown_timeout_s <= 0 or respawn_window_s <= 0 or max_respawns < 0:
            raise ValueError("timeouts and the window must be > 0, max_respawns >= 0")
        self.spec = spec
        self.ready_timeout_s = ready_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.max_respawns = max_respawns
        self.respawn_window_s = respawn_window_s
        self._ctx = zmq.Context()
        self._instance = secrets.token_hex(4)  # socket names unique to this client
        self._generation = 0  # incarnation number, +1 per spawn
        self._worker: _Incarnation | None = None
        self._in_flight: dict[int, int] = {}  # job_id -> pages, submitted and not yet polled out
        self._done: list[JobDone] = []  # completions received or synthesized, not yet polled out
        self._deaths_s: deque[float] = deque()  # monotonic times of recent worker deaths
        self._ping_seq = 0  # last Ping seq sent
        self._last_pong = 0  # highest Pong seq received
        self._created_dir = False
        self._closed = False
        self.disabled = False  # True once respawning gave up; jobs then fail at once
        self.respawns = 0  # successful respawns so far
        self.store_wedges = 0  # exits with WEDGED_STORE_EXIT_CODE (not counted as deaths)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Create the socket directory (0700) if needed, spawn the worker, wait for Ready.

        Raises:
            PermissionError: ``socket_dir`` exists and is not private to this user.
            WorkerStartError: The worker failed, exited or timed out before Ready.
            RuntimeError: Already started or closed.
        """
        if self._worker is not None or self._closed:
            raise RuntimeError("IOWorkerClient.start() called twice or after close()")
        _, self._created_dir = ensure_private_dir(Path(self.spec.socket_dir))
        self._worker = self._spawn()

    def _spawn(self) -> _Incarnation:
        """Start one incarnation and wait for its Ready.

        Raises:
            WorkerStartError: As :meth:`start`.
        """
        self._generation += 1
        endpoints = make_endpoints(self.spec.socket_dir, self._instance, self._generation)
        env = dict(os.environ)
        package_root = str(Path(hiradix.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        worker = _Incarnation(self._ctx, self.spec, endpoints, env)
        try:
            reason = self._wait_ready(worker)
        except BaseException:
            worker.dispose()
            raise
        if reason:
            worker.dispose()
            raise WorkerStartError(f"I/O worker (pid {worker.proc.pid}) did not start: {reason}")
        worker.requests = PushQueue(self._ctx, endpoints.jobs)
        logger.info("I/O worker pid %d ready (generation %d)", worker.proc.pid, self._generation)
        return worker

    def _wait_ready(self, worker: _Incarnation) -> str:
        """Block until Ready (returns ""), StartFailed, exit or timeout (returns the reason)."""
        poller = zmq.Poller()
        poller.register(worker.replies.socket, zmq.POLLIN)
        if worker.exit_fd >= 0:
            poller.register(worker.exit_fd, zmq.POLLIN)
        deadline_s = time.monotonic() + self.ready_timeout_s
        while (left_s := deadline_s - time.monotonic()) > 0:
            # Without a pidfd, wake every 0.1 s to look at the exit status.
            wait_ms = int(left_s * 1000) + 1
            poller.poll(wait_ms if worker.exit_fd >= 0 else min(wait_ms, 100))
            try:
                msg = worker.replies.get_nowait()
            except ProtocolError as exc:
                return f"bad reply: {exc}"
            if isinstance(msg, Ready):
                return ""
            if isinstance(msg, StartFailed):
                return msg.reason
            if msg is None and worker.exited():
                return f"exited with status {worker.proc.returncode} before Ready"
        return f"no Ready within {self.ready_timeout_s} s"

    def close(self) -> None:
        """Stop the worker (Shutdown, then SIGKILL after ``shutdown_timeout_s``), remove sockets.

        Idempotent. Results not yet polled are dropped.
        """
        if self._closed:
            return
        self._closed = True
        worker, self._worker = self._worker, None
        if worker is not None:
            if worker.requests is not None and not worker.exited():
                worker.requests.put(Shutdown())
                if not worker.wait_exit(self.shutdown_timeout_s):
                    logger.warning("I/O worker pid %d ignored Shutdown; killing it", worker.proc.pid)
            worker.dispose()
        self._ctx.term()
        if self._created_dir:
            try:
                Path(self.spec.socket_dir).rmdir()
            except OSError as exc:  # another client still uses it
                logger.debug("kept socket_dir %s: %s", self.spec.socket_dir, exc)

    def __enter__(self) -> IOWorkerClient:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- jobs --------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue a job for the worker; never blocks. Its ``JobDone`` comes from :meth:`poll`.

        While the client is disabled the job fails at once (``error="worker disabled"``).
        The pages involved must stay pinned until the job's ``JobDone`` was polled.

        Raises:
            ValueError: ``job.job_id`` is already in flight.
            RuntimeError: The client is not started or is closed.
        """
        if self._closed or (self._worker is None and not self.disabled):
            raise RuntimeError("IOWorkerClient.submit() before start() or after close()")
        if job.job_id in self._in_flight:
            raise ValueError(f"job_id {job.job_id} is already in flight")
        self._in_flight[job.job_id] = job_pages(job)
        if self.disabled:
            self._fail(job.job_id, "worker disabled")
            return
        assert self._worker is not None and self._worker.requests is not None
        self._worker.requests.put(job)

    def submit_store(self, job_id: int, dram_pages: list[int], nvme_slots: list[int]) -> None:
        """:meth:`submit` a ``StorePages`` job (the core's ``IOClient`` port)."""
        self.submit(StorePages(job_id, list(dram_pages), list(nvme_slots)))

    def submit_load(self, job_id: int, nvme_slots: list[int], dram_pages: list[int], priority: int = 0) -> None:
        """:meth:`submit` a ``LoadPages`` job (the core's ``IOClient`` port); see its ``priority``."""
        self.submit(LoadPages(job_id, list(nvme_slots), list(dram_pages), priority=priority))

    def submit_put(self, job_id: int, dram_pages: list[int], keys: list[str]) -> None:
        """:meth:`submit` a ``PutStore`` job (DRAM pages -> cluster store)."""
        self.submit(PutStore(job_id, list(dram_pages), list(keys)))

    def submit_get(self, job_id: int, keys: list[str], dram_pages: list[int], priority: int = 0) -> None:
        """:meth:`submit` a ``GetStore`` job (cluster store -> DRAM pages); see its ``priority``."""
        self.submit(GetStore(job_id, list(keys), list(dram_pages), priority=priority))

    def submit_exists(self, job_id: int, keys: list[str]) -> None:
        """:meth:`submit` a ``QueryStore`` job (which keys the cluster store holds)."""
        self.submit(QueryStore(job_id, list(keys)))

    def poll(self) -> list[JobDone]:
        """Drain replies without blocking.

        Returns:
            Completions since the last call, each submitted job exactly once; failures
            synthesized by ``check_alive``, rejections and ``submit`` come here too.
        """
        if self._worker is not None:
            self._drain(self._worker)
        done, self._done = self._done, []
        return done

    def wait(self, timeout_s: float, wake: Sequence[Any] = ()) -> list[JobDone]:
        """Like :meth:`poll`, but block up to ``timeout_s`` seconds for at least one result.

        Returns early, possibly with an empty list, if the worker exits meanwhile (then call
        :meth:`check_alive`) or one of the ``wake`` sockets (zmq sockets or file descriptors
        the caller serves, e.g. the scheduler's request socket) becomes readable.

        Returns:
            As :meth:`poll`; empty on timeout.
        """
        deadline_s = time.monotonic() + timeout_s
        while not (done := self.poll()):
            worker = self._worker
            left_s = deadline_s - time.monotonic()
            if worker is None or left_s <= 0 or worker.exited():
                break
            poller = zmq.Poller()
            poller.register(worker.replies.socket, zmq.POLLIN)
            if worker.exit_fd >= 0:
                poller.register(worker.exit_fd, zmq.POLLIN)
            for socket in wake:
                poller.register(socket, zmq.POLLIN)
            events = dict(poller.poll(int(left_s * 1000) + 1))
            if any(socket in events for socket in wake):
                done = self.poll()
                break
        return done

    def in_flight(self) -> set[int]:
        """Ids of jobs submitted whose ``JobDone`` has not been returned by :meth:`poll`."""
        return set(self._in_flight) | {d.job_id for d in self._done}

    def _drain(self, worker: _Incarnation) -> None:
        """Move every waiting reply into ``self._done`` (jobs) or drop it (see below)."""
        while True:
            try:
                msg = worker.replies.get_nowait()
            except ProtocolError as exc:
                logger.warning("dropped a malformed reply from the I/O worker: %s", exc)
                continue
            if msg is None:
                return
            if isinstance(msg, JobDone):
                self._complete(msg)
            elif isinstance(msg, Rejected) and msg.job_id in self._in_flight:
                self._fail(msg.job_id, f"rejected: {msg.reason}")
            elif isinstance(msg, Rejected):
                logger.warning("I/O worker rejected a message: %s", msg.reason)
            elif isinstance(msg, Pong):
                self._last_pong = msg.seq
            else:
                logger.debug("ignored %s from the I/O worker", type(msg).__name__)

    def _complete(self, done: JobDone) -> None:
        expected = self._in_flight.pop(done.job_id, None)
        if expected is None:  # late, duplicate or from a previous incarnation
            logger.debug("dropped JobDone for unknown job %d", done.job_id)
            return
        if len(done.ok) != expected:
            done = JobDone(job_id=done.job_id, ok=[False] * expected,
                           error=f"worker answered {len(done.ok)} flags for {expected} pages")
        self._done.append(done)

    def _fail(self, job_id: int, error: str) -> None:
        self._done.append(JobDone(job_id=job_id, ok=[False] * self._in_flight.pop(job_id), error=error))

    # ---- liveness ----------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """The current worker's process id, or None (not started, disabled or closed)."""
        return self._worker.proc.pid if self._worker is not None else None

    @property
    def endpoints(self) -> Endpoints | None:
        """The current incarnation's socket addresses, or None."""
        return self._worker.endpoints if self._worker is not None else None

    def check_alive(self) -> bool:
        """Look at the worker's exit status; on death fail its jobs and respawn (bounded).

        Never blocks while the worker lives; a respawn blocks up to ``ready_timeout_s`` per try.

        Returns:
            True if the worker was running; False if it had died (it is then respawned or,
            past the bound, ``disabled`` is set), or if the client is disabled.
        """
        worker = self._worker
        if worker is None:
            return False
        if not worker.exited():
            return True
        logger.warning("I/O worker pid %d died with %s; %d jobs in flight fail",
                       worker.proc.pid, exit_description(worker.proc.returncode), len(self._in_flight))
        self._drain(worker)  # completions it sent before dying still count
        for job_id in list(self._in_flight):
            self._fail(job_id, "worker died")
        if worker.proc.returncode == WEDGED_STORE_EXIT_CODE:
            self.store_wedges += 1
        else:
            self._deaths_s.append(time.monotonic())
        worker.dispose()
        self._worker = None
        self._respawn()
        return False

    def _respawn(self) -> None:
        """Spawn a successor unless too many deaths (recorded by the caller; a successor that
        fails to start is one more) fell within the window (then disable)."""
        while True:
            now_s = time.monotonic()
            while self._deaths_s and self._deaths_s[0] < now_s - self.respawn_window_s:
                self._deaths_s.popleft()
            if len(self._deaths_s) > self.max_respawns:
                logger.error("I/O worker died %d times in %.0f s; NVMe I/O disabled",
                             len(self._deaths_s), self.respawn_window_s)
                self.disabled = True
                return
            try:
                self._worker = self._spawn()
                self.respawns += 1
                return
            except WorkerStartError as exc:
                logger.warning("respawn failed: %s", exc)
                self._deaths_s.append(time.monotonic())

    def ping(self, timeout_s: float) -> bool:
        """Round trip to the worker; replies that arrive meanwhile are kept for :meth:`poll`.

        A Pong also proves that every job submitted before this call reached the worker.

        Args:
            timeout_s: How long to wait for the Pong, in seconds.

        Returns:
            True if the Pong came back in time; False on timeout or when there is no worker.
        """
        worker = self._worker
        if worker is None or worker.requests is None:
            return False
        self._ping_seq += 1
        seq = self._ping_seq
        worker.requests.put(Ping(seq=seq))
        deadline_s = time.monotonic() + timeout_s
        while True:
            self._drain(worker)
            if self._last_pong >= seq:
                return True
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                return False
            worker.replies.socket.poll(int(left_s * 1000) + 1)
