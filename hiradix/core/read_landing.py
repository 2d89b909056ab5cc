"""Reads about to land are waited for before a prefill batch forms (pure bookkeeping).

A request whose history continues on NVMe or in the store is held at admission until its read
lands in DRAM (:mod:`hiradix.core.admission_holds`). Held while a batch forms, it misses that batch
and waits for the whole forward of the others, although its read (a few MB from the page cache)
may land milliseconds later: with requests arriving together (a closed-loop batch, a burst of
returning sessions), most of hiradix's arrival-to-admission time on the spill workload was that
(bench/RESULTS.md, issue 31: 124 ms of NVMe-read holds per request at ~500 ms per prefill forward).

So right before the scheduler forms a prefill batch (after the step that started the queued
requests' reads), :class:`ReadLanding` names the reads queued requests wait for (started at
admission or by the look-ahead window; not the background reads of predicted returns), each
only once in its life, and the controller blocks up to ``LAND_WAIT_S`` for their results, then
applies what landed: the batch forms with those requests in it. The bound makes the cost at most
``LAND_WAIT_S`` per read ever waited for, also where reads are slow; a read that did not land
in time is held as before.

Under TP every rank names the same reads (ledger ops are agreed state) and then takes one more
agreed step, so the ranks stay in the same collectives; each rank's wait is its own.
"""

from __future__ import annotations

from typing import Iterable

from hiradix.core.ledger import Kind, Transfer

LAND_WAIT_S = 0.03  # longest wait before a prefill batch for the reads queued requests wait on
MAX_WAITED_IDS = 4096  # op ids remembered as waited for (ids grow: older ones are long finished)


class ReadLanding:
    """Which reads to wait for before the next prefill batch (one TP rank)."""

    def __init__(self) -> None:
        self._waited: dict[int, None] = {}  # op ids already waited for once, oldest first

    def to_wait_for(self, in_flight: Iterable[Transfer], background: Iterable[int]) -> set[int]:
        """The reads into DRAM in flight (``in_flight``: the ledger's transfers) that no earlier
        batch waited for, less the ``background`` ones (predicted returns nobody waits for);
        marks them as waited for."""
        skip = set(background)
        ids = {op.op_id for op in in_flight if op.kind in (Kind.PREFETCH, Kind.GET)
               and op.op_id not in skip and op.op_id not in self._waited}
        for op_id in sorted(ids):
            self._waited[op_id] = None
        while len(self._waited) > MAX_WAITED_IDS:
            del self._waited[next(iter(self._waited))]
        return ids

    def reset(self) -> None:
        self._waited.clear()
