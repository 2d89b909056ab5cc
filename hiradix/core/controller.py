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
(:class:`~hiradix.core.ports.RankAgreement`), opens the write-through backups DRAM had no room
for at insert (:class:`~hiradix.core.deferred_backups.DeferredBackups`), stores nodes whose last
local copy is in DRAM to NVMe (also those the cluster store holds: a store copy is only a hint),
and persists the ancestors of what landed there. It owns the NVMe tier's on/off switch: the
tier goes off, with one warning, after repeated I/O-worker deaths or ``MAX_NVME_FAILURES_IN_ROW``
failed NVMe writes or reads in a row (:meth:`switch_off_nvme`); the cache then goes on with HBM
and DRAM. Under TP both happen in the same step on every rank: the failures counted are agreed
outcomes, and a rank's worker deaths are a vote (:class:`~hiradix.core.ports.StepVotes`) that
switches NVMe off on every rank once any rank's I/O client gave up.

Reads into DRAM come in three priorities (``hiradix.core.ports.READ_*``, the I/O worker's order):
for a request at admission, which waits for them up to its timeout (also when its read could
not start yet for want of DRAM room, :meth:`unread_pending`); for queued requests (the look-ahead
window); and for prefixes the policy predicts will return (:meth:`read_ahead`, background).

Where it waits: NVMe I/O never runs on the scheduler thread, but two things here can block it
briefly. A write-back eviction with DRAM full of pages on their way to NVMe waits for stores to
land, at most ``DEMOTION_WAIT_S`` (TP = 1 only). The durable NVMe index is appended to, and
fsynced about once a second, on this thread (:meth:`NvmeJournal.sync`). A stop
(:mod:`hiradix.core.graceful_stop`) is agreed in a step like a deadline; from then on nothing new
starts below DRAM, and :meth:`drain` blocks until the writes in flight landed, at most
``--hiradix-stop-timeout-s``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from hiradix.core.deferred_backups import DeferredBackups
from hiradix.core.graceful_stop import GracefulStop, StopReport
from hiradix.core.ledger import Kind, TierBooks, Transfer
from hiradix.core.node import Tier, TreeMatch, TreeNode
from hiradix.core.placement import DRAM_FREE_LOW, Placement
from hiradix.core import returns
from hiradix.core.ports import (ABORTED, FAILED, OK, READ_AT_ADMISSION, READ_BACKGROUND, READ_QUEUED, HostMover,
                                IOClient, NvmeJournal, RankAgreement, SingleRank, StepVotes)
from hiradix.core.stats import TierStats
from hiradix.core.store_reads import StoreReadChoice
from hiradix.core.store_tier import STORE_RETRY_S, StoreTier
from hiradix.core.tree import TieredRadixTree

logger = logging.getLogger(__name__)

MAX_DEMOTIONS_IN_FLIGHT = 64  # NVMe store jobs in flight, each one node
# An HBM eviction that needs DRAM room waits at most this long for stores in flight.
DEMOTION_WAIT_S = 0.2
# I/O jobs of one direction (NVMe writes, or reads) that fail in a row before the NVMe tier is
# switched off: a healthy disk fails none, so this many in a row is a broken tier.
MAX_NVME_FAILURES_IN_ROW = 5
SUMMARY_EVERY_S = 10.0  # one log line of occupancy this often
UNREAD_KEEP_STEPS = 64  # steps an expired wait for an unread prefix is remembered (not waited again)
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


LOOKUP_FAILED = 1  # a store lookup's agreement value when it failed as a whole (0 is NOT_DONE)


def found_of(result: Any, read_pages: Optional[Callable[[int], int]] = None) -> int:
    """A store lookup's result as an agreement value: 2 + the leading run of keys found (MIN
    over ranks is the run every rank holds); ``LOOKUP_FAILED`` when the job failed as a whole,
    so a failure on any rank is every rank's (the store's failure count, hence its switch-off,
    stays the same on all ranks: a TP rank that maps rank 0's MLA copy never sees an error).

    ``read_pages`` (found pages -> pages worth reading, this rank's load-or-recompute choice)
    shortens the run first: the MIN over ranks is then a read every rank agrees to, so ranks
    whose estimates differ never split their books."""
    if result.error:
        return LOOKUP_FAILED
    found = 0
    for ok in result.ok:
        if not ok:
            break
        found += 1
    return 2 + (read_pages(found) if read_pages is not None and found else found)


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
        store_key_prefix: the cluster store's key prefix (the KV fingerprint); None: no store.
        store_write_policy: see :mod:`hiradix.core.store_tier`.
        store_retry_s: first wait before a switched-off store is tried again.
        dram_staging: DRAM holds pages only in flight between HBM and NVMe (``--hiradix-dram-mode
            staging``): a DRAM copy goes as soon as its store to NVMe or its promotion to HBM lands.
        write_selective: SGLang HiCache's ``write_through_selective``, for measurements (the
            simulator): back up only nodes hit again (at insert or at the hit); a node never hit
            leaves HBM without a copy. Not a server flag: it loses the chat histories this
            cache exists for (bench/RESULTS.md, "Selective write-through").
        store_read: ``--hiradix-store-read`` (:mod:`hiradix.core.store_reads`): ``auto`` reads
            a store hit only while faster than recomputing it (measured here), ``always``, ``never``.
        stop_timeout_s: ``--hiradix-stop-timeout-s``: how long :meth:`drain` waits for writes in flight.
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
        store_key_prefix: Optional[str] = None,
        store_write_policy: str = "write_through",
        store_retry_s: float = STORE_RETRY_S,
        dram_staging: bool = False,
        write_selective: bool = False,
        store_read: str = "always",
        stop_timeout_s: float = 0.0,
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
        # Host bytes (DRAM, NVMe) this process reserves for its tiers; set by the assembly (0 on
        # a TP rank that uses another rank's copy, ``hiradix.runtime.shared_host_copy``).
        self.reserved_bytes: tuple[int, int] = (0, 0)
        self.stats = TierStats()
        self.deferred_backups = DeferredBackups()  # write-through backups DRAM had no room for yet
        self.reads_ahead = returns.ReadAhead(books.dram.capacity, self.stats.read_ahead_tokens)  # predicted returns
        self._prefetch_deadline_s: dict[int, Optional[float]] = {}  # PREFETCH op -> give-up time; None: not yet waited on
        self._expired: set[int] = set()  # PREFETCH op ids whose deadline passed (agreed)
        self._local_done: dict[int, int] = {}  # finished here, not yet agreed: op id -> outcome
        self._results: dict[int, Any] = {}  # I/O JobResult by op id, until applied
        self._nvme_failures_in_row = {Kind.DEMOTE: 0, Kind.PREFETCH: 0}
        # Admissions waiting for a read that could not start: stage's first node id -> op id
        # (a pseudo op: its deadline is agreed like a transfer's), and op id -> [node, step expired].
        self._unread_ops: dict[int, int] = {}
        self._unread: dict[int, list] = {}
        self._steps = 0  # calls of step(), equal on every rank
        self.nvme_off_reason: Optional[str] = None  # set once, by switch_off_nvme
        self._last_summary_s = 0.0
        self._on_close: list[Callable[[], None]] = []  # resources of the assembly, released by close()
        self.store: Optional[StoreTier] = None
        if store_key_prefix is not None:
            assert client is not None, "the store's jobs run in the I/O worker"
            reads = StoreReadChoice(store_read, page_bytes / tree.page_size, tree.page_size)
            self.store = StoreTier(tree, books, self.placement, client, store_key_prefix, store_write_policy, clock,
                                   retry_s=store_retry_s, reads=reads)
        self._lookup_found: dict[int, int] = {}  # lookup op id -> pages this rank found (before the choice)
        self.stop = GracefulStop(stop_timeout_s, clock)  # asked for by a signal handler, drained by drain()

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
        if nodes and not self._open_backup(nodes):
            self.deferred_backups.defer(nodes)  # DRAM full of copies on their way to NVMe: later

    def _open_backup(self, nodes: list[TreeNode]) -> bool:
        """Open and start a write-through backup of ``nodes``; False if DRAM has no room now."""
        op = self.placement.prepare(Kind.BACKUP, nodes)
        if op is None:
            return False
        self.mover.backup(op)
        return True

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
        left: list[TreeNode] = []
        backup = (lambda n: n.hit_count >= SELECTIVE_MIN_HITS and self._backup_now(n)) if self.write_selective else self._backup_now
        freed = self.placement.evict_hbm(num_tokens, backup=backup, left=left)
        self._store_last_copies()  # what just became DRAM-only starts down to NVMe now
        if self.store is not None:
            self.store.note_left_hbm(left)
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
        self.stats.prefetch_tokens["used"] += read_from[Tier.NVME]
        self.stats.store_tokens["used"] += read_from[Tier.STORE]
        self.stats.storage_hit_tokens["ahead"] += read_from[Tier.NVME] - waited_from[Tier.NVME]
        self.stats.storage_hit_tokens["at_admission"] += waited_from[Tier.NVME]
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

    # ------------------------------------------------------------ prefetch
    def prefetch(self, nodes: list[TreeNode], timeout_s: float, ahead: bool = False, src: Tier = Tier.NVME,
                 deadline_s: Optional[float] = None, background: bool = False) -> bool:
        """Start reads into DRAM of ``nodes`` (a matched path's tail held only on NVMe, or only in
        the cluster store with ``src=Tier.STORE``).

        Args:
            nodes: the tail of one request's matched path in ``src``.
            timeout_s: how long the request may wait for them at admission.
            ahead: started by the look-ahead window: the wait starts only at admission.
            src: NVME (PREFETCH jobs) or STORE (GET jobs).
            deadline_s: give-up time inherited from a store lookup (instead of now + timeout).
            background: a read for a predicted return (:meth:`read_ahead`): no request waits
                for it, it runs behind every other read, and it displaces only redundant copies.

        A read at admission that finds DRAM full of copies still on their way to NVMe drops the
        least valuable of those (in policy order) rather than leave the request to recompute.

        Returns:
            True if a read is in flight for these nodes (started now or earlier).
        """
        if self.client is None or not (self.books.nvme_enabled if src == Tier.NVME else self.store_enabled):
            return False
        todo = [n for n in nodes if n.alive and not n.in_tier(Tier.DRAM) and n.in_tier(src) and n.pinned[src] == 0]
        busy = any(n.pinned[src] > 0 for n in nodes)
        if not todo:
            return busy
        kind = Kind.PREFETCH if src == Tier.NVME else Kind.GET
        op = self.placement.prepare(kind, todo, ahead=ahead or background, allow_drop=False if background else None)
        if op is None and not (ahead or background):
            op = self.placement.prepare(kind, todo, allow_drop=True)
        if op is None:
            return busy
        if background:
            self.reads_ahead.started(op.op_id, len(op.src_ids))
            self.stats.read_ahead_tokens["started"] += len(op.src_ids) * self.tree.page_size
        if kind == Kind.PREFETCH:
            priority = READ_BACKGROUND if background else READ_QUEUED if ahead else READ_AT_ADMISSION
            self.client.submit_load(op.op_id, op.src_ids, op.dst_ids, priority=priority)
            self.stats.prefetch_tokens["started"] += len(op.src_ids) * self.tree.page_size
        else:
            self.client.submit_get(op.op_id, op.src_ids, op.dst_ids)
        # A look-ahead read may start deep in the queue: its request's wait (the timeout)
        # starts only when the request reaches admission (prefetch_pending).
        self._prefetch_deadline_s[op.op_id] = (deadline_s if deadline_s is not None or ahead or background
                                               else self.clock() + timeout_s)
        return True

    def read_ahead(self, key: Callable[[TreeNode, Tier], tuple], worth: Callable[[TreeNode], bool], timeout_s: float) -> int:
        """Read into DRAM the prefixes ``key`` (the policy's priority) ranks above DRAM's copies,
        among those ``worth`` accepts (:func:`hiradix.core.returns.plan`), from NVMe or the cluster
        store, in the background, within the budget :class:`~hiradix.core.returns.ReadAhead`
        gives. Returns reads started."""
        now = self.clock()
        urgent = any(op.op_id not in self.reads_ahead.in_flight for op in self.books.in_flight(Kind.PREFETCH))
        budget = self.reads_ahead.budget(now, urgent) if self.client is not None else 0
        if budget <= 0:
            return 0
        free = max(0, self.books.dram.num_free - self.placement.dram_free_low_pages)
        started = 0
        store_on = self.store_enabled and self.store.reads.reads_store
        for src, on in ((Tier.NVME, self.books.nvme_enabled), (Tier.STORE, store_on)):
            for tail in returns.plan(self.tree, key, free, budget, src, worth) if on and budget > 0 else ():
                pages = sum(n.num_tokens for n in tail) // self.tree.page_size
                if budget > 0 and self.prefetch(tail, timeout_s, src=src, background=True):
                    started, budget, free = started + 1, budget - pages, max(0, free - pages)
                    budget = 0 if self.reads_ahead.probing else budget  # a probe is one read
        self.reads_ahead.planned(now, started)
        return started

    @property
    def store_enabled(self) -> bool:
        return self.store is not None and self.store.enabled

    def lookup(self, m: TreeMatch, tokens: Any, namespace: Optional[tuple], timeout_s: float, ahead: bool = False) -> bool:
        """Ask the cluster store for the pages after a local match; True while that lookup runs.

        A lookup at admission (``ahead`` False) makes the request wait, up to ``timeout_s``
        (:meth:`lookup_pending`); what it finds is then read into DRAM within the same deadline.
        """
        if not self.store_enabled:
            return False
        lookup = self.store.lookup(m, tokens, namespace)
        if lookup is None:
            return False
        if lookup.op_id not in self._prefetch_deadline_s:
            self._prefetch_deadline_s[lookup.op_id] = None if ahead else self.clock() + timeout_s
        return True

    def _choose_read(self, op_id: int, found_pages: int) -> int:
        """This rank's load-or-recompute choice for a lookup that found ``found_pages`` (agreed
        by MIN over the ranks with the lookup's value, :func:`found_of`)."""
        self._lookup_found[op_id] = found_pages
        return self.store.reads.pages_to_read(found_pages)

    def store_read_worth(self, tokens: int) -> bool:
        """Whether a store-only run of ``tokens`` the tree already holds (a match's store part)
        is worth reading: ``never`` no; ``auto`` by this rank's estimates, with one rank only
        (the estimates differ between ranks, and this choice is not agreed: under TP it reads)."""
        if self.store is None:
            return True
        reads = self.store.reads
        if reads.mode == "auto" and self.sync.size > 1:
            return True
        return reads.worth_pages(tokens // self.tree.page_size) > 0

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """An extend batch prefilled ``tokens`` in ``seconds`` (the load-or-recompute estimate)."""
        if self.store is not None:
            self.store.reads.note_prefill(tokens, seconds)

    def lookup_pending(self, m: TreeMatch, tokens: Any, namespace: Optional[tuple], timeout_s: float) -> bool:
        """Whether a store lookup for the pages after ``m`` (a peek) is in flight and within its timeout."""
        if self.store is None:
            return False
        lookup = self.store.pending(self.store.tail_hash(m, tokens, namespace))
        return lookup is not None and self._waiting_on(lookup.op_id, timeout_s)

    def _waiting_on(self, op_id: int, timeout_s: float) -> bool:
        """An admission waits on ``op_id``: start its deadline if not yet started; False once expired."""
        if op_id not in self._prefetch_deadline_s or op_id in self._expired:
            return False
        if self._prefetch_deadline_s[op_id] is None:
            self._prefetch_deadline_s[op_id] = self.clock() + timeout_s
        return True

    def unread_pending(self, nodes: list[TreeNode], timeout_s: float) -> bool:
        """Whether an admission should wait for ``nodes`` (its match's NVMe or store part) that no
        read covers: the read could not start yet (no DRAM room; each admission attempt's match
        tries again). Bounded like a read: ``timeout_s`` from the first attempt, judged once per
        step and agreed by the TP ranks (through a pseudo op id)."""
        first = next((n for n in nodes if n.alive and not n.in_tier(Tier.DRAM) and not n.ops), None)
        if first is None:
            return False
        op_id = self._unread_ops.get(first.id)
        if op_id is None:
            op_id = self.books.new_op_id()
            self._unread_ops[first.id] = op_id
            self._unread[op_id] = [first, None]
            self._prefetch_deadline_s[op_id] = self.clock() + timeout_s
        return self._waiting_on(op_id, timeout_s)

    def _settle_unread(self) -> None:
        """Forget the pseudo ops of :meth:`unread_pending` once their node is read, being read or
        gone, or ``UNREAD_KEEP_STEPS`` steps after their deadline was agreed to have passed."""
        self._steps += 1
        for op_id, entry in list(self._unread.items()):
            node = entry[0]
            if entry[1] is None and op_id in self._expired:
                entry[1] = self._steps
            if (not node.alive or node.in_tier(Tier.DRAM) or node.ops
                    or (entry[1] is not None and self._steps - entry[1] >= UNREAD_KEEP_STEPS)):
                del self._unread[op_id]
                self._unread_ops.pop(node.id, None)
                self._prefetch_deadline_s.pop(op_id, None)
                self._expired.discard(op_id)

    def prefetch_pending(self, nodes: list[TreeNode], timeout_s: float) -> bool:
        """Whether a read for one of ``nodes`` is still in flight and within its timeout.

        Called when the request reaches admission; a look-ahead read's timeout starts here.
        Deadlines are judged once per step (:meth:`step`), agreed across TP ranks.
        """
        pending = False
        for node in nodes:
            for op_id in node.ops:
                pending |= self._waiting_on(op_id, timeout_s)
        return pending

    # ------------------------------------------------------------ per step
    def _record_results(self, results) -> None:
        """This rank's view of finished I/O jobs, kept until every rank agrees on them."""
        lookups = self.store.lookups if self.store is not None else {}
        for result in results:
            if result.job_id in lookups:
                self._local_done[result.job_id] = found_of(result, lambda n, i=result.job_id: self._choose_read(i, n))
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
        pending = sorted(self.books.pending_ids() + list(lookups) + list(self._unread))
        expired_here = {op for op, t in self._prefetch_deadline_s.items() if t is not None and t <= now}
        expired_here |= self.stop.expired_here(self.books)  # a stop asked for here: agreed by every rank
        known = set(pending)
        gave_up = self.client is not None and not alive and self.client.disabled
        votes = StepVotes(io_gave_up=gave_up, store_retry_due=self.store is not None and self.store.retry_due())
        finished, expired, votes = self.sync.agree(
            pending, {k: v for k, v in self._local_done.items() if k in known}, expired_here, votes)
        self._expired |= expired
        self.stop.note(expired, self.books)
        self._settle_unread()
        for op_id in sorted(finished):
            if op_id in lookups:
                self._apply_lookup(op_id, finished[op_id])
            else:
                self._apply(op_id, finished[op_id])
        self.deferred_backups.retry(self._open_backup)  # the room the landed demotions made
        if self.stop.agreed:
            return  # stopping: no new transfer below DRAM; the caller drains those in flight (drain)
        if self.client is not None:
            if votes.io_gave_up:  # on every rank in the same step, also where the worker lives
                reason = "the I/O worker keeps dying" if gave_up else "another TP rank's I/O worker keeps dying"
                self.switch_off_nvme(reason)
                if self.store is not None:
                    self.store.switch_off(reason)
            self._apply_nvme_switch()
            self._store_last_copies()
            self._persist_prefixes()
            if self.store is not None:
                self.store.step(retry=votes.store_retry_due)

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
        self.reads_ahead.landed(op_id, op.nodes)
        pages = len(op.src_ids)
        ok_pages = pages if flags is True else sum(bool(f) for f in flags) if flags else 0
        self.stats.bytes_moved[op.kind.name] += ok_pages * self.page_bytes
        if ok_pages < pages:
            self.stats.transfers_failed[op.kind.name] += 1
        if op.kind in self._nvme_failures_in_row and outcome != ABORTED:
            self._note_nvme_outcome(op.kind, ok_pages == pages)
        if op.kind == Kind.DEMOTE:  # a DRAM copy a PUT waits for stays (its source)
            self.placement.after_demote(op, keep=self.store.wants_put if self.store is not None else None)
        elif op.kind == Kind.PROMOTE and self.dram_staging:
            self.placement.after_promote(op)
        elif op.kind == Kind.PREFETCH:
            self.stats.prefetch_tokens["completed"] += ok_pages * self.tree.page_size
            self.stats.prefetch_tokens["failed"] += (pages - ok_pages) * self.tree.page_size
        if self.store is not None:
            if op.kind == Kind.GET and ok_pages and result is not None:
                self.store.reads.note_get(ok_pages * self.page_bytes, getattr(result, "duration_s", 0.0))
            if op.kind == Kind.PUT:  # before note_job: a switch-off there drops what this queues
                self.store.note_put_done(op.nodes, aborted=outcome == ABORTED)
            if op.kind in (Kind.PUT, Kind.GET):
                missed = [k for k, f in zip(op.src_ids, flags if isinstance(flags, list) else [flags] * pages)
                          if not f] if op.kind == Kind.GET and outcome != ABORTED else []
                self.store.note_job(op.kind, pages, ok_pages, outcome == ABORTED, missed_keys=missed)
            if op.kind in (Kind.BACKUP, Kind.PREFETCH) and ok_pages:
                self.store.note_in_dram(op.nodes)

    def _apply_lookup(self, op_id: int, value: int) -> None:
        """Apply an agreed store lookup (``value``: :func:`found_of`, the MIN over ranks): attach
        what was found and read it into DRAM within the lookup's deadline (if it has not expired)."""
        self._local_done.pop(op_id, None)
        self._results.pop(op_id, None)
        deadline_s = self._prefetch_deadline_s.pop(op_id, None)
        expired = op_id in self._expired
        self._expired.discard(op_id)
        self.store.note_job(None, 0, 0, aborted=value == LOOKUP_FAILED)
        read = max(0, value - 2)
        node = self.store.finish_lookup(op_id, max(read, self._lookup_found.pop(op_id, 0)), read_pages=read)
        if node is not None:
            ahead = deadline_s is None or expired
            self.prefetch([node], 0.0, ahead=ahead, src=Tier.STORE, deadline_s=None if ahead else deadline_s)
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
        store = "off" if self.store is None else ("on" if self.store.enabled else f"off ({self.store.off_reason})")
        return (
            f"tokens per tier HBM/DRAM/NVMe={self.tree.tier_tokens[:3]} DRAM pages={b.dram.num_used}/{b.dram.capacity} "
            f"NVMe slots={nvme} store={store} store tokens={self.tree.tier_tokens[Tier.STORE]} in-flight={inflight} "
            f"dropped tokens={b.dropped_tokens[:3]} failed={self.stats.transfers_failed} "
            f"deferred backups={self.deferred_backups.deferred_nodes} (opened later {self.deferred_backups.opened_nodes})"
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
        """Store every node whose last local copy is in DRAM to NVMe (placement order, bounded in
        flight; the cluster store may hold it too).

        Eager write-back to NVMe keeps DRAM's copies redundant, so the room a backup or a
        prefetch needs can always be made without losing a last copy; whether the DRAM copy
        stays once the store landed is :meth:`Placement.after_demote`'s decision.
        """
        if not self.books.nvme_enabled:
            return
        in_flight = len(self.books.in_flight(Kind.DEMOTE))
        for node in self.placement.demotion_order(MAX_DEMOTIONS_IN_FLIGHT - in_flight):
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
                if ancestor.in_tier(Tier.DRAM):
                    kind = Kind.DEMOTE
                elif ancestor.in_tier(Tier.HBM):
                    kind = Kind.BACKUP
                else:
                    continue  # only the cluster store holds it: no local copy to write down
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
        """Forget every lower-tier copy (SGLang's ``flush_cache``); the cluster store keeps its objects."""
        self._reap(self.mover.flush())
        self.mover.drop_pending()
        self.books.reset()
        if self.store is not None:
            self.store.reset()
        self._prefetch_deadline_s.clear()
        self._expired.clear()
        self.reads_ahead.reset()
        self._unread_ops.clear()
        self._unread.clear()
        self.deferred_backups.clear()
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
