"""The I/O worker: a process per TP rank that moves pages between DRAM and NVMe / the cluster store.

Run by :class:`hiradix.io.client.IOWorkerClient` as::

    python -m hiradix.io.worker --spec '<WorkerSpec JSON>' --jobs ipc://... --acks ipc://...

It attaches the DRAM pool (shared-memory file), the NVMe store (when it has slots) and the
cluster store (when ``spec.store_backend`` is set, with the DRAM arena registered for zero-copy
transfers), binds the jobs socket, answers ``Ready`` and then serves ``StorePages``/``LoadPages``
on a thread pool of ``spec.threads`` so reads and writes overlap, and ``PutStore``/``GetStore``/
``QueryStore`` on a pool of their own (``spec.store_threads``), one ``JobDone`` per job. The NVMe
pool takes its waiting jobs by priority (``LoadPages.priority``: reads a request waits for, then
reads for queued requests, then writes and reads for predicted returns), so a read near
admission never queues behind background writes; the store pool likewise (:func:`store_priority`:
lookups, then GETs by ``GetStore.priority``, then PUTs). Every
store call is bounded by the backend's own RPC timeout (``--hiradix-store-config``); a call that
runs past ``spec.store_call_limit_s`` anyway (a wedged client: Mooncake's TCP transport can
deadlock inside a put) makes the worker exit with ``WEDGED_STORE_EXIT_CODE``, as the only way to
drop the wedged client and anything it might still write into DRAM; the I/O client then fails
the worker's jobs (the core releases their pages) and starts a fresh one. It validates every
message: a malformed one is answered with ``Rejected`` and the loop goes on. It exits on
``Shutdown`` (running jobs finish; queued ones fail) or when ``spec.parent_pid`` is no longer
its parent (checked every ``PARENT_POLL_S``); SIGINT is ignored (the parent decides). With
``spec.stop_timeout_s`` > 0, SIGTERM (a server stopped as a whole process group) does not end it
either: its scheduler drains the writes in flight (``hiradix.core.graceful_stop``), which needs
their answers, then sends ``Shutdown``; it exits anyway ``STOP_MARGIN_S`` after that bound.

Fault switch (tests only; off unless the env var is set), ``HIRADIX_FAULTS`` holds
comma-separated ``key=value`` items, parsed once at start by :meth:`Faults.from_env` and
injected by :class:`hiradix.io.faults.FaultInjector` so that the real code paths run. Job
ordinals are 1-based, in arrival order, and restart in every incarnation (a respawned worker
reads the same switch):

    crash_on_job=N    os._exit(FAULT_EXIT_CODE) when the N-th job arrives, before it runs
    crash_mid_job=N   the N-th job moves the first half of its pages, then os._exit
    crash_mid_load=N  the same for the N-th load job (NVMe -> DRAM; counting loads only)
    crash_limit=K     the crashes above happen at most K times in all, counted across
                      respawns in ``<socket_dir>/fault-crashes``; 0 (default) = every time
    delay_s=X         every job waits X seconds before touching the disk (a slow disk);
                      Shutdown cuts the wait short and the job fails
    load_delay_s=X    the same, for loads only: a read that lands late or never
    store_delay_s=X   the same, for stores only: a slow write
    store_hold_path=P every store job waits while the file P exists (a write held until the
                      test removes P); Shutdown cuts the wait short and the job fails
    enospc_on_store=N the N-th store job and every later one: each write raises
                      OSError(ENOSPC) in the store's file layer (nothing written; the
                      store's own error path turns it into failed pages)
    short_read=N      the N-th load job and every later one: each read call returns at most
                      half a slot (aligned down to 4096 bytes), a short count, so every slot
                      it covers is short
    corrupt_read=N    the N-th load job and every later one: one payload byte of every slot
                      is flipped after the read, before the trailer's checksum is verified
    truncate_on_job=N when the N-th job arrives, nvme.kv is truncated (on disk) to
                      ``truncate_keep`` of its size (default 0.5, aligned down to 4096 bytes)
    only_rank=R       the faults above apply to the worker of TP rank R only (the others
                      run clean): ranks whose I/O completes at different times

An unknown key or a bad value makes the worker answer ``StartFailed`` and exit 1.
``HIRADIX_LOG_LEVEL`` (e.g. ``DEBUG``) sets the worker's logging level; WARNING by default.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from functools import partial
from pathlib import Path

import zmq

from hiradix.io.faults import CRASH_LOG_NAME, FaultInjector, Faults, JobPlan
from hiradix.io.queues import PriorityExecutor
from hiradix.io.faults import FAULT_EXIT_CODE, FAULTS_ENV  # noqa: F401 - re-exported (tests, callers)
from hiradix.io.protocol import (
    PRIORITY_ADMISSION,
    PRIORITY_BACKGROUND,
    GetStore,
    Job,
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
    WEDGED_STORE_EXIT_CODE,
    WorkerSpec,
    decode_request,
    job_pages,
    validate_job,
)
from hiradix.tiers.dram import DramPool
from hiradix.tiers.files import ensure_private_dir
from hiradix.tiers.nvme import NVME_FILE_NAME, NvmeStore

logger = logging.getLogger(__name__)

LOG_LEVEL_ENV = "HIRADIX_LOG_LEVEL"  # the worker's logging level name, WARNING by default
PARENT_POLL_S = 0.2  # how often the loop checks that the parent is alive, in seconds
ACK_LINGER_S = 2.0  # how long queued replies may take to leave at exit, in seconds
STORE_CALL_LIMIT_MIN_S = 10.0  # the derived store call limit is at least this, in seconds
STORE_CALL_LIMIT_FACTOR = 4.0  # ... and at least this many times the backend's call_deadline_s
COLD_CHUNK_PAGES = 32  # pages a compressed tier encodes or decodes per step (scratch per thread)
STOP_MARGIN_S = 5.0  # after SIGTERM, the worker waits this long past spec.stop_timeout_s for Shutdown


def store_priority(job: PutStore | GetStore | QueryStore) -> int:
    """The store pool's order: lookups (a request waits for their answer), then GETs by their own
    priority (admission, queued, predicted return), then PUTs (nobody waits for them)."""
    if isinstance(job, QueryStore):
        return PRIORITY_ADMISSION - 1
    return job.priority if isinstance(job, GetStore) else PRIORITY_BACKGROUND + 1


class Worker:
    """Serves jobs on one pair of sockets; owns the attached tiers and the thread pools.

    NVMe jobs run on one pool, most urgent first, cluster-store jobs on another, so a slow or
    frozen store never delays NVMe reads and writes. Either tier may be absent (no slots / no
    store backend).
    """

    def __init__(self, spec: WorkerSpec, jobs_addr: str, replies: PushQueue[WorkerReply]):
        """Attach the DRAM pool, the NVMe file and the cluster store, and bind the jobs socket.

        Raises:
            PermissionError: ``spec.socket_dir`` is not private (0700, ours).
            ValueError: The spec contradicts itself (page bytes) or ``HIRADIX_FAULTS`` is bad.
            OSError: A tier's file cannot be opened.
        """
        ensure_private_dir(Path(spec.socket_dir))
        self.faults = FaultInjector(Faults.from_env().for_rank(spec.tp_rank), Path(spec.socket_dir) / CRASH_LOG_NAME)
        if not spec.layout.get("page_major", True):
            raise ValueError("the I/O worker moves whole pages; it needs a page-major layout")
        codec, encoded_dram = _cold_codec(spec), None
        if codec is not None:  # the only case where the worker reads the layout: the page must agree with it
            from hiradix.io.cold_pages import ColdPages, EncodedDram  # noqa: PLC0415 - torch: compressed tiers only

            encoded_dram = EncodedDram(codec) if "dram" in spec.cold_tiers else None  # DRAM pages are encoded
            dram_page_bytes = encoded_dram.encoded_bytes if encoded_dram else codec.layout.page_bytes
            if dram_page_bytes != spec.page_bytes:
                raise ValueError(f"spec.page_bytes {spec.page_bytes} != the DRAM page's {dram_page_bytes} "
                                 f"(layout {codec.layout.page_bytes}, cold tiers {spec.cold_tiers})")
        if spec.threads < 1 or spec.store_threads < 1:
            raise ValueError(f"spec.threads and spec.store_threads must be >= 1, got {spec.threads}, {spec.store_threads}")
        self.spec = spec
        # Pages are opaque bytes here (no layout, no torch): the worker copies them whole.
        self.pool = DramPool.attach(Path(spec.dram_path), None, spec.num_dram_pages, page_bytes=spec.page_bytes)
        self.store, self.cluster = None, None
        self.nvme_cold, self.store_cold = encoded_dram, encoded_dram  # ColdPages of a compressed tier
        try:
            if spec.num_nvme_slots > 0:
                if "nvme" in spec.cold_tiers and encoded_dram is None:
                    self.nvme_cold = ColdPages(codec, COLD_CHUNK_PAGES, spec.threads)
                self.store = NvmeStore.open(
                    Path(spec.nvme_dir) / NVME_FILE_NAME,
                    self.nvme_cold.encoded_bytes if self.nvme_cold else spec.page_bytes, spec.num_nvme_slots,
                    backend=spec.io_backend, threads=spec.threads, warn_fallback=False,
                )
                self.faults.attach(self.store)
            if spec.store_backend:
                self.cluster = _open_cluster_store(spec, self.pool)
                if "store" in spec.cold_tiers and encoded_dram is None:
                    self.store_cold = ColdPages(codec, COLD_CHUNK_PAGES, spec.store_threads, register=self.cluster.register)
        except BaseException:
            if self.store is not None:
                self.store.close()
            self.pool.close()
            raise
        self.replies = replies
        self.ctx = zmq.Context.instance()
        self.requests = PullQueue(self.ctx, jobs_addr, decode_request)
        self.executor = PriorityExecutor(spec.threads, thread_name_prefix="hiradix-io")
        self.store_executor = PriorityExecutor(spec.store_threads, thread_name_prefix="hiradix-store")
        self.store_call_limit_s = spec.store_call_limit_s or _derived_call_limit_s(self.cluster)
        self.stop = threading.Event()  # set by Shutdown: cuts fault delays short
        self.lock = threading.Lock()  # guards in_flight
        self.in_flight: set[int] = set()  # job ids taken in and not yet answered
        self.term_deadline_s: float | None = None  # set by SIGTERM (note_sigterm): exit then at the latest

    def note_sigterm(self, *_: object) -> None:
        """SIGTERM handler (``spec.stop_timeout_s`` > 0): keep serving while the scheduler drains,
        until its Shutdown, at most ``stop_timeout_s + STOP_MARGIN_S`` from now."""
        if self.term_deadline_s is None:
            self.term_deadline_s = time.monotonic() + self.spec.stop_timeout_s + STOP_MARGIN_S

    # ---- main loop ---------------------------------------------------------------------------

    def serve(self) -> int:
        """Run until Shutdown or the parent's death.

        Returns:
            The process exit status: 0 on Shutdown, 1 when the parent is gone,
            ``WEDGED_STORE_EXIT_CODE`` when a store call ran past ``store_call_limit_s``.
        """
        poller = zmq.Poller()
        poller.register(self.requests.socket, zmq.POLLIN)
        while True:
            if os.getppid() != self.spec.parent_pid:
                logger.warning("parent %d is gone; exiting", self.spec.parent_pid)
                return 1
            if self._store_wedged():
                return WEDGED_STORE_EXIT_CODE
            if self.term_deadline_s is not None and time.monotonic() >= self.term_deadline_s:
                logger.warning("SIGTERM %.0f s ago and no Shutdown from the scheduler; exiting",
                               self.spec.stop_timeout_s + STOP_MARGIN_S)
                return 0
            if not poller.poll(int(PARENT_POLL_S * 1000)):
                continue
            while True:
                try:
                    msg = self.requests.get_nowait()
                except ProtocolError as exc:
                    logger.warning("rejected a malformed message: %s", exc)
                    self.replies.put(Rejected(job_id=-1, reason=str(exc)))
                    continue
                if msg is None:
                    break
                if isinstance(msg, Shutdown):
                    return 0
                self._handle(msg)

    def _store_wedged(self) -> bool:
        """Whether the store backend's running call has taken longer than its limit (one error)."""
        running = getattr(self.cluster, "call_running_s", None)
        took_s = running() if running is not None else 0.0
        if took_s <= self.store_call_limit_s:
            return False
        logger.error("a cluster-store call (%s) has run for %.1f s (limit %.1f s): the store client is wedged; "
                     "exiting so that the I/O client fails this worker's %d jobs and starts a fresh one",
                     getattr(self.cluster, "running_call", "?"), took_s, self.store_call_limit_s, len(self.in_flight))
        dump_own_stacks()
        return True

    def _handle(self, msg: StorePages | LoadPages | Ping) -> None:
        """Answer a Ping, or validate and dispatch a job; never raises on a bad job."""
        if isinstance(msg, Ping):
            self.replies.put(Pong(seq=msg.seq))
            return
        reason = validate_job(msg, self.spec.num_dram_pages, self.spec.num_nvme_slots, self.cluster is not None)
        with self.lock:
            if not reason and msg.job_id in self.in_flight:
                reason = f"job_id {msg.job_id} is already in flight"
            if not reason:
                self.in_flight.add(msg.job_id)
        if reason:
            logger.warning("rejected job %d: %s", msg.job_id, reason)
            self.replies.put(Rejected(job_id=msg.job_id, reason=reason))
            return
        if isinstance(msg, (PutStore, GetStore, QueryStore)):
            future = self.store_executor.submit(store_priority(msg), self._run_store, msg)
        else:
            plan = self.faults.on_arrival(msg)  # may crash or truncate the file (fault switch)
            priority = msg.priority if isinstance(msg, LoadPages) else PRIORITY_BACKGROUND
            future = self.executor.submit(priority, self._run, msg, plan)
        future.add_done_callback(lambda f, job=msg: self._reply(job, f))

    # ---- jobs (pool threads) -----------------------------------------------------------------

    def _run(self, job: Job, plan: JobPlan) -> JobDone:
        """Move one job's pages under its fault ``plan``; failures become a failed ``JobDone``,
        never an exception."""
        start_s = time.monotonic()
        n = job_pages(job)
        if (plan.delay_s and self.stop.wait(plan.delay_s)) or not self.faults.hold(plan, self.stop):
            return JobDone(job_id=job.job_id, ok=[False] * n, error="cancelled: shutdown")
        try:
            views = [self.pool.page_view(p) for p in job.dram_pages]
            move = self.store.write_slots if isinstance(job, StorePages) else self.store.read_slots
            if self.nvme_cold is not None:
                move = partial(self.nvme_cold.write if isinstance(job, StorePages) else self.nvme_cold.read, move)
            with self.faults.armed(job, plan):
                if plan.crash_mid:
                    move(list(job.nvme_slots[: n // 2]), views[: n // 2])
                    self.faults.crash(f"halfway through job {job.job_id} (#{plan.ordinal})")
                ok = [bool(x) for x in move(list(job.nvme_slots), views)]
            if len(ok) != n:
                raise RuntimeError(f"store returned {len(ok)} flags for {n} pages")
            return JobDone(job_id=job.job_id, ok=ok, duration_s=time.monotonic() - start_s)
        except Exception as exc:  # noqa: BLE001 - a bad job must not take the worker down
            logger.exception("job %d failed", job.job_id)
            return JobDone(
                job_id=job.job_id, ok=[False] * n, error=f"{type(exc).__name__}: {exc}",
                duration_s=time.monotonic() - start_s,
            )

    def _run_store(self, job: PutStore | GetStore | QueryStore) -> JobDone:
        """One cluster-store job; the backend turns store errors into per-key False (a miss).
        A backend that raises fails the job as a whole (``error`` set)."""
        start_s = time.monotonic()
        n = job_pages(job)
        try:
            if isinstance(job, PutStore) and not self.spec.store_writer:
                return JobDone(job_id=job.job_id, ok=[True] * n, duration_s=time.monotonic() - start_s)
            if isinstance(job, QueryStore):
                ok = self.cluster.exists(list(job.keys))
            else:
                views = [self.pool.page_view(p) for p in job.dram_pages]
                move = self.cluster.put if isinstance(job, PutStore) else self.cluster.get
                if self.store_cold is not None:
                    move = partial(self.store_cold.write if isinstance(job, PutStore) else self.store_cold.read, move)
                ok = move(list(job.keys), views)
            ok = [bool(x) for x in ok]
            if len(ok) != n:
                raise RuntimeError(f"store returned {len(ok)} flags for {n} keys")
            return JobDone(job_id=job.job_id, ok=ok, duration_s=time.monotonic() - start_s)
        except Exception as exc:  # noqa: BLE001 - a store failure must not take the worker down
            logger.warning("store job %d failed: %s: %s", job.job_id, type(exc).__name__, exc)
            return JobDone(job_id=job.job_id, ok=[False] * n, error=f"{type(exc).__name__}: {exc}",
                           duration_s=time.monotonic() - start_s)

    def _reply(self, job: Job, future: Future) -> None:
        """Done-callback: send the job's ``JobDone`` (a cancelled job fails)."""
        if future.cancelled():
            done = JobDone(job_id=job.job_id, ok=[False] * job_pages(job), error="cancelled: shutdown")
        else:
            done = future.result()
        with self.lock:
            self.in_flight.discard(job.job_id)
        try:
            self.replies.put(done)
        except zmq.ZMQError as exc:  # the socket closed under us during exit
            logger.debug("could not send JobDone(%d): %s", job.job_id, exc)

    def close(self, graceful: bool) -> None:
        """Stop the pool (waiting for running jobs if ``graceful``), close the sockets and tiers."""
        self.stop.set()
        self.executor.shutdown(wait=graceful, cancel_futures=True)
        self.store_executor.shutdown(wait=graceful, cancel_futures=True)
        self.requests.close()
        if graceful:
            if self.store is not None:
                self.store.close()
            if self.cluster is not None:
                self.cluster.close()
            self.pool.close()


def dump_own_stacks() -> None:
    """Every thread's Python stack of this process into its log (stderr, at once): where the
    wedged store call waits. (Its native frames, measured once: Mooncake's
    ``ClientSession::refreshProgressDeadline`` waiting on asio's reactor mutex; see
    ``hiradix.tiers.store.mooncake``.)"""
    faulthandler.dump_traceback(all_threads=True)


def _derived_call_limit_s(cluster) -> float:
    """The store call limit when the spec gives none: the config's ``call_limit_s`` if set, else
    well past the backend's own deadlines (``max(STORE_CALL_LIMIT_MIN_S, FACTOR * deadline)``).
    A wedged call holds its PUTs' DRAM pages until then (at most half of DRAM, see
    :data:`hiradix.core.store_tier.MAX_PUT_DRAM_FRACTION`)."""
    config = getattr(cluster, "config", None)
    if getattr(config, "call_limit_s", 0):
        return float(config.call_limit_s)
    deadline_s = getattr(config, "call_deadline_s", 0.0)
    return max(STORE_CALL_LIMIT_MIN_S, STORE_CALL_LIMIT_FACTOR * deadline_s)


def _cold_codec(spec: WorkerSpec):
    """The compressed tiers' page codec, or None when no tier is compressed (the default).

    Only then does the worker import torch (~2 s of CPU and ~0.3 GB of memory per worker).
    """
    if not spec.cold_tiers:
        return None
    import torch  # noqa: PLC0415

    from hiradix.dataplane.kv_codec import PageCodec  # noqa: PLC0415
    from hiradix.dataplane.layout import KVLayout  # noqa: PLC0415

    # The codec runs on the job threads; torch's own intra-op threads on top of them only
    # contend for the same cores (measured: 2 threads ran 12-50 MB/s under load, 1 thread ~1 GB/s).
    torch.set_num_threads(1)
    return PageCodec(KVLayout.from_json(spec.layout), spec.cold_format)


def _open_cluster_store(spec: WorkerSpec, pool: DramPool):
    """The spec's cluster-store backend, with the DRAM arena registered for zero-copy transfers."""
    from hiradix.tiers.store import StoreConfig, make_backend

    backend = make_backend(spec.store_backend, StoreConfig.parse(spec.store_config, "--hiradix-store-config"))
    backend.register(pool.address, pool.dram_bytes)
    return backend


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hiradix.io.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--spec", required=True, help="WorkerSpec as JSON")
    parser.add_argument("--jobs", required=True, help="ipc:// address to bind for requests")
    parser.add_argument("--acks", required=True, help="ipc:// address to connect for replies")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point: start, serve, exit. Returns the exit status (0 = Shutdown)."""
    args = _parse_args(argv)
    level = logging.getLevelName(os.environ.get(LOG_LEVEL_ENV, "WARNING").upper())
    logging.basicConfig(
        level=level if isinstance(level, int) else logging.WARNING,
        format=f"%(asctime)s io-worker[{os.getpid()}] %(levelname)s %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A crash inside a native library (Mooncake's store.so segfaults under load, see
    # hiradix.tiers.store.mooncake) prints every thread's Python stack into the server's log.
    faulthandler.enable(all_threads=True)
    replies: PushQueue[WorkerReply] = PushQueue(zmq.Context.instance(), args.acks)
    try:
        worker = Worker(WorkerSpec.from_json(args.spec), args.jobs, replies)
    except Exception as exc:  # noqa: BLE001 - report any start failure to the client
        logger.exception("start failed")
        replies.put(StartFailed(reason=f"{type(exc).__name__}: {exc}"))
        replies.close(linger_s=ACK_LINGER_S)
        return 1
    if worker.spec.stop_timeout_s > 0:
        signal.signal(signal.SIGTERM, worker.note_sigterm)
    replies.put(Ready(pid=os.getpid()))
    status = worker.serve()
    if status == WEDGED_STORE_EXIT_CODE:
        # The wedged call's thread never ends, so neither would a normal exit (it joins the
        # pool's threads); send what finished, then leave at once.
        worker.stop.set()
        replies.close(linger_s=ACK_LINGER_S)
        os._exit(status)
    worker.close(graceful=status == 0)
    replies.close(linger_s=ACK_LINGER_S if status == 0 else 0.0)
    return status


if __name__ == "__main__":
    sys.exit(main())
