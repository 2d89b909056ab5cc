"""The tier controller: decides *when* to back up, store, prefetch and promote (pure decisions).

:class:`TierController` runs the DRAM and NVMe tiers of one tree (one TP rank) in the scheduler
process, next to the prefix cache (CachedAttention §3.2-3.3). It asks the placement
(:class:`hiradix.core.placement.Placement`) to make room and the ledger
(:class:`hiradix.core.ledger.TierBooks`) to open each transfer, hands the transfer to the port
that carries it out (:class:`~hiradix.core.ports.HostMover` in this process,
:class:`~hiradix.core.ports.IOClient` for NVMe), and completes it by id when the port reports.
It is assembled with real ports by :func:`hiradix.runtime.assembly.build_tiers` and with
data-less ones by :func:`hiradix.testing.sim_ports.simulated_controller`: the same decisions.

Per scheduler step (:meth:`step`, from SGLang's per-step cache-event hook) it reaps finished
copies and I/O results, applies those every TP rank agrees on
(:class:`~hiradix.core.ports.RankAgreement`), stores DRAM-only nodes to NVMe, and persists the
ancestors of what landed there. It owns the NVMe tier's on/off switch: the tier goes off, with
one warning, after repeated I/O-worker deaths or ``MAX_NVME_FAILURES_IN_ROW`` failed NVMe writes
or reads in a row (:meth:`switch_off_nvme`); the cache then goes on with HBM and DRAM.

Where it waits: NVMe I/O never runs on the scheduler thread, but two things here can block it
briefly. A write-back eviction with DRAM full of pages on their way to NVMe waits for stores to
land, at most ``DEMOTION_WAIT_S`` (TP = 1 only). The durable NVMe index is appended to, and
fsynced about once a second, on this thread (:meth:`NvmeJournal.sync`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from hiradix.core.ledger import Kind, TierBooks, Transfer
from hiradix.core.node import Tier, TreeNode
from hiradix.core.placement import DRAM_FREE_LOW, Placement
from hiradix.core.ports import ABORTED, FAILED, OK, HostMover, IOClient, NvmeJournal, RankAgreement, SingleRank
from hiradix.core.stats import TierStats
from hiradix.core.tree import TieredRadixTree

logger = logging.getLogger(__name__)

MAX_DEMOTIONS_IN_FLIGHT = 64  # NVMe store jobs in flight, each one node
# An HBM eviction that needs DRAM room waits at most this long for stores in flight.
DEMOTION_WAIT_S = 0.2
# I/O jobs of one direction (NVMe writes, or reads) that fail in a row before the NVMe tier is
# switched off: a healthy disk fails none, so this many in a row is a broken tier.
MAX_NVME_FAILURES_IN_ROW = 5
SUMMARY_EVERY_S = 10.0  # one log line of occupancy this often
# Selective write-through backs up a node once used again: its insert counts 1 in hit_count.
SELECTIVE_MIN_HITS = 2


def outcome_of(result: Any) -> int:
    """An I/O :class:`~hiradix.core.ports.JobResult` as an agreement outcome.

    A job-level error (worker died, disabled, shut down, job rejected) moved nothing: ABORTED,
    the source copy stays. Otherwise a page that did not verify makes it FAILED.
    """
    if all(result.ok):
        return OK
    return ABORTED if result.error else FAILED


class TierController:
    """Runs the DRAM and NVMe tiers of one tree (one TP rank).

    Args:
        tree: the tree whose nodes move.
        books: its DRAM/NVMe ledger.
        mover: carries out BACKUP/PROMOTE.
        client: carries out DEMOTE/PREFETCH; None without an NVMe tier.
        page_bytes: bytes per page (all layers), for the counters.
        write_through: back up to DRAM at insert (else at HBM eviction, write-back).
        clock: monotonic seconds (injectable for the simulator).
        sync: TP agreement on completions (default: a single rank).
        journal: the durable NVMe index, or None (nothing persisted).
        dram_free_low_pages: see :class:`Placement`; default ``DRAM_FREE_LOW`` of DRAM.
        dram_staging: DRAM holds pages only in flight between HBM and NVMe (``--hiradix-dram-mode
            staging``): a DRAM copy goes as soon as its store to NVMe or its promotion to HBM lands.
        write_selective: SGLang HiCache's ``write_through_selective``, for measurements (the
            simulator): back up only nodes hit again (at insert or at the hit); a node never hit
            leaves HBM without a copy. Not a server flag: it loses the chat histories this
            cache exists for (bench/RESULTS.md, "Selective write-through").
    """

    def __init__(
        self,
        tree: TieredRadixTree,
        books: TierBooks,
        mover: HostMover,
        client: Optional[IOClient],
        page_bytes: int,
        write_through: bool,
        clock: Callable[[], float] = time.monotonic,
        sync: Optional[RankAgreement] = None,
        journal: Optional[NvmeJournal] = None,
        dram_free_low_pages: Optional[int] = None,
        dram_staging: bool = False,
        write_selective: bool = False,
    ):
        self.tree = tree
        self.books = books
        self.dram_staging = dram_staging
        self.write_selective = write_selective
        low = int(DRAM_FREE_LOW * books.dram.capacity) if dram_free_low_pages is None else dram_free_low_pages
        low = books.dram.capacity if dram_staging else low  # staging: every stored page leaves DRAM
        self.placement = Placement(tree, books, low)
        self.mover = mover
        self.client = client
        self.page_bytes = page_bytes
        self.write_through = write_through
        self.clock = clock
        self.sync = sync or SingleRank()
        self.journal = journal
        books.nvme_journal = journal
        self.stats = TierStats()
        self._prefetch_deadline_s: dict[int, Optional[float]] = {}  # PREFETCH op -> give-up time; None: not yet waited on
        self._expired: set[int] = set()  # PREFETCH op ids whose deadline passed (agreed)
        self._local_done: dict[int, int] = {}  # finished here, not yet agreed: op id -> outcome
        self._results: dict[int, Any] = {}  # I/O JobResult by op id, until applied
        self._nvme_failures_in_row = {Kind.DEMOTE: 0, Kind.PREFETCH: 0}
        self.nvme_off_reason: Optional[str] = None  # set once, by switch_off_nvme
        self._last_summary_s = 0.0
        self._on_close: list[Callable[[], None]] = []  # resources of the assembly, released by close()

    def on_close(self, release: Callable[[], None]) -> None:
        """Call ``release`` when the controller closes (resources the assembly made)."""
        self._on_close.append(release)

    # ------------------------------------------------------------ backups
    def after_insert(self, new_nodes: list[TreeNode]) -> None:
        """Write-through: start DRAM backups of nodes that just took HBM slots."""
        if not self.write_through:
            return
        nodes = [n for n in new_nodes if n.alive and not n.in_tier(Tier.DRAM) and n.in_tier(Tier.HBM)]
        if self.write_selective:
            nodes = [n for n in nodes if n.hit_count >= SELECTIVE_MIN_HITS]
        if nodes:
            op = self.placement.prepare(Kind.BACKUP, nodes)
            if op is not None:
                self.mover.backup(op)

    def after_hit(self, nodes: list[TreeNode]) -> None:
        """Selective write-through only: back up the HBM-only nodes a request just hit again."""
        if self.write_selective:
            self.after_insert(nodes)

    # ------------------------------------------------------------ HBM eviction
    def evict_hbm(self, num_tokens: int) -> list[Any]:
        """Free at least ``num_tokens`` HBM tokens, writing last copies back to DRAM first.

        Returns:
            Freed device slot arrays for SGLang's allocator.
        """
        self._reap(self.mover.flush())  # pending copies pin HBM slots; land them first
        backup = (lambda n: n.hit_count >= SELECTIVE_MIN_HITS and self._backup_now(n)) if self.write_selective else self._backup_now
        freed = self.placement.evict_hbm(num_tokens, backup=backup)
        self._store_last_copies()  # what just became DRAM-only starts down to NVMe now
        return freed

    def _backup_now(self, node: TreeNode) -> bool:
        """Write-back: copy a last HBM copy to DRAM synchronously; False if DRAM has no room.

        Eviction must always make progress, so DRAM may drop its own last copies here
        (least valuable first by the policy) even while NVMe has room.
        """
        op = self.placement.prepare(Kind.BACKUP, [node])
        deadline_s = self.clock() + DEMOTION_WAIT_S
        # Waiting on I/O results outside the per-step agreement would let TP ranks diverge.
        while op is None and self.sync.size == 1 and self.books.in_flight(Kind.DEMOTE) and self.clock() < deadline_s:
            # DRAM is full of last copies on their way to NVMe: let some land (bounded).
            self._apply_results_now(self.client.wait(deadline_s - self.clock()))
            op = self.placement.prepare(Kind.BACKUP, [node])
        op = op or self.placement.prepare(Kind.BACKUP, [node], allow_drop=True)
        if op is None:
            return False
        self.mover.backup(op)
        self._reap(self.mover.flush())
        return node.in_tier(Tier.DRAM)

    # ------------------------------------------------------------ load back
    def load_back(self, nodes: list[TreeNode], hbm_slots: Any) -> int:
        """Promote DRAM nodes into the given new HBM slots, layer by layer.

        Returns:
            Tokens whose DRAM copy was read up from NVMe for this use (reported as NVMe hits,
            SGLang's ``storage``), whether the look-ahead read them ahead of admission or the
            request waited for the read; the rest were DRAM residents (``host``).
        """
        from_nvme = sum(n.num_tokens for n in nodes if n.dram_from_nvme)
        waited = sum(n.num_tokens for n in nodes if n.waited_for_read)
        self.stats.prefetch_tokens["used"] += from_nvme
        self.stats.storage_hit_tokens["ahead"] += from_nvme - waited
        self.stats.storage_hit_tokens["at_admission"] += waited
        op = self.books.prepare(Kind.PROMOTE, nodes, hbm_slots=hbm_slots)
        self.mover.promote(op)
        return from_nvme

    def start_loading(self) -> int:
        """Start the promotions queued for the batch being built; returns its consumer index."""
        return self.mover.start_loading()

    # ------------------------------------------------------------ prefetch
    def prefetch(self, nodes: list[TreeNode], timeout_s: float, ahead: bool = False) -> bool:
        """Start NVMe -> DRAM reads of NVMe-only ``nodes`` (a matched path's tail).

        Args:
            nodes: the NVMe-only tail of one request's matched path.
            timeout_s: how long the request may wait for them at admission.
            ahead: started by the look-ahead window (the pages then count as DRAM hits).

        Returns:
            True if a read is in flight for these nodes (started now or earlier).
        """
        if self.client is None or not self.books.nvme_enabled:
            return False
        todo = [n for n in nodes if n.alive and not n.in_tier(Tier.DRAM) and n.pinned[Tier.NVME] == 0]
        busy = any(n.pinned[Tier.NVME] > 0 for n in nodes)
        if not todo:
            return busy
        op = self.placement.prepare(Kind.PREFETCH, todo, ahead=ahead)
        if op is None:
            return busy
        self.client.submit_load(op.op_id, op.src_ids, op.dst_ids)
        self.stats.prefetch_tokens["started"] += len(op.src_ids) * self.tree.page_size
        # A look-ahead read may start deep in the queue: its request's wait (the timeout)
        # starts only when the request reaches admission (prefetch_pending).
        self._prefetch_deadline_s[op.op_id] = None if ahead else self.clock() + timeout_s
        return True

    def prefetch_pending(self, nodes: list[TreeNode], timeout_s: float) -> bool:
        """Whether a read for one of ``nodes`` is still in flight and within its timeout.

        Called when the request reaches admission; a look-ahead read's timeout starts here.
        Deadlines are judged once per step (:meth:`step`), agreed across TP ranks.
        """
        pending = False
        for node in nodes:
            for op_id in node.ops:
                if op_id in self._prefetch_deadline_s and op_id not in self._expired:
                    if self._prefetch_deadline_s[op_id] is None:
                        self._prefetch_deadline_s[op_id] = self.clock() + timeout_s
                    pending = True
        return pending

    # ------------------------------------------------------------ per step
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
            for result in self.client.poll():
                self._local_done[result.job_id] = outcome_of(result)
                self._results[result.job_id] = result
        pending = self.books.pending_ids()
        expired_here = {op for op, t in self._prefetch_deadline_s.items() if t is not None and t <= now}
        known = set(pending)
        finished, expired = self.sync.agree(pending, {k: v for k, v in self._local_done.items() if k in known}, expired_here)
        self._expired |= expired
        for op_id in sorted(finished):
            self._apply(op_id, finished[op_id])
        if self.client is not None:
            if not alive and self.client.disabled:
                self.switch_off_nvme("the I/O worker keeps dying")
            self._apply_nvme_switch()
            self._store_last_copies()
            self._persist_prefixes()

    def _apply(self, op_id: int, outcome: int) -> None:
        """Complete one agreed transfer (``outcome``: OK, ABORTED or FAILED on every rank)."""
        self._local_done.pop(op_id, None)
        self._prefetch_deadline_s.pop(op_id, None)
        self._expired.discard(op_id)
        result = self._results.pop(op_id, None)
        ok = outcome == OK
        flags = (list(result.ok) if result is not None else True) if ok else False
        # A store that lands after the NVMe tier was switched off is not used (nothing attached).
        op = self.books.ops.get(op_id)
        late_store = op is not None and op.kind == Kind.DEMOTE and not self.books.nvme_enabled
        op = self.books.complete(op_id, flags, aborted=outcome == ABORTED or late_store)
        if op is None:
            return
        pages = len(op.src_ids)
        ok_pages = pages if flags is True else sum(bool(f) for f in flags) if flags else 0
        self.stats.bytes_moved[op.kind.name] += ok_pages * self.page_bytes
        if ok_pages < pages:
            self.stats.transfers_failed[op.kind.name] += 1
        if op.kind in self._nvme_failures_in_row and outcome != ABORTED:
            self._note_nvme_outcome(op.kind, ok_pages == pages)
        if op.kind == Kind.DEMOTE:
            self.placement.after_demote(op)
        elif op.kind == Kind.PROMOTE and self.dram_staging:
            self.placement.after_promote(op)
        elif op.kind == Kind.PREFETCH:
            self.stats.prefetch_tokens["completed"] += ok_pages * self.tree.page_size
            self.stats.prefetch_tokens["failed"] += (pages - ok_pages) * self.tree.page_size

    def _note_nvme_outcome(self, kind: Kind, ok: bool) -> None:
        """Count I/O jobs of one direction (DEMOTE = writes, PREFETCH = reads) that failed in a
        row: I/O errors, ENOSPC, short reads, checksum mismatches (aborted jobs, e.g. of a dead
        worker, are the I/O client's business)."""
        streak = 0 if ok else self._nvme_failures_in_row[kind] + 1
        self._nvme_failures_in_row[kind] = streak
        if streak >= MAX_NVME_FAILURES_IN_ROW:
            verb = "writes" if kind == Kind.DEMOTE else "reads"
            self.switch_off_nvme(f"{streak} NVMe {verb} in a row failed (see the I/O worker's warnings)")

    def switch_off_nvme(self, reason: str) -> None:
        """Switch the NVMe tier off (the only place that decides it); the first reason is kept.

        Its copies are forgotten at the end of the step (:meth:`_apply_nvme_switch`).
        """
        if self.nvme_off_reason is None:
            self.nvme_off_reason = reason

    def _apply_nvme_switch(self) -> None:
        """Once switched off: forget the NVMe copies and warn, once.

        Copies pinned by a transfer in flight at that moment are forgotten at a later step,
        once it has completed (a store that lands meanwhile is not attached, see :meth:`_apply`).
        """
        if self.nvme_off_reason is None:
            return
        if self.books.nvme_enabled:
            freed = self.placement.forget_nvme()
            logger.warning("hiradix: NVMe tier switched off: %s; %d pages forgotten, serving from HBM and DRAM",
                           self.nvme_off_reason, freed)
        elif self.tree.tier_tokens[Tier.NVME]:
            self.placement.forget_nvme()

    def summary(self) -> str:
        """One line of tier occupancy and counters, for logs."""
        b = self.books
        nvme = f"{b.nvme.num_used}/{b.nvme.capacity}" if b.nvme is not None else "off"
        inflight = {k.name: len(b.in_flight(k)) for k in Kind}
        return (
            f"tokens per tier HBM/DRAM/NVMe={self.tree.tier_tokens} DRAM pages={b.dram.num_used}/{b.dram.capacity} "
            f"NVMe slots={nvme} in-flight={inflight} dropped tokens={b.dropped_tokens} failed={self.stats.transfers_failed}"
        )

    def _apply_results_now(self, results: list) -> None:
        """Single rank only: apply I/O results now (no agreement needed)."""
        for result in results:
            self._results[result.job_id] = result
            self._apply(result.job_id, outcome_of(result))

    def _reap(self, op_ids: list[int]) -> None:
        """Apply in-process copies that every rank finished at the same point (a flush)."""
        mover_ops = {op.op_id for op in self.books.in_flight() if op.kind in (Kind.BACKUP, Kind.PROMOTE)}
        for op_id in sorted(set(op_ids) | {k for k in self._local_done if k in mover_ops}):
            self._apply(op_id, OK)

    def _submit_store(self, op: Transfer) -> None:
        self.client.submit_store(op.op_id, op.src_ids, op.dst_ids)

    def _store_last_copies(self) -> None:
        """Store every DRAM-only node to NVMe (placement order, bounded in flight).

        Eager write-back to NVMe keeps DRAM's copies redundant, so the room a backup or a
        prefetch needs can always be made without losing a last copy; whether the DRAM copy
        stays once the store landed is :meth:`Placement.after_demote`'s decision.
        """
        if not self.books.nvme_enabled:
            return
        in_flight = len(self.books.in_flight(Kind.DEMOTE))
        for node in self.placement.demotion_order():
            if in_flight >= MAX_DEMOTIONS_IN_FLIGHT:
                break
            op = self.placement.prepare(Kind.DEMOTE, [node])
            if op is None:
                break
            self._submit_store(op)
            in_flight += 1

    def _persist_prefixes(self) -> None:
        """Restart persistence: put the ancestors of what landed on NVMe there too.

        HBM eviction takes leaves first, so without this the first pages of a prefix (a
        system prompt, an early turn) would stay in HBM/DRAM and every persisted page below
        them would be unreachable after a restart (SGLang HiCache's "0 cached tokens after
        restart"). Ancestors in DRAM are stored (their DRAM copy stays unless DRAM is short);
        ancestors only in HBM (``write_back``) are backed up to DRAM first.
        """
        if self.journal is None:
            return
        if not self.books.nvme_enabled:
            self.journal.sync()
            return
        in_flight = len(self.books.in_flight(Kind.DEMOTE))
        waiting = []
        for node in dict.fromkeys(self.journal.landed):
            alive = node.alive and node.in_tier(Tier.NVME)
            missing = [a for a in self.tree.path(node)[:-1] if not a.in_tier(Tier.NVME)] if alive else []
            if missing:
                waiting.append(node)
            for ancestor in missing:
                if ancestor.ops or in_flight >= MAX_DEMOTIONS_IN_FLIGHT:
                    continue  # a transfer is using it (maybe this very copy): next step
                kind = Kind.DEMOTE if ancestor.in_tier(Tier.DRAM) else Kind.BACKUP
                op = self.placement.prepare(kind, [ancestor])
                if op is None:
                    continue
                if kind == Kind.DEMOTE:
                    self._submit_store(op)
                    in_flight += 1
                else:
                    self.mover.backup(op)
        self.journal.landed = waiting
        self.journal.sync()

    # ------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        """Forget every lower-tier copy (SGLang's ``flush_cache``)."""
        self._reap(self.mover.flush())
        self.mover.drop_pending()
        self.books.reset()
        self._prefetch_deadline_s.clear()
        self._expired.clear()
        if self.journal is not None:
            self.journal.landed.clear()  # nodes of the old tree (their paths end at the old root)

    def close(self) -> None:
        """Stop the I/O side and release the resources the assembly registered."""
        if self.client is not None:
            self.client.close()
        for release in self._on_close:
            release()
        self._on_close.clear()
