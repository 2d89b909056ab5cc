"""Reads about to land are waited for before a prefill batch forms (pure bookkeeping).

A request whose history continues on NVMe or in the store is held at admission until its read
lands in DRAM (:mod:`hiradix.core.admission_holds`). Held while a batch forms, it misses that batch
and waits for the whole forward of the others, although its read (a few MB from the page cache)
may land milliseconds later: with requests arriving together (a closed-loop batch, a burst of
returning sessions), most of hiradix's arrival-to-admission time on the spill workload was that
(bench/RESULTS.md, issue 31: 124 ms of NVMe-read holds per request at ~500 ms per prefill forward).

So right before the scheduler forms a prefill batch (after the step that started the queued
requests' reads; only when the running batch has room), :class:`ReadLanding` names the reads
into DRAM of the requests at the queue's head (``LAND_HEAD_REQUESTS``, the ones the next batch
takes first; not the background reads of predicted returns), each only once in its life, and the
controller blocks up to ``LAND_WAIT_S`` for their results, then applies what landed in one more
agreed step: the batch forms with those requests in it. A read that did not land in time is held
as before. Where reads are slower than the bound (most waits time out: ``MIN_LANDED_SHARE``,
decayed), a rank stops waiting, probing one wait in ``PROBE_EVERY`` so it notices when reads are
fast again: the cost is bounded by ``LAND_WAIT_S`` per read and stays small where it never pays.

Under TP every rank names the same reads (ledger ops and the queue are agreed state) and takes
the extra step; whether and how long it waits is each rank's own.
"""

from __future__ import annotations

from typing import Container, Iterable, Mapping

from hiradix.core.ledger import Kind, Transfer
from hiradix.core.node import TreeNode

LAND_WAIT_S = 0.03  # longest wait before a prefill batch for the reads queued requests wait on
LAND_HEAD_REQUESTS = 4  # queued requests, from the head, whose reads a batch waits for
MAX_WAITED_IDS = 4096  # op ids remembered as waited for (ids grow: older ones are long finished)
MIN_LANDED_SHARE = 0.25  # below this decayed share of reads landing within the wait, stop waiting ...
PROBE_EVERY = 8  # ... but for one wait in this many
LANDED_DECAY = 0.8  # weight of the past in the landed share, per wait


class ReadLanding:
    """Which reads to wait for before the next prefill batch, and whether waiting pays (one TP rank)."""

    def __init__(self) -> None:
        self._waited: dict[int, None] = {}  # op ids already waited for once, oldest first
        self.landed_share = 1.0  # decayed share of the reads waited for that landed in time
        self._skipped = 0  # waits skipped in a row since the share fell

    def to_wait_for(self, head: Iterable[TreeNode], ops: Mapping[int, Transfer], background: Container[int]) -> set[int]:
        """The reads into DRAM in flight (``ops``: the ledger's transfers by id) of the ``head``
        nodes (what the queue's first requests matched) that no earlier batch waited for, less the
        ``background`` ones (predicted returns); marks them as waited for."""
        ids = set()
        for node in head:
            for op_id in node.ops:
                op = ops.get(op_id)
                if (op is not None and op.kind in (Kind.PREFETCH, Kind.GET) and op_id not in background
                        and op_id not in self._waited):
                    ids.add(op_id)
        for op_id in sorted(ids):
            self._waited[op_id] = None
        while len(self._waited) > MAX_WAITED_IDS:
            del self._waited[next(iter(self._waited))]
        return ids

    def worth_waiting(self) -> bool:
        """Whether to wait this time: reads have been landing within the wait, or it is a probe."""
        if self.landed_share >= MIN_LANDED_SHARE:
            return True
        self._skipped += 1
        if self._skipped >= PROBE_EVERY:
            self._skipped = 0
            return True
        return False

    def note(self, landed: int, waited_for: int) -> None:
        """A wait ended: ``landed`` of the ``waited_for`` reads landed within it."""
        if waited_for > 0:
            self.landed_share = LANDED_DECAY * self.landed_share + (1 - LANDED_DECAY) * landed / waited_for

    def reset(self) -> None:
        self._waited.clear()
