"""The tier controller: decides *when* to back up, store, read and promote (pure decisions).

:class:`TierController` runs the tiers below HBM of one tree (one TP rank) in the scheduler
process, next to the prefix cache (CachedAttention §3.2-3.3), as its
:class:`~hiradix.core.plan.TierPlan` says. It asks the placement to make room and the ledger to
open each transfer, hands the transfer to the port that carries it out (the in-process
:class:`~hiradix.core.ports.HostMover` between HBM and DRAM, the I/O worker's
:class:`~hiradix.core.ports.IOClient` below), and completes it by id when every TP rank agrees it
finished (:class:`~hiradix.core.ports.RankAgreement`, once per :meth:`TierController.step`).
Work of one kind is its own object: reads into DRAM (:mod:`hiradix.core.dram_reads`) and how long
admissions wait for them (:mod:`hiradix.core.read_waits`), the NVMe link (demotions, restart
persistence, its switch: :mod:`hiradix.core.nvme_link`), the store link (lookups, job outcomes:
:mod:`hiradix.core.store_link`; its policy: :mod:`hiradix.core.store_tier`), the copies of HBM
pages into DRAM (:mod:`hiradix.core.backups`) and the graceful stop. The controller orders the work between them. The simulator assembles it
over data-less ports (:func:`hiradix.testing.sim_ports.simulated_controller`): the same decisions.

Where it blocks the scheduler thread, briefly: a write-back eviction with DRAM full of pages on
their way to NVMe waits for stores to land, at most ``backups.DEMOTION_WAIT_S`` (TP = 1 only); the
durable NVMe index is appended to and fsynced about once a second (:meth:`NvmeJournal.sync`);
after a stop, :meth:`drain` waits for writes in flight, at most ``--hiradix-stop-timeout-s``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

from hiradix.core.backups import DramBackups
from hiradix.core.dram_reads import DramReads
from hiradix.core.graceful_stop import GracefulStop, StopReport
from hiradix.core.ledger import Kind, TierBooks
from hiradix.core.node import Tier, TreeMatch, TreeNode
from hiradix.core.placement import DRAM_FREE_LOW, Placement
from hiradix.core import returns
from hiradix.core.nvme_link import NvmeLink
from hiradix.core.outcomes import outcome_of
from hiradix.core.plan import TierPlan
from hiradix.core.ports import ABORTED, OK, HostMover, IOClient, NvmeJournal, RankAgreement, SingleRank, StepVotes
from hiradix.core.read_landing import ReadLanding
from hiradix.core.read_waits import ReadWaits
from hiradix.core.stats import TierStats, occupancy_line
from hiradix.core.store_link import StoreLink
from hiradix.core.store_reads import StoreReadChoice
from hiradix.core.store_tier import StoreTier
from hiradix.core.tree import TieredRadixTree

logger = logging.getLogger(__name__)

SUMMARY_EVERY_S = 10.0  # one log line of occupancy this often


class TierController:
    """Runs the DRAM and NVMe tiers of one tree (one TP rank), as ``plan`` says.

    Args:
        tree: the tree whose nodes move.
        books: its DRAM/NVMe ledger (sized as the plan says).
        mover: carries out BACKUP/PROMOTE.
        client: carries out DEMOTE/PREFETCH and the store's jobs; None without a tier below DRAM.
        plan: the tiers and their policies (:class:`~hiradix.core.plan.TierPlan`).
        clock: monotonic seconds (injectable for the simulator).
        sync: TP agreement on completions (default: a single rank).
        journal: the durable NVMe index, or None (nothing persisted).
    """

    def __init__(self, tree: TieredRadixTree, books: TierBooks, mover: HostMover, client: Optional[IOClient],
                 plan: TierPlan, clock: Callable[[], float] = time.monotonic, sync: Optional[RankAgreement] = None,
                 journal: Optional[NvmeJournal] = None):
        self.tree, self.books, self.mover, self.client, self.plan, self.clock = tree, books, mover, client, plan, clock
        self.sync = sync or SingleRank()
        self.journal = journal
        books.nvme_journal = journal
        low = int(DRAM_FREE_LOW * books.dram.capacity) if plan.dram_free_low_pages is None else plan.dram_free_low_pages
        self.placement = Placement(tree, books, books.dram.capacity if plan.dram_staging else low)  # staging: all go
        self.stats = TierStats()
        wait = (lambda timeout_s: self._apply_results_now(self.client.wait(timeout_s))) if self.sync.size == 1 else None
        self.backups = DramBackups(plan, books, self.placement, mover, clock, wait, lambda: self._reap(self.mover.flush()))
        self.reads_ahead = returns.ReadAhead(books.dram.capacity, self.stats.read_ahead_tokens)  # predicted returns
        self.landing = ReadLanding()  # reads waited for before a prefill batch
        self.waits = ReadWaits(books.new_op_id, clock)  # how long admissions wait for reads and lookups
        self._local_done: dict[int, int] = {}  # finished here, not yet agreed: op id -> outcome
        self._results: dict[int, Any] = {}  # I/O JobResult by op id, until applied
        self.nvme = NvmeLink(tree, books, self.placement, client, mover, journal)
        self._last_summary_s = 0.0
        self._on_close: list[Callable[[], None]] = []  # resources of the assembly, released by close()
        self.store: Optional[StoreTier] = None
        if plan.store is not None:
            assert client is not None, "the store's jobs run in the I/O worker"
            # --hiradix-store-read auto also skips lookups unlikely to pay (TP 1: ranks ask the same lookups)
            reads = StoreReadChoice(plan.store_read, plan.hbm_page_bytes / tree.page_size, tree.page_size,
                                    skip_lookups=plan.store_read == "auto" and self.sync.size == 1)
            self.store = StoreTier(tree, books, self.placement, client, plan.store.key_prefix, plan.store_write_policy,
                                   clock, retry_s=plan.store_retry_s, reads=reads, waited=self.waits.waited)
        self.reads = DramReads(tree, books, self.placement, client, self.waits, self.reads_ahead, self.stats, self.store,
                               clock)
        self.store_link = None if self.store is None else StoreLink(self.store, self.waits, self.sync.size,
                                                                    self.reads.read_store)
        self.stop = GracefulStop(plan.stop_timeout_s, clock)  # asked for by a signal handler, drained by drain()

    def on_close(self, release: Callable[[], None]) -> None:
        """Call ``release`` when the controller closes (resources the assembly made)."""
        self._on_close.append(release)

    # ------------------------------------------------------------ HBM eviction
    def evict_hbm(self, num_tokens: int) -> list[Any]:
        """Free at least ``num_tokens`` HBM tokens, writing last copies back to DRAM first.

        Returns:
            Freed device slot arrays for SGLang's allocator.
        """
        self._reap(self.mover.flush())  # pending copies pin HBM slots; land them first
        left: list[TreeNode] = []
        freed = self.placement.evict_hbm(num_tokens, backup=self.backups.for_eviction(), left=left)
        self.nvme.store_last_copies()  # what just became DRAM-only starts down to NVMe now
        if self.store is not None:
            self.store.note_left_hbm(left)
        return freed

    # ------------------------------------------------------------ load back
    def load_back(self, nodes: list[TreeNode], hbm_slots: Any) -> tuple[dict[Tier, int], dict[Tier, int]]:
        """Promote DRAM nodes into the given new HBM slots, layer by layer.

        Returns:
            ``(read_from, waited_from)``: tokens whose DRAM copy was read from ``Tier.NVME`` /
            ``Tier.STORE`` for this use (whether the look-ahead window or the request started the
            read; SGLang's ``storage``), and those of them a request waited for at admission.
        """
        read_from = {Tier.NVME: 0, Tier.STORE: 0}
        waited_from = {Tier.NVME: 0, Tier.STORE: 0}
        for n in nodes:
            if n.dram_from is not None:
                read_from[n.dram_from] += n.num_tokens
                waited_from[n.dram_from] += n.num_tokens if n.waited_for_read else 0
        self.reads_ahead.used(nodes)
        self.stats.note_promoted(read_from[Tier.NVME], waited_from[Tier.NVME], read_from[Tier.STORE])
        op = self.books.prepare(Kind.PROMOTE, nodes, hbm_slots=hbm_slots)
        self.mover.promote(op)
        return read_from, waited_from

    def start_loading(self) -> int:
        """Start the promotions queued for the batch being built; returns its consumer index."""
        return self.mover.start_loading()

    def land_now(self) -> None:
        """Finish every pending device copy now and apply the outcomes (a shifted reuse reads the
        slots a promotion just filled)."""
        self._reap(self.mover.flush())

    # ------------------------------------------------------------ reads into DRAM
    def prefetch(self, nodes: list[TreeNode], timeout_s: float, **how: Any) -> bool:
        """Start reads into DRAM of ``nodes`` (:meth:`DramReads.start`); True while one is in flight."""
        return self.reads.start(nodes, timeout_s, **how)

    def read_ahead(self, key: Callable[[TreeNode, Tier], tuple], worth: Callable[[TreeNode], bool], timeout_s: float) -> int:
        """Background reads of predicted returns (:meth:`DramReads.read_ahead`); returns reads started."""
        return self.reads.read_ahead(key, worth, timeout_s)

    @property
    def store_enabled(self) -> bool:
        return self.store is not None and self.store.enabled

    def lookup(self, m: TreeMatch, tokens: Any, namespace: Optional[tuple], timeout_s: float, ahead: bool = False) -> bool:
        """Ask the cluster store for the pages after a local match (:meth:`StoreLink.lookup`)."""
        return self.store_link is not None and self.store_link.lookup(m, tokens, namespace, timeout_s, ahead)

    def lookup_pending(self, m: TreeMatch, tokens: Any, namespace: Optional[tuple], timeout_s: float) -> bool:
        """Whether a store lookup for the pages after ``m`` (a peek) is in flight and within its timeout."""
        return self.store_link is not None and self.store_link.lookup_pending(m, tokens, namespace, timeout_s)

    def store_read_worth(self, tokens: int) -> bool:
        """Whether a store-only run of ``tokens`` is worth reading (:meth:`StoreLink.read_worth`)."""
        return self.store_link is None or self.store_link.read_worth(tokens)

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """An extend batch prefilled ``tokens`` in ``seconds`` (the load-or-recompute estimate)."""
        if self.store is not None:
            self.store.reads.note_prefill(tokens, seconds)

    # ------------------------------------------------------------ per step
    def _record_results(self, results) -> None:
        """This rank's view of finished I/O jobs, kept until every rank agrees on them."""
        lookups = self.store.lookups if self.store is not None else {}
        for result in results:
            if result.job_id in lookups:
                self._local_done[result.job_id] = self.store_link.agreement_value(result)
            else:
                self._local_done[result.job_id] = outcome_of(result)
            self._results[result.job_id] = result

    def step(self) -> None:
        """Apply the completions every TP rank agrees on; store DRAM-only nodes to NVMe."""
        now = self.clock()
        if now - self._last_summary_s > SUMMARY_EVERY_S:
            self._last_summary_s = now
            logger.info("hiradix: %s", self.summary())
        self._local_done.update(dict.fromkeys(self.mover.finished(), OK))
        alive = True
        if self.client is not None:
            alive = self.client.check_alive()
            self._record_results(self.client.poll())
        lookups = self.store.lookups if self.store is not None else {}
        pending = sorted(self.books.pending_ids() + list(lookups) + self.waits.pseudo_ops())
        expired_here = self.waits.expired_here(now)
        expired_here |= self.stop.expired_here(self.books)  # a stop asked for here: agreed by every rank
        known = set(pending)
        gave_up = self.client is not None and not alive and self.client.disabled
        votes = StepVotes(io_gave_up=gave_up, store_retry_due=self.store is not None and self.store.retry_due())
        finished, expired, votes = self.sync.agree(
            pending, {k: v for k, v in self._local_done.items() if k in known}, expired_here, votes)
        self.waits.note_expired(expired)
        self.stop.note(expired, self.books)
        for op_id in sorted(finished):
            if op_id in lookups:
                self._apply_lookup(op_id, finished[op_id])
            else:
                self._apply(op_id, finished[op_id])
        self.backups.retry_deferred()  # the room the landed demotions made
        if self.stop.agreed:
            return  # stopping: no new transfer below DRAM; the caller drains those in flight (drain)
        if self.client is not None:
            if votes.io_gave_up:  # on every rank in the same step, also where the worker lives
                reason = "the I/O worker keeps dying" if gave_up else "another TP rank's I/O worker keeps dying"
                self.nvme.switch_off(reason)
                if self.store is not None:
                    self.store.switch_off(reason)
            self.nvme.apply_switch()
            self.nvme.store_last_copies()
            self.nvme.persist_prefixes()
            if self.store is not None:
                self.store.step(retry=votes.store_retry_due)

    def _apply(self, op_id: int, outcome: int) -> None:
        """Complete one agreed transfer (``outcome``: OK, ABORTED or FAILED on every rank)."""
        self._local_done.pop(op_id, None)
        self.waits.done(op_id)
        result = self._results.pop(op_id, None)
        ok = outcome == OK
        flags = (list(result.ok) if result is not None else True) if ok else False
        # A store that lands after the NVMe tier was switched off is not used (nothing attached).
        op = self.books.ops.get(op_id)
        late_store = op is not None and op.kind == Kind.DEMOTE and not self.books.nvme_enabled
        op = self.books.complete(op_id, flags, aborted=outcome == ABORTED or late_store)
        if op is None:
            return
        self.reads_ahead.landed(op_id, op.nodes)
        pages = len(op.src_ids)
        ok_pages = pages if flags is True else sum(bool(f) for f in flags) if flags else 0
        self.stats.note_transfer(op.kind, pages, ok_pages, self.plan.hbm_page_bytes, self.tree.page_size)
        if outcome != ABORTED:
            self.nvme.note_outcome(op.kind, ok_pages == pages)
        if op.kind == Kind.DEMOTE:  # a DRAM copy a PUT waits for stays (its source)
            self.placement.after_demote(op, keep=self.store.wants_put if self.store is not None else None)
        elif op.kind == Kind.PROMOTE and self.plan.dram_staging:
            self.placement.after_promote(op)
        if self.store_link is not None:
            self.store_link.note_transfer(op, result, flags, ok_pages, outcome == ABORTED, self.plan.hbm_page_bytes)

    def summary(self) -> str:
        """One line of tier occupancy and counters, for logs."""
        return occupancy_line(self.tree.tier_tokens, self.books, self.stats, self.store, self.backups.deferred)

    def _apply_results_now(self, results: list) -> None:
        """Single rank only: apply I/O results now (no agreement needed); a store lookup's result
        is applied as a lookup (as :meth:`step` does), not as a transfer."""
        lookups = self.store.lookups if self.store is not None else {}
        for result in results:
            if result.job_id in lookups:
                self._apply_lookup(result.job_id, self.store_link.agreement_value(result))
                continue
            self._results[result.job_id] = result
            self._apply(result.job_id, outcome_of(result))

    def _apply_lookup(self, op_id: int, value: int) -> None:
        """Complete one store lookup (``value``: its agreed found value, :meth:`StoreLink.apply_lookup`)."""
        self._local_done.pop(op_id, None)
        self._results.pop(op_id, None)
        self.store_link.apply_lookup(op_id, value)

    def _reap(self, op_ids: list[int]) -> None:
        """Apply in-process copies that every rank finished at the same point (a flush)."""
        mover_ops = {op.op_id for op in self.books.in_flight() if op.kind in (Kind.BACKUP, Kind.PROMOTE)}
        for op_id in sorted(set(op_ids) | {k for k in self._local_done if k in mover_ops}):
            self._apply(op_id, OK)

    def land_queued_reads(self, head: Sequence[TreeNode], timeout_s: float) -> bool:
        """Right before a prefill batch forms: block up to ``timeout_s`` for the reads into DRAM
        of ``head`` (the nodes the requests at the queue's head matched) that no earlier batch
        waited for (:class:`ReadLanding`; not while such waits keep timing out), then apply what
        landed with one more agreed step. Returns whether it stepped (the same on every rank)."""
        if self.client is None or self.stop.agreed:
            return False
        ids = self.landing.to_wait_for(head, self.books.ops, self.reads_ahead.in_flight)
        if not ids:
            return False
        if self.landing.worth_waiting():  # this rank's own choice: only the step below is agreed
            deadline_s = self.clock() + timeout_s
            while not ids <= self._local_done.keys():
                left_s = deadline_s - self.clock()
                if left_s <= 0 or not self.client.check_alive():
                    break
                self._record_results(self.client.wait(left_s))
            self.landing.note(len(ids & self._local_done.keys()), len(ids))
        self.step()
        return True

    def wait_for_io(self, timeout_s: float, wake: Sequence[Any] = ()) -> int:
        """Block until an I/O result arrives (recorded for the next :meth:`step` to agree on and
        apply), a ``wake`` socket is readable, or ``timeout_s`` passes; returns results recorded.
        For a scheduler with nothing to run but requests waiting for reads: instead of spinning."""
        if self.client is None:
            return 0
        results = self.client.wait(timeout_s, wake)
        self._record_results(results)
        return len(results)

    # ------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        """Forget every lower-tier copy (SGLang's ``flush_cache``); the cluster store keeps its objects."""
        self._reap(self.mover.flush())
        self.mover.drop_pending()
        self.books.reset()
        if self.store is not None:
            self.store.reset()
        self.waits.reset()
        self.reads_ahead.reset()
        self.landing.reset()
        self.backups.deferred.clear()
        if self.journal is not None:
            self.journal.landed.clear()  # nodes of the old tree (their paths end at the old root)

    def drain(self) -> StopReport:
        """Stop: let the NVMe and store writes in flight land, at most ``stop_timeout_s`` after the
        stop was asked for (or from now), recording what landed; logs and returns the report
        (:mod:`hiradix.core.graceful_stop`). Every TP rank calls it at the same point; idempotent."""
        return self.stop.drain(self)

    def close(self) -> None:
        """Stop the I/O side and release the resources the assembly registered."""
        if self.client is not None:
            self.client.close()
        for release in self._on_close:
            release()
        self._on_close.clear()
