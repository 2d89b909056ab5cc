"""Fault injection for the I/O worker: a test-only switch, off unless ``HIRADIX_FAULTS`` is set.

The switch values are listed in :mod:`hiradix.io.worker`'s docstring. This module parses them
(:class:`Faults`) and injects them so that the real code paths run (:class:`FaultInjector`,
owned by the worker process):

* crashes are a real ``os._exit`` of the worker (the client sees a dead process);
* delays hold the job in the worker's thread before it touches the disk (a slow disk), and so
  does a hold file: a store job waits while the file exists (a write held until a test releases it);
* ENOSPC, short reads and corrupted bytes come from :class:`FaultyFile`, which replaces the
  store's block-I/O object (``NvmeStore.wrap_file``), so ``NvmeStore``'s own error handling
  and trailer verification see them exactly as they would see a failing disk;
* truncation really truncates ``nvme.kv`` on disk.

Faults that start "from the N-th job on" are armed per job, on the NVMe slots that job
touches (concurrent jobs never share a slot), so an earlier job still running is unaffected.
Ordinals are 1-based, in arrival order, and restart in every worker incarnation.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from hiradix.io.protocol import Job, LoadPages

logger = logging.getLogger(__name__)

FAULTS_ENV = "HIRADIX_FAULTS"
FAULT_EXIT_CODE = 86  # exit status of a crash injected by the fault switch
CRASH_LOG_NAME = "fault-crashes"  # in the worker's socket_dir: one line per injected crash
TRUNCATE_ALIGN = 4096  # truncation keeps a multiple of this many bytes (O_DIRECT-friendly)
HOLD_POLL_S = 0.05  # how often a held store job looks at its hold file, in seconds


@dataclass(frozen=True)
class Faults:
    """Injected faults (see :mod:`hiradix.io.worker`'s docstring). All off by default.

    Attributes:
        crash_on_job: Exit when this job (1-based arrival ordinal) arrives; 0 = never.
        crash_mid_job: Exit halfway through this job; 0 = never.
        crash_mid_load: Exit halfway through this load job (ordinal among loads); 0 = never.
        crash_limit: Crashes injected at most this many times in all, counted across
            respawns in ``<socket_dir>/fault-crashes``; 0 = no limit.
        delay_s: Wait before each job, in seconds.
        load_delay_s: Wait before each load job (NVMe -> DRAM), in seconds.
        store_delay_s: Wait before each store job (DRAM -> NVMe), in seconds.
        enospc_on_store: Writes of this store job and every later one fail with ENOSPC; 0 = never.
        short_read: Reads of this load job and every later one return half the bytes; 0 = never.
        corrupt_read: Reads of this load job and every later one get one payload byte
            flipped before verification; 0 = never.
        truncate_on_job: Truncate ``nvme.kv`` when this job arrives, before it runs; 0 = never.
        truncate_keep: Fraction of the file's size that truncation keeps, in ``[0, 1)``.
        store_hold_path: While this file exists, every store job waits before touching the disk
            (checked every ``HOLD_POLL_S``); "" = never. A path without commas.
        only_rank: The faults apply to the worker of this TP rank only (a rank whose I/O is
            slower than the others'); -1 (default) = every rank.
    """

    crash_on_job: int = 0
    crash_mid_job: int = 0
    crash_mid_load: int = 0
    crash_limit: int = 0
    delay_s: float = 0.0
    load_delay_s: float = 0.0
    store_delay_s: float = 0.0
    enospc_on_store: int = 0
    short_read: int = 0
    corrupt_read: int = 0
    truncate_on_job: int = 0
    truncate_keep: float = 0.5
    store_hold_path: str = ""
    only_rank: int = -1

    def for_rank(self, tp_rank: int) -> Faults:
        """The faults of the worker of ``tp_rank`` (none when ``only_rank`` names another rank)."""
        return self if self.only_rank < 0 or self.only_rank == tp_rank else Faults()

    @classmethod
    def parse(cls, text: str) -> Faults:
        """Parse ``"key=value,key=value"``; an empty string means no faults.

        Raises:
            ValueError: An unknown key, a missing ``=`` or a value of the wrong type or range.
        """
        kinds = {f.name: {"int": int, "str": str}.get(str(getattr(f.type, "__name__", f.type)), float)
                 for f in fields(cls)}
        values: dict[str, float | str] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = item.partition("=")
            if not sep or key not in kinds:
                raise ValueError(f"{FAULTS_ENV}: bad item {item!r}; keys: {sorted(kinds)}")
            try:
                value = kinds[key](raw)
            except ValueError:
                raise ValueError(f"{FAULTS_ENV}: {key} needs a {kinds[key].__name__}, got {raw!r}") from None
            if kinds[key] is not str and (value < 0 or (key == "truncate_keep" and value >= 1)):
                raise ValueError(f"{FAULTS_ENV}: {key} out of range, got {raw!r}")
            values[key] = value
        return cls(**values)  # type: ignore[arg-type]

    @classmethod
    def from_env(cls) -> Faults:
        """Faults from ``HIRADIX_FAULTS`` (the only place the variable is read).

        Raises:
            ValueError: As :meth:`parse`.
        """
        return cls.parse(os.environ.get(FAULTS_ENV, ""))

    @property
    def touches_files(self) -> bool:
        """Whether a fault needs :class:`FaultyFile` around the store's block I/O."""
        return bool(self.enospc_on_store or self.short_read or self.corrupt_read)


@dataclass(frozen=True)
class JobPlan:
    """What the switch does to one job; decided at arrival by :meth:`FaultInjector.on_arrival`.

    Attributes:
        ordinal: The job's 1-based arrival ordinal among all jobs of this incarnation.
        delay_s: Wait before touching the disk, in seconds.
        crash_mid: Move half the pages, then exit.
        enospc: Writes fail with ENOSPC.
        short_reads: Reads return half the bytes asked for.
        corrupt_reads: Reads get one payload byte flipped.
        hold_path: Wait while this file exists before touching the disk ("" = no hold).
    """

    ordinal: int
    delay_s: float = 0.0
    crash_mid: bool = False
    enospc: bool = False
    short_reads: bool = False
    corrupt_reads: bool = False
    hold_path: str = ""


def _from_nth(start: int, ordinal: int) -> bool:
    """Whether a fault switched on "from job ``start`` on" (0 = off) hits job ``ordinal``."""
    return start > 0 and ordinal >= start


class FaultyFile:
    """Wraps a store's block-I/O object (``pread``/``pwrite``/``close``); faults per armed slot.

    One call moves one slot or a run of consecutive slots (the store coalesces them); a call
    whose first slot is armed gets the fault for every slot it covers.

    Args:
        inner: The store's file object (``_PosixFile`` or ``_KvikioFile``).
        page_bytes: Payload bytes per slot (the byte flipped lies in the payload).
        slot_bytes: Bytes per slot (maps an offset to its slot id).
    """

    def __init__(self, inner: Any, page_bytes: int, slot_bytes: int):
        self.inner = inner
        self.name = inner.name
        self.direct_io = inner.direct_io
        self.page_bytes = page_bytes
        self.slot_bytes = slot_bytes
        self._lock = threading.Lock()  # guards _armed (pool threads of the worker and the store)
        self._armed: dict[str, Counter[int]] = {"enospc": Counter(), "short": Counter(), "corrupt": Counter()}

    def arm(self, fault: str, slot_ids: list[int], on: bool) -> None:
        """Switch ``fault`` ("enospc", "short", "corrupt") on or off for ``slot_ids``."""
        with self._lock:
            for slot_id in slot_ids:
                self._armed[fault][slot_id] += 1 if on else -1
            self._armed[fault] += Counter()  # drop zero counts

    def _is_armed(self, fault: str, offset: int) -> bool:
        with self._lock:
            return self._armed[fault][offset // self.slot_bytes] > 0

    def pwrite(self, buf: memoryview, offset: int) -> int:
        """As the inner ``pwrite``; raises ``OSError(ENOSPC)`` for armed slots (nothing written)."""
        if self._is_armed("enospc", offset):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.inner.pwrite(buf, offset)

    def pread(self, buf: memoryview, offset: int) -> int:
        """As the inner ``pread``, but for armed slots: "short" reads only the first half of
        the first slot (aligned down to 4096 bytes) and returns that count, so every slot of
        the call is short; "corrupt" flips the middle payload byte of every slot read."""
        if self._is_armed("short", offset):
            cut = min(len(buf), self.slot_bytes) // 2 // TRUNCATE_ALIGN * TRUNCATE_ALIGN
            return self.inner.pread(buf[:cut], offset) if cut else 0
        got = self.inner.pread(buf, offset)
        if self._is_armed("corrupt", offset):
            for base in range(0, got - self.page_bytes // 2, self.slot_bytes):
                buf[base + self.page_bytes // 2] ^= 0xFF
        return got

    def close(self) -> None:
        """Close the inner file."""
        self.inner.close()


class FaultInjector:
    """Applies :class:`Faults` to one worker incarnation; does nothing when they are all off.

    Args:
        faults: The parsed switch.
        crash_log: File counting injected crashes across respawns (for ``crash_limit``).
    """

    def __init__(self, faults: Faults, crash_log: Path):
        self.faults = faults
        self.crash_log = crash_log
        crashes = len(crash_log.read_text().splitlines()) if faults.crash_limit and crash_log.exists() else 0
        self.may_crash = faults.crash_limit == 0 or crashes < faults.crash_limit
        self.file: FaultyFile | None = None  # installed by attach() when a fault needs it
        self.store_path: Path | None = None  # nvme.kv, for truncation
        self.counts = Counter()  # jobs received per kind: "job" (all), "load", "store"

    def attach(self, store: Any) -> None:
        """Install :class:`FaultyFile` in ``store`` (an ``NvmeStore``) if a fault needs it."""
        self.store_path = Path(store.path)
        if self.faults.touches_files:
            def wrap(inner: Any) -> FaultyFile:
                self.file = FaultyFile(inner, store.page_bytes, store.slot_bytes)
                return self.file

            store.wrap_file(wrap)

    def on_arrival(self, job: Job) -> JobPlan:
        """Count ``job`` (main thread, arrival order); crash or truncate now if due.

        Returns:
            The faults to apply while the job runs.
        """
        f, load = self.faults, isinstance(job, LoadPages)
        self.counts["job"] += 1
        self.counts["load" if load else "store"] += 1
        n, n_kind = self.counts["job"], self.counts["load" if load else "store"]
        logger.debug("job %d arrived: job #%d, %s #%d", job.job_id, n, "load" if load else "store", n_kind)
        if f.crash_on_job == n:
            self.crash(f"job {job.job_id} is job #{n}")
        if f.truncate_on_job == n:
            self._truncate()
        return JobPlan(
            ordinal=n,
            delay_s=f.delay_s + (f.load_delay_s if load else f.store_delay_s),
            crash_mid=self.may_crash and (f.crash_mid_job == n or (load and f.crash_mid_load == n_kind)),
            enospc=not load and _from_nth(f.enospc_on_store, n_kind),
            short_reads=load and _from_nth(f.short_read, n_kind),
            corrupt_reads=load and _from_nth(f.corrupt_read, n_kind),
            hold_path="" if load else f.store_hold_path,
        )

    @staticmethod
    def hold(plan: JobPlan, stop: threading.Event) -> bool:
        """Wait while ``plan.hold_path`` exists; False if ``stop`` was set meanwhile (the job fails)."""
        while plan.hold_path and os.path.exists(plan.hold_path):
            if stop.wait(HOLD_POLL_S):
                return False
        return True

    @contextmanager
    def armed(self, job: Job, plan: JobPlan) -> Iterator[None]:
        """Arm the file faults of ``plan`` on ``job``'s NVMe slots while the block runs."""
        on = [name for name, flag in (("enospc", plan.enospc), ("short", plan.short_reads),
                                      ("corrupt", plan.corrupt_reads)) if flag]
        if self.file is None or not on:
            yield
            return
        slots = list(job.nvme_slots)
        for name in on:
            self.file.arm(name, slots, True)
        try:
            yield
        finally:
            for name in on:
                self.file.arm(name, slots, False)

    def crash(self, reason: str) -> None:
        """Die like a crashed process (no cleanup, no replies), if ``crash_limit`` allows."""
        if not self.may_crash:
            logger.warning("fault switch: would crash (%s), but crash_limit=%d is used up", reason, self.faults.crash_limit)
            return
        with open(self.crash_log, "a") as log:
            log.write(f"{os.getpid()} {reason}\n")
        logger.warning("fault switch: %s; exiting with %d", reason, FAULT_EXIT_CODE)
        logging.shutdown()
        os._exit(FAULT_EXIT_CODE)

    def _truncate(self) -> None:
        assert self.store_path is not None, "attach() first"
        size = self.store_path.stat().st_size
        keep = int(size * self.faults.truncate_keep) // TRUNCATE_ALIGN * TRUNCATE_ALIGN
        os.truncate(self.store_path, keep)
        logger.warning("fault switch: truncated %s from %d to %d bytes", self.store_path, size, keep)
