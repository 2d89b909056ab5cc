"""The cluster store's link: lookups an admission waits for, agreed across TP ranks, and the
outcomes of store jobs (pure decisions).

:class:`~hiradix.core.store_tier.StoreTier` decides what is shared and when the store is off;
this link is what the tier controller does with it per request and per finished job:

* a lookup (``exists`` for the pages after a local match) started at admission makes its request
  wait up to the load timeout (:class:`~hiradix.core.read_waits.ReadWaits`); one started by the
  look-ahead window waits only from admission on;
* each rank turns its lookup result into ``2 + pages worth reading`` (its load-or-recompute
  choice, :mod:`hiradix.core.store_reads`), the ranks agree on the MIN
  (:func:`~hiradix.core.outcomes.found_of`), and what every rank will read becomes a store-only
  node read into DRAM within the lookup's deadline (:meth:`StoreLink.apply_lookup`);
* a finished PUT or GET is counted, a PUT aborted under a dying worker queued again, a GET's
  misses held back from further lookups, and the GET's bandwidth measured
  (:meth:`StoreLink.note_transfer`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from hiradix.core.ledger import Kind, Transfer
from hiradix.core.node import TreeMatch, TreeNode
from hiradix.core.outcomes import LOOKUP_FAILED, found_of
from hiradix.core.read_waits import ReadWaits
from hiradix.core.store_tier import StoreTier


class StoreLink:
    """Lookups and store-job outcomes of one tree (one TP rank).

    Args:
        store: the store tier's decisions.
        waits: the deadlines admissions wait for.
        ranks: TP ranks that agree on each step (the ``auto`` read choice is one rank's only).
        read: starts a read from the store into DRAM: ``read(nodes, deadline_s)`` (the
            controller's prefetch; ``deadline_s`` None: no request waits for it yet).
    """

    def __init__(self, store: StoreTier, waits: ReadWaits, ranks: int,
                 read: Callable[[list[TreeNode], Optional[float]], Any]):
        self.store, self.waits, self.ranks, self.read = store, waits, ranks, read
        self._found: dict[int, int] = {}  # lookup op id -> pages this rank found (before the choice)

    def lookup(self, m: TreeMatch, tokens: Sequence[int], namespace: Optional[tuple], timeout_s: float,
               ahead: bool) -> bool:
        """Ask the store for the pages after a local match; True while that lookup runs. One at
        admission (``ahead`` False) makes the request wait up to ``timeout_s``. None asked while
        the store is off (:meth:`StoreTier.lookup`)."""
        lookup = self.store.lookup(m, tokens, namespace)
        if lookup is None:
            return False
        self.waits.start(lookup.op_id, timeout_s, waits_now=not ahead)
        return True

    def lookup_pending(self, m: TreeMatch, tokens: Sequence[int], namespace: Optional[tuple], timeout_s: float) -> bool:
        """Whether a lookup for the pages after ``m`` (a peek) is in flight and within its timeout."""
        lookup = self.store.pending(self.store.tail_hash(m, tokens, namespace))
        return lookup is not None and self.waits.waiting_on(lookup.op_id, timeout_s)

    def read_worth(self, tokens: int) -> bool:
        """Whether a store-only run of ``tokens`` the tree already holds is worth reading:
        ``never`` no; ``auto`` by this rank's estimates, with one rank only (the estimates
        differ between ranks and this choice is not agreed: under TP it reads)."""
        reads = self.store.reads
        if reads.mode == "auto" and self.ranks > 1:
            return True
        return reads.worth_pages(tokens // self.store.tree.page_size) > 0

    def agreement_value(self, result: Any) -> int:
        """This rank's value for a finished lookup (:func:`found_of` after its read choice)."""
        return found_of(result, lambda found, op_id=result.job_id: self._choose_read(op_id, found))

    def _choose_read(self, op_id: int, found_pages: int) -> int:
        self._found[op_id] = found_pages
        return self.store.reads.pages_to_read(found_pages)

    def apply_lookup(self, op_id: int, value: int) -> None:
        """Apply an agreed lookup (``value``: the MIN over ranks): attach what every rank reads
        and read it into DRAM within the lookup's deadline (if it has not expired)."""
        deadline_s, expired = self.waits.done(op_id)
        self.store.note_job(None, 0, 0, aborted=value == LOOKUP_FAILED)
        read = max(0, value - 2)
        node = self.store.finish_lookup(op_id, max(read, self._found.pop(op_id, 0)), read_pages=read)
        if node is not None:
            self.read([node], None if deadline_s is None or expired else deadline_s)

    def note_transfer(self, op: Transfer, result: Any, flags: Any, ok_pages: int, aborted: bool,
                      page_bytes: int) -> None:
        """A transfer completed on every rank: count store jobs (``flags``: per page, or one
        bool for all), measure the GET rate, requeue aborted PUTs, share what landed in DRAM."""
        pages = len(op.src_ids)
        if op.kind == Kind.GET and ok_pages and result is not None:
            self.store.reads.note_get(ok_pages * page_bytes, getattr(result, "duration_s", 0.0))
        if op.kind == Kind.PUT:  # before note_job: a switch-off there drops what this queues
            self.store.note_put_done(op.nodes, aborted=aborted)
        if op.kind in (Kind.PUT, Kind.GET):
            missed = [k for k, f in zip(op.src_ids, flags if isinstance(flags, list) else [flags] * pages)
                      if not f] if op.kind == Kind.GET and not aborted else []
            self.store.note_job(op.kind, pages, ok_pages, aborted, missed_keys=missed)
        if op.kind in (Kind.BACKUP, Kind.PREFETCH) and ok_pages:
            self.store.note_in_dram(op.nodes)
