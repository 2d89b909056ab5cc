"""Glue between the bookkeeping (tree + books) and the data movers (host mover, I/O worker).

:class:`TierController` lives in the scheduler process, next to :class:`hiradix.cache.HiRadixCache`.
It decides *when* to back up, demote, prefetch and promote (CachedAttention §3.2-3.3), asks
:class:`hiradix.transfers.TierBooks` to prepare each transfer, hands the prepared transfer to
the mover that carries it out, and completes it by id when the mover reports. It never blocks
on disk: NVMe I/O happens in the I/O worker process.

Per scheduler step (:meth:`step`, from SGLang's per-step cache-event hook) it reaps finished
copies and worker acks, checks the worker's liveness (a dead worker's jobs become misses; it is
respawned), switches the NVMe tier off with one warning after repeated worker deaths or
``MAX_NVME_FAILURES_IN_ROW`` failed NVMe writes or reads in a row (the cache then goes on with
HBM and DRAM), and demotes DRAM-only nodes to NVMe while DRAM is short of free pages.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from typing import Any, Callable, Optional

from hiradix.io.client import IOWorkerClient
from hiradix.io.protocol import LoadPages, StorePages, WorkerSpec
from hiradix.layerwise import LayerwiseLoader
from hiradix.layout import KVLayout
from hiradix.fingerprint import kv_fingerprint
from hiradix.movers import HostMover
from hiradix.persistence import IndexJournal, restore
from hiradix.rank_sync import ABORTED, FAILED, OK, RankSync
from hiradix.tiers.dram import DramPool, default_shm_dir, ensure_private_dir, num_pages_for_bytes
from hiradix.tiers.nvme import NVME_FILE_NAME, NvmeStore, slot_bytes_for
from hiradix.tiers.nvme_index import INDEX_FILE_NAME, NvmeIndex
from hiradix.transfers import Kind, TierBooks
from hiradix.tree import TieredRadixTree, Tier, TreeNode

logger = logging.getLogger(__name__)

# A demoted page also leaves DRAM when free DRAM pages are below this fraction.
DRAM_FREE_LOW = 0.25
MAX_DEMOTIONS_IN_FLIGHT = 64  # worker jobs, each one node
# An HBM eviction that needs DRAM room waits at most this long for demotions in flight.
DEMOTION_WAIT_S = 0.2
# Worker jobs of one direction (NVMe writes, or reads) that fail in a row before the NVMe tier
# is switched off: a healthy disk fails none, so this many in a row is a broken tier.
MAX_NVME_FAILURES_IN_ROW = 5


@dataclass
class TierStats:
    """Counters since start; units in names. Exported by :mod:`hiradix.metrics`."""

    bytes_moved: dict[str, int] = field(default_factory=lambda: {k.name: 0 for k in Kind})
    transfers_failed: dict[str, int] = field(default_factory=lambda: {k.name: 0 for k in Kind})
    # NVMe -> DRAM prefetch, in tokens: started, completed (landed in DRAM), failed,
    # used (promoted to HBM for a request), wasted (dropped from DRAM before any use).
    prefetch_tokens: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("started", "completed", "failed", "used", "wasted"), 0)
    )
    admission_skips: int = 0  # times admission skipped a request waiting for its prefetch
    restored_pages: int = 0  # NVMe pages re-indexed from the durable index at start


def _outcome(done: Any) -> int:
    """A worker ``JobDone`` as a :mod:`hiradix.rank_sync` state.

    A job-level error (worker died, disabled, shut down, job rejected) moved nothing: ABORTED,
    the source copy stays. Otherwise a page that did not verify makes it FAILED.
    """
    if all(done.ok):
        return OK
    return ABORTED if done.error else FAILED


def _remove_stale_dirs(own_dir: Path) -> None:
    """Remove socket directories left by killed scheduler processes of this user.

    ``default_shm_dir()`` names them ``hiradix-<uid>-<pid>[-rank<r>]``; a SIGKILLed or
    SIGTERMed scheduler cannot clean up (the DRAM pool itself is anonymous memory and never
    leaks), so each new one removes those whose pid is gone.
    """
    prefix = own_dir.name.split("-")[:2]  # ["hiradix", "<uid>"]
    for path in own_dir.parent.glob("-".join(prefix) + "-*"):
        parts = path.name.split("-")
        if len(parts) < 3 or not parts[2].isdigit() or path.is_symlink() or not path.is_dir():
            continue
        try:
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            continue


def _lock_nvme_dir(nvme_dir: Path) -> int:
    """Hold an exclusive lock on this rank's NVMe directory for the process lifetime.

    Two servers given the same ``--hiradix-nvme-path`` would otherwise truncate each other's
    slot file. The lock goes with the process (also when it is killed).

    Raises:
        RuntimeError: another live process holds the directory.
    """
    import fcntl

    ensure_private_dir(nvme_dir)
    fd = os.open(nvme_dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(
            f"hiradix: {nvme_dir} is in use by another server; give each server its own --hiradix-nvme-path"
        ) from None
    return fd


def _start_worker(dram: DramPool, nvme_dir: Path, nvme_slots: int, shm_dir: Path, io_backend: str,
                  keep: bool = False) -> IOWorkerClient:
    """Create (``keep``: reuse) the NVMe slot file and spawn this rank's I/O worker over it."""
    store = NvmeStore.create(nvme_dir, dram.layout.page_bytes, nvme_slots, backend=io_backend, keep=keep)
    backend = store.backend
    store.close()  # the worker owns NVMe I/O; this process only created the file
    spec = WorkerSpec(
        dram_path=str(dram.path),
        layout=dram.layout.to_json(),
        num_dram_pages=dram.num_pages,
        nvme_dir=str(nvme_dir),
        num_nvme_slots=nvme_slots,
        page_bytes=dram.layout.page_bytes,
        io_backend=backend,
        socket_dir=str(shm_dir / "sock"),
        parent_pid=os.getpid(),
    )
    client = IOWorkerClient(spec)
    client.start()
    return client


class TierController:
    """Runs the DRAM and NVMe tiers of one tree (one TP rank).

    Build the real one with :meth:`for_device_pool`; the data-less simulator passes stand-in
    movers with the same methods (``hiradix.simulated``), so the decisions are the same code.

    Args:
        tree: the tree whose nodes move.
        books: its DRAM/NVMe books.
        mover: carries out BACKUP/PROMOTE (``backup``, ``promote``, ``finished``, ``flush``,
            ``drop_pending``, ``start_loading``).
        client: carries out DEMOTE/PREFETCH (``submit``, ``poll``, ``wait``, ``check_alive``,
            ``disabled``, ``close``); None without an NVMe tier.
        page_bytes: bytes per page (all layers), for the counters.
        write_through: back up to DRAM at insert (else at HBM eviction).
        clock: monotonic seconds (injectable for the simulator).
        sync: TP agreement on completions (default: a single rank).
    """

    def __init__(
        self,
        tree: TieredRadixTree,
        books: TierBooks,
        mover: Any,
        client: Optional[Any],
        page_bytes: int,
        write_through: bool,
        clock: Callable[[], float] = time.monotonic,
        sync: Optional[RankSync] = None,
    ):
        self.tree = tree
        self.books = books
        self.mover = mover  # HostMover (or a data-less stand-in): backup/promote/finished/flush
        self.client = client  # IOWorkerClient (or a data-less stand-in), None without NVMe
        self.page_bytes = page_bytes
        self.write_through = write_through
        self.clock = clock
        self.stats = TierStats()
        self.loader: Optional[LayerwiseLoader] = getattr(mover, "loader", None)
        self._prefetch_deadline_s: dict[int, Optional[float]] = {}  # PREFETCH op -> give-up time; None: not yet waited on
        self._expired: set[int] = set()  # PREFETCH op ids whose deadline passed (agreed)
        self._local_done: dict[int, int] = {}  # finished here, not yet agreed: op id -> rank_sync state
        self._acks: dict[int, Any] = {}  # worker JobDone by op id, until applied
        self._nvme_failures_in_row = {Kind.DEMOTE: 0, Kind.PREFETCH: 0}  # failed worker jobs in a row
        self.nvme_off_reason: Optional[str] = None  # set once: why the NVMe tier is switched off
        self.journal: Optional[IndexJournal] = None  # durable NVMe index (restart persistence)
        self.sync = sync or RankSync(None)
        self._last_summary_s = 0.0
        self._resources: list[Callable[[], None]] = []  # called by close()

    @classmethod
    def for_device_pool(
        cls,
        tree: TieredRadixTree,
        config: Any,
        kv_pool: Any,
        page_size: int,
        tp_rank: int = 0,
        io_backend: str = "auto",
        tp_group: Optional[Any] = None,
        identity: Optional[dict] = None,
    ) -> TierController:
        """The real tiers of one scheduler process: a shared-memory DRAM pool, an NVMe store
        served by a spawned I/O worker, and the in-process host mover.

        Args:
            tree: the tree whose nodes move.
            config: hiradix settings (``dram_bytes``, ``nvme_path``, ``nvme_bytes``, ``write_policy``).
            kv_pool: SGLang's device ``MHATokenToKVPool`` of this rank.
            page_size: tokens per page.
            tp_rank: this rank (names the private directories).
            io_backend: NVMe backend for the worker ("auto", "posix", "kvikio").
            tp_group: TP CPU process group (None for one rank); completions are agreed over it.
            identity: ``model_id``, ``model_dtype`` and ``tp_size`` for the NVMe index's
                fingerprint (:mod:`hiradix.fingerprint`); None: the NVMe tier starts empty
                and is not persisted.

        Raises:
            OSError, PermissionError: a tier's files cannot be created.
            hiradix.io.client.WorkerStartError: the I/O worker did not start.
        """
        layout = KVLayout.from_device_pool(kv_pool, page_size)
        shm_dir = Path(f"{default_shm_dir()}-rank{tp_rank}")
        _remove_stale_dirs(shm_dir)
        ensure_private_dir(shm_dir)  # 0700: it holds the worker's socket directory
        dram_pages = num_pages_for_bytes(config.dram_bytes, layout)
        dram = DramPool.create_anonymous(layout, dram_pages)
        client, nvme_slots, lock_fd, index, pages = None, 0, -1, None, []
        if config.nvme_bytes > 0:
            nvme_slots = config.nvme_bytes // slot_bytes_for(layout.page_bytes)
            nvme_dir = Path(config.nvme_path) / f"hiradix-rank{tp_rank}"
            lock_fd = _lock_nvme_dir(nvme_dir)
            if identity is not None:
                fingerprint = kv_fingerprint(identity["model_id"], identity["model_dtype"], layout, tp_rank,
                                             identity["tp_size"], slot_bytes_for(layout.page_bytes))
                if not (nvme_dir / NVME_FILE_NAME).exists() and (nvme_dir / INDEX_FILE_NAME).exists():
                    logger.warning("hiradix: %s has an NVMe index but no slot file; starting empty", nvme_dir)
                    (nvme_dir / INDEX_FILE_NAME).unlink()
                index, pages = NvmeIndex.open(nvme_dir, fingerprint, nvme_slots, page_size)
            client = _start_worker(dram, nvme_dir, nvme_slots, shm_dir, io_backend, keep=index is not None and index.reused)
        books = TierBooks(tree, dram_pages, nvme_slots, dram_free_low_pages=int(DRAM_FREE_LOW * dram_pages))
        loader = LayerwiseLoader(layout.num_layers, kv_pool.k_buffer[0].device)
        mover = HostMover(kv_pool, dram, loader)
        sync = RankSync(tp_group if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1 else None)
        tiers = cls(tree, books, mover, client, layout.page_bytes, config.write_policy == "write_through", sync=sync)
        tiers._resources += [dram.close, lambda: shutil.rmtree(shm_dir, ignore_errors=True)]
        if index is not None:
            tiers.stats.restored_pages = restore(tree, books, pages)
            tiers.journal = IndexJournal(index, tree)
            books.nvme_journal = tiers.journal
            tiers._resources.append(index.close)
        if lock_fd >= 0:
            tiers._resources.append(lambda: os.close(lock_fd))
        logger.info("hiradix tiers: DRAM %d pages (%d B each) at %s; NVMe %d slots", dram_pages, layout.page_bytes, dram.path, nvme_slots)
        return tiers

    # ------------------------------------------------------------ backups
    def after_insert(self, new_nodes: list[TreeNode]) -> None:
        """Write-through: start DRAM backups of nodes that just took HBM slots."""
        if not self.write_through:
            return
        nodes = [n for n in new_nodes if n.alive and not n.in_tier(Tier.DRAM) and n.in_tier(Tier.HBM)]
        if nodes:
            op = self.books.prepare(Kind.BACKUP, nodes, )
            if op is not None:
                self.mover.backup(op)

    # ------------------------------------------------------------ HBM eviction
    def evict_hbm(self, num_tokens: int) -> list[Any]:
        """Free at least ``num_tokens`` HBM tokens, demoting last copies to DRAM first.

        Returns:
            Freed device slot arrays for SGLang's allocator.
        """
        self._reap(self.mover.flush())  # pending copies pin HBM slots; land them first
        freed, evicted, stuck = [], 0, []
        for node in self.tree.victims(Tier.HBM):
            if evicted >= num_tokens:
                break
            if node.num_tiers == 1 and not self._backup_now(node):
                # No DRAM room even after dropping DRAM's own last copies: the node's KV is
                # lost, and so is what hangs below it (unreachable without this prefix).
                for child in list(node.children.values()):
                    self.books.drop_subtree(child)
                if node.children:
                    stuck.append(node)  # a child's copy is pinned by a transfer in flight
                    continue
                self.books.dropped_tokens[Tier.HBM] += node.num_tokens
            evicted += node.num_tokens
            freed.append(self.tree.detach(node, Tier.HBM))
        for node in stuck:
            if evicted >= num_tokens or not node.alive or node.lock_ref or node.tiers() != [Tier.HBM]:
                continue
            # Still short: abandon the transfers pinning its children (a slow disk). SGLang
            # counted this node as evictable and must get its slots (else "Prefill out of memory").
            if all(self.books.abandon_subtree(child) for child in list(node.children.values())) and not node.children:
                self.books.dropped_tokens[Tier.HBM] += node.num_tokens
                evicted += node.num_tokens
                freed.append(self.tree.detach(node, Tier.HBM))
        self._demote_last_copies()  # what just became DRAM-only starts down to NVMe now
        return freed

    def _backup_now(self, node: TreeNode) -> bool:
        """Write-back: copy a last HBM copy to DRAM synchronously; False if DRAM has no room.

        Eviction must always make progress, so DRAM may drop its own last copies here
        (least valuable first by the policy) even while NVMe has room.
        """
        op = self.books.prepare(Kind.BACKUP, [node])
        deadline_s = self.clock() + DEMOTION_WAIT_S
        # Waiting on worker acks outside the per-step agreement would let TP ranks diverge.
        while op is None and self.sync.size == 1 and self.books.in_flight(Kind.DEMOTE) and self.clock() < deadline_s:
            # DRAM is full of last copies on their way to NVMe: let some land (bounded).
            self._apply_worker_acks(self.client.wait(deadline_s - self.clock()))
            op = self.books.prepare(Kind.BACKUP, [node])
        op = op or self.books.prepare(Kind.BACKUP, [node], allow_drop=True)
        if op is None:
            return False
        self.mover.backup(op)
        self._reap(self.mover.flush())
        return node.in_tier(Tier.DRAM)

    # ------------------------------------------------------------ load back
    def load_back(self, nodes: list[TreeNode], hbm_slots: Any) -> int:
        """Promote DRAM nodes into the given new HBM slots, layer by layer.

        Returns:
            Tokens whose DRAM copy had been read from NVMe (for the per-tier hit details).
        """
        from_nvme = sum(n.num_tokens for n in nodes if n.nvme_loaded)
        self.stats.prefetch_tokens["used"] += from_nvme
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
        op = self.books.prepare(Kind.PREFETCH, todo, ahead=ahead)
        if op is None:
            return busy
        self.client.submit(LoadPages(op.op_id, op.src_ids, op.dst_ids))
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
        """Apply the completions every TP rank agrees on; keep DRAM headroom by demoting."""
        now = self.clock()
        if now - self._last_summary_s > 10.0:
            self._last_summary_s = now
            logger.info("hiradix: %s", self.summary())
        self._local_done.update(dict.fromkeys(self.mover.finished(), OK))
        alive = True
        if self.client is not None:
            alive = self.client.check_alive()
            for done in self.client.poll():
                self._local_done[done.job_id] = _outcome(done)
                self._acks[done.job_id] = done
        pending = self.books.pending_ids()
        expired_here = {op for op, t in self._prefetch_deadline_s.items() if t is not None and t <= now}
        finished, expired = self.sync.agree(pending, {k: v for k, v in self._local_done.items() if k in set(pending)}, expired_here)
        self._expired |= expired
        for op_id in sorted(finished):
            self._apply(op_id, finished[op_id])
        if self.client is not None:
            if not alive and self.client.disabled and self.nvme_off_reason is None:
                self.nvme_off_reason = "the I/O worker keeps dying"
            self._switch_off_nvme()
            self._demote_last_copies()
            self._persist_prefixes()

    def _apply(self, op_id: int, outcome: int) -> None:
        """Complete one agreed transfer (``outcome``: OK, ABORTED or FAILED on every rank)."""
        self._local_done.pop(op_id, None)
        self._prefetch_deadline_s.pop(op_id, None)
        self._expired.discard(op_id)
        done = self._acks.pop(op_id, None)
        ok = outcome == OK
        flags = (list(done.ok) if done is not None else True) if ok else False
        # A store that lands after the NVMe tier was switched off is not used (nothing attached).
        late_store = not self.books.nvme_enabled and op_id in self.books.ops and self.books.ops[op_id].kind == Kind.DEMOTE
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
        if op.kind == Kind.PREFETCH:
            self.stats.prefetch_tokens["completed"] += ok_pages * self.tree.page_size
            self.stats.prefetch_tokens["failed"] += (pages - ok_pages) * self.tree.page_size

    def _note_nvme_outcome(self, kind: Kind, ok: bool) -> None:
        """Count worker jobs of one direction (DEMOTE = writes, PREFETCH = reads) that failed
        in a row: I/O errors, ENOSPC, short reads, checksum mismatches (aborted jobs, e.g. of
        a dead worker, are the client's business). At ``MAX_NVME_FAILURES_IN_ROW`` the NVMe
        tier is switched off at the end of the step (:meth:`_switch_off_nvme`)."""
        streak = 0 if ok else self._nvme_failures_in_row[kind] + 1
        self._nvme_failures_in_row[kind] = streak
        if streak >= MAX_NVME_FAILURES_IN_ROW and self.nvme_off_reason is None:
            verb = "writes" if kind == Kind.DEMOTE else "reads"
            self.nvme_off_reason = f"{streak} NVMe {verb} in a row failed (see the I/O worker's warnings)"

    def _switch_off_nvme(self) -> None:
        """Once ``nvme_off_reason`` is set: forget the NVMe copies and warn, once.

        Copies pinned by a transfer in flight at that moment are forgotten at a later step,
        once it has completed (a store that lands meanwhile is not attached, see :meth:`_apply`).
        """
        if self.nvme_off_reason is None:
            return
        if self.books.nvme_enabled:
            freed = self.books.forget_nvme()
            logger.warning("hiradix: NVMe tier switched off: %s; %d pages forgotten, serving from HBM and DRAM",
                           self.nvme_off_reason, freed)
        elif self.tree.tier_tokens[Tier.NVME]:
            self.books.forget_nvme()

    def summary(self) -> str:
        """One line of tier occupancy and counters, for logs."""
        b = self.books
        nvme = f"{b.nvme.num_used}/{b.nvme.capacity}" if b.nvme is not None else "off"
        inflight = {k.name: len(b.in_flight(k)) for k in Kind}
        return (
            f"tokens per tier HBM/DRAM/NVMe={self.tree.tier_tokens} DRAM pages={b.dram.num_used}/{b.dram.capacity} "
            f"NVMe slots={nvme} in-flight={inflight} dropped tokens={b.dropped_tokens} failed={self.stats.transfers_failed}"
        )

    def _apply_worker_acks(self, acks: list) -> None:
        """Single rank only: apply worker acks now (no agreement needed)."""
        for done in acks:
            self._acks[done.job_id] = done
            self._apply(done.job_id, _outcome(done))

    def _reap(self, op_ids: list[int]) -> None:
        """Apply in-process copies that every rank finished at the same point (a flush)."""
        for op_id in sorted(set(op_ids) | {k for k, v in self._local_done.items() if k in self.mover_ops()}):
            self._apply(op_id, OK)

    def mover_ops(self) -> set[int]:
        """Ids of in-flight BACKUP/PROMOTE transfers (carried out in this process)."""
        return {op.op_id for op in self.books.in_flight() if op.kind in (Kind.BACKUP, Kind.PROMOTE)}

    def _demote_last_copies(self) -> None:
        """Copy every DRAM-only node down to NVMe (policy order, bounded in flight).

        Eager write-back to NVMe keeps DRAM's copies redundant, so the room a backup or a
        prefetch needs can always be made without losing a last copy. The DRAM copy is
        freed when the copy lands only if DRAM is short of free pages (below
        ``DRAM_FREE_LOW``); otherwise it stays, as a DRAM hit for the next turn.
        """
        if not self.books.nvme_enabled:
            return
        in_flight = len(self.books.in_flight(Kind.DEMOTE))
        todo = [n for n in self.tree.sole_copies(Tier.DRAM) if n.pinned[Tier.DRAM] == 0]
        todo.sort(key=lambda n: self.tree.policy.priority(n, Tier.DRAM))
        for node in todo:
            if in_flight >= MAX_DEMOTIONS_IN_FLIGHT:
                break
            op = self.books.prepare(Kind.DEMOTE, [node])
            if op is None:
                break
            self.client.submit(StorePages(op.op_id, op.src_ids, op.dst_ids))
            in_flight += 1

    def _persist_prefixes(self) -> None:
        """Restart persistence: put the ancestors of what landed on NVMe there too.

        HBM eviction takes leaves first, so without this the first pages of a prefix (a
        system prompt, an early turn) would stay in HBM/DRAM and every persisted page below
        them would be unreachable after a restart (SGLang HiCache's "0 cached tokens after
        restart"). Ancestors in DRAM are copied down (their DRAM copy stays unless DRAM is
        short); ancestors only in HBM (``write_back``) are backed up to DRAM first.
        """
        if self.journal is None:
            return
        if not self.books.nvme_enabled:
            self.journal.index.sync()
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
                op = self.books.prepare(kind, [ancestor])
                if op is None:
                    continue
                if kind == Kind.DEMOTE:
                    self.client.submit(StorePages(op.op_id, op.src_ids, op.dst_ids))
                    in_flight += 1
                else:
                    self.mover.backup(op)
        self.journal.landed = waiting
        self.journal.index.sync()

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
        """Stop the worker and release this rank's shared-memory files."""
        if self.client is not None:
            self.client.close()
        for release in self._resources:
            release()
        self._resources.clear()
