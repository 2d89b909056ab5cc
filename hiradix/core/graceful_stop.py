"""Graceful stop of one tree's lower tiers: the writes in flight land or are counted lost, bounded.

A stopping server (SIGTERM, or SGLang's ``ShutdownReq``) would kill the I/O worker with its
writes in flight: a demotion's NVMe slot is free in the durable index until the write lands
(:mod:`hiradix.persistence.index`), so every page on its way down is lost, and a cluster-store
PUT in flight never lands. :class:`GracefulStop` lets them land first, at most ``timeout_s``
(``--hiradix-stop-timeout-s``) after the stop was asked for:

1. :meth:`GracefulStop.request` (a signal handler may call it: one attribute write) asks for a
   stop. At its next step the tier controller marks every write in flight (DEMOTE, PUT) as
   expired on this rank; the TP agreement makes that *any* rank's (:meth:`expired_here`,
   :meth:`note`), so every rank enters the drain in the same step, and the controller starts
   no new transfer below DRAM from then on.
2. :meth:`GracefulStop.drain` (:meth:`hiradix.core.controller.TierController.drain`) waits for
   the I/O results and applies those every rank agrees on, as a step does; what lands is
   recorded in the durable index (a page once its parent page is listed, so the index holds no
   orphan), and the DRAM ancestors of landed pages are written too (the controller's
   ``NvmeLink.persist_prefixes``), so a landed page is not left waiting for a parent that stays in DRAM.
   It ends when no write is in flight, or when any rank's deadline passed or its I/O worker is
   gone (agreed, so every rank ends in the same round). The rest is lost.
3. It logs one line (:class:`StopReport`): writes in flight, pages kept (landed and listed by
   the durable index), lost, and how many pages the index lists. The caller closes the tiers
   (the index is synced once, at close).

Bookkeeping only: the I/O port's ``wait`` is the one blocking call. The drain is a part of the
controller kept in its own module: it goes through the controller's own completion path (its
I/O results, ``_apply``, ``NvmeLink.persist_prefixes``), so a landed write is applied as a step applies it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from hiradix.core.ledger import Kind, TierBooks
from hiradix.core.ports import OK

if TYPE_CHECKING:
    from hiradix.core.controller import TierController

logger = logging.getLogger(__name__)

WRITES = (Kind.DEMOTE, Kind.PUT)  # the transfers a stop waits for
WAIT_STEP_S = 0.05  # longest wait for I/O results between two agreement rounds of the drain, in seconds


@dataclass
class StopReport:
    """What a drain did (pages, except where it says jobs).

    Attributes:
        timeout_s: the bound, in seconds.
        nvme_jobs, nvme_pages: NVMe writes (DEMOTE) in flight when the drain began.
        ancestor_pages: NVMe writes of ancestors the drain started (their children landed).
        nvme_landed, nvme_failed: NVMe write pages that landed / failed or were aborted.
        nvme_kept: pages that landed during the drain and that the durable index lists at its
            end; None where this rank keeps no index.
        listed_pages: pages the durable index lists at the end; None as ``nvme_kept``.
        put_jobs, put_pages, put_landed: cluster-store PUTs in flight at the start, pages landed.
        flushed_jobs: worker jobs of a flushed (or abandoned) prefix, nothing to keep.
        elapsed_s: how long the drain took, in seconds.
        timed_out: the deadline passed (or the I/O worker was gone) with writes in flight.
    """

    timeout_s: float
    nvme_jobs: int = 0
    nvme_pages: int = 0
    ancestor_pages: int = 0
    nvme_landed: int = 0
    nvme_failed: int = 0
    nvme_kept: Optional[int] = None
    listed_pages: Optional[int] = None
    put_jobs: int = 0
    put_pages: int = 0
    put_landed: int = 0
    flushed_jobs: int = 0
    elapsed_s: float = 0.0
    timed_out: bool = False

    @property
    def nvme_lost(self) -> int:
        """NVMe write pages not kept: failed, not landed in time, or waiting for a parent page."""
        kept = self.nvme_landed if self.nvme_kept is None else self.nvme_kept
        return self.nvme_pages + self.ancestor_pages - kept

    def line(self) -> str:
        """One log line."""
        kept = (f"kept {self.nvme_kept} pages (landed, in the durable index)" if self.nvme_kept is not None
                else f"{self.nvme_landed} pages landed (this rank keeps no index)")
        unlisted = self.nvme_landed - self.nvme_kept if self.nvme_kept is not None else 0
        unlanded = self.nvme_pages + self.ancestor_pages - self.nvme_landed - self.nvme_failed
        listed = f"; the durable index lists {self.listed_pages} pages" if self.listed_pages is not None else ""
        return (f"hiradix: stop: NVMe writes in flight: {self.nvme_jobs} jobs, {self.nvme_pages} pages "
                f"(+{self.ancestor_pages} pages of ancestors written at the stop); {kept}, lost {self.nvme_lost} "
                f"({self.nvme_failed} failed, {unlanded} not landed within {self.timeout_s:g} s, {unlisted} landed "
                f"without their parent page on NVMe); store PUTs in flight: {self.put_jobs} jobs, {self.put_pages} "
                f"pages, {self.put_landed} landed, {self.put_pages - self.put_landed} lost; {self.flushed_jobs} jobs "
                f"of flushed prefixes{listed}; took {self.elapsed_s:.2f} s")


def writes_in_flight(books: TierBooks) -> list[int]:
    """Op ids of the writes in flight (DEMOTE, PUT), ascending (the same on every TP rank)."""
    return sorted(op.op_id for op in books.ops.values() if op.kind in WRITES)


class GracefulStop:
    """The stop of one controller: asked for, agreed across TP ranks, drained once.

    Args:
        timeout_s: how long the drain may take from the request (or from its start), in seconds.
        clock: monotonic seconds (the controller's).
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float]):
        self.timeout_s = timeout_s
        self.clock = clock
        self.requested_s: Optional[float] = None  # when request() was called; written by a signal handler
        self.agreed = False  # every rank stops (some rank asked); set by note() in a step
        self.report: Optional[StopReport] = None  # set once drained

    def request(self) -> None:
        """Ask for a stop (idempotent). Safe from a signal handler: one attribute write."""
        if self.requested_s is None:
            self.requested_s = self.clock()

    def expired_here(self, books: TierBooks) -> set[int]:
        """The op ids this rank marks expired in a step's agreement: every write in flight once a
        stop was asked for here (a write's deadline is read by nothing else)."""
        return set(writes_in_flight(books)) if self.requested_s is not None else set()

    def note(self, expired: set[int], books: TierBooks) -> None:
        """After a step's agreement: a write that expired on any rank means some rank stops."""
        if not self.agreed and expired and expired & set(writes_in_flight(books)):
            self.agreed = True

    def drain(self, ctl: TierController) -> StopReport:
        """Let ``ctl``'s writes in flight land or time out (see the module docstring); idempotent.

        Every TP rank must call it at the same point (after the same step, or at close).

        Returns:
            The report (also logged).
        """
        if self.report is not None:
            return self.report
        if ctl.client is None:  # no tier below DRAM: nothing is ever written down
            self.report = StopReport(self.timeout_s)
            return self.report
        start_s = self.clock()
        deadline_s = (self.requested_s if self.requested_s is not None else start_s) + self.timeout_s
        books = ctl.books
        report = self.report = StopReport(self.timeout_s, flushed_jobs=len(books.pending_ids()) - len(books.ops))
        for op in books.ops.values():
            if op.kind in WRITES:
                pages = len(op.src_ids)
                if op.kind == Kind.DEMOTE:
                    report.nvme_jobs, report.nvme_pages = report.nvme_jobs + 1, report.nvme_pages + pages
                else:
                    report.put_jobs, report.put_pages = report.put_jobs + 1, report.put_pages + pages
        pending = writes_in_flight(books)
        if pending:
            logger.info("hiradix: stop: waiting at most %.1f s for %d NVMe writes (%d pages) and %d store PUTs "
                        "in flight", max(0.0, deadline_s - start_s), report.nvme_jobs, report.nvme_pages, report.put_jobs)
        landed_slots: list[Any] = []
        while pending:
            if self._round(ctl, pending, deadline_s, landed_slots):
                report.timed_out = True
                break
            pending = writes_in_flight(books)
        if ctl.journal is not None:
            report.nvme_kept = ctl.journal.durable_pages(landed_slots)
            report.listed_pages = ctl.journal.durable_pages()
        report.elapsed_s = self.clock() - start_s
        logger.info("%s", report.line())
        return report

    def _round(self, ctl: TierController, pending: list[int], deadline_s: float, landed_slots: list) -> bool:
        """One agreement round over the writes ``pending``; True when the drain must end (a rank's
        deadline passed or its I/O side is gone)."""
        left_s = max(0.0, min(deadline_s - self.clock(), WAIT_STEP_S))
        asked_s = self.clock()
        results = ctl.client.wait(left_s) if ctl.client is not None else []
        ctl._record_results(results)
        local = {op_id: ctl._local_done[op_id] for op_id in pending if op_id in ctl._local_done}
        # The I/O worker's wait returns early and empty only once the worker is gone.
        gone = not results and self.clock() - asked_s < left_s / 2 and len(local) < len(pending)
        give_up = gone or self.clock() >= deadline_s
        finished, expired, _ = ctl.sync.agree(pending, local, set(pending) if give_up else set())
        for op_id in sorted(finished):
            self._count(ctl, op_id, finished[op_id], landed_slots)
        if expired & set(pending):
            return True
        if ctl.books.in_flight(Kind.BACKUP):  # ancestors only in HBM (write_back): in DRAM now
            ctl._reap(ctl.mover.flush())
        before = set(writes_in_flight(ctl.books))
        ctl.nvme.persist_prefixes()  # the DRAM ancestors of what landed go down too
        started = set(writes_in_flight(ctl.books)) - before
        self.report.ancestor_pages += sum(len(ctl.books.ops[i].src_ids) for i in started)
        return False

    def _count(self, ctl: TierController, op_id: int, outcome: int, landed_slots: list) -> None:
        """Apply one agreed write (the controller's completion path) and count its pages."""
        op = ctl.books.ops.get(op_id)
        ctl._apply(op_id, outcome)
        if op is None:
            return
        pages, report = len(op.src_ids), self.report
        if op.kind == Kind.DEMOTE:
            if outcome == OK:
                report.nvme_landed += pages
                landed_slots.extend(op.dst_ids)
            else:
                report.nvme_failed += pages
        elif op.kind == Kind.PUT and outcome == OK:
            report.put_landed += pages
