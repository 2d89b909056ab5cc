"""The NVMe tier's link: what is written down to it, and its on/off switch (pure decisions).

:class:`NvmeLink` is the part of the tier controller that concerns NVMe alone:

* demotions: every node whose last local copy is in DRAM is stored to NVMe (placement order,
  bounded in flight), so DRAM's copies stay redundant and the room a backup or a read needs can
  always be made without losing a last copy (:meth:`NvmeLink.store_last_copies`);
* restart persistence: the ancestors of what landed on NVMe go there too
  (:meth:`NvmeLink.persist_prefixes`), and the durable index is synced;
* the switch: the tier goes off, with one warning, after ``MAX_NVME_FAILURES_IN_ROW`` failed
  writes or reads in a row or once the I/O worker keeps dying (:meth:`NvmeLink.switch_off`);
  its copies are then forgotten (:meth:`NvmeLink.apply_switch`) and the cache goes on with HBM
  and DRAM. Under TP the outcomes counted are agreed ones, so every rank switches in one step.
"""

from __future__ import annotations

import logging
from typing import Optional

from hiradix.core.ledger import Kind, TierBooks, Transfer
from hiradix.core.node import Tier
from hiradix.core.placement import Placement
from hiradix.core.ports import HostMover, IOClient, NvmeJournal
from hiradix.core.tree import TieredRadixTree

logger = logging.getLogger(__name__)

MAX_DEMOTIONS_IN_FLIGHT = 64  # NVMe store jobs in flight, each one node
# I/O jobs of one direction (NVMe writes, or reads) that fail in a row before the NVMe tier is
# switched off: a healthy disk fails none, so this many in a row is a broken tier.
MAX_NVME_FAILURES_IN_ROW = 5


class NvmeLink:
    """Demotions to NVMe, restart persistence and the NVMe switch of one tree (one TP rank).

    Args:
        tree, books, placement: the tree, its ledger and its placement.
        client: the I/O client that runs NVMe jobs in the worker.
        mover: the in-process mover (backs up HBM-only ancestors before they are persisted).
        journal: the durable NVMe index, or None (nothing persisted).
    """

    def __init__(self, tree: TieredRadixTree, books: TierBooks, placement: Placement, client: IOClient,
                 mover: HostMover, journal: Optional[NvmeJournal]):
        self.tree, self.books, self.placement = tree, books, placement
        self.client, self.mover, self.journal = client, mover, journal
        self.failures_in_row = {Kind.DEMOTE: 0, Kind.PREFETCH: 0}
        self.off_reason: Optional[str] = None  # set once, by switch_off

    def submit_store(self, op: Transfer) -> None:
        self.client.submit_store(op.op_id, op.src_ids, op.dst_ids)

    def note_outcome(self, kind: Kind, ok: bool) -> None:
        """Count I/O jobs of one direction (DEMOTE = writes, PREFETCH = reads) that failed in a
        row: I/O errors, ENOSPC, short reads, checksum mismatches (aborted jobs, e.g. of a dead
        worker, are the I/O client's business)."""
        if kind not in self.failures_in_row:
            return
        streak = 0 if ok else self.failures_in_row[kind] + 1
        self.failures_in_row[kind] = streak
        if streak >= MAX_NVME_FAILURES_IN_ROW:
            verb = "writes" if kind == Kind.DEMOTE else "reads"
            self.switch_off(f"{streak} NVMe {verb} in a row failed (see the I/O worker's warnings)")

    def switch_off(self, reason: str) -> None:
        """Switch the NVMe tier off (the only place that decides it); the first reason is kept.
        Its copies are forgotten at the end of the step (:meth:`apply_switch`)."""
        if self.off_reason is None:
            self.off_reason = reason

    def apply_switch(self) -> None:
        """Once switched off: forget the NVMe copies and warn, once. Copies pinned by a transfer
        in flight then are forgotten at a later step, once it completed (a store that lands
        meanwhile is not attached: :meth:`TierController._apply`)."""
        if self.off_reason is None:
            return
        if self.books.nvme_enabled:
            freed = self.placement.forget_nvme()
            logger.warning("hiradix: NVMe tier switched off: %s; %d pages forgotten, serving from HBM and DRAM",
                           self.off_reason, freed)
        elif self.tree.tier_tokens[Tier.NVME]:
            self.placement.forget_nvme()

    def store_last_copies(self) -> None:
        """Store every node whose last local copy is in DRAM to NVMe (placement order, bounded in
        flight; the cluster store may hold it too). Whether the DRAM copy stays once the store
        landed is :meth:`Placement.after_demote`'s decision."""
        if not self.books.nvme_enabled:
            return
        in_flight = len(self.books.in_flight(Kind.DEMOTE))
        for node in self.placement.demotion_order(MAX_DEMOTIONS_IN_FLIGHT - in_flight):
            if in_flight >= MAX_DEMOTIONS_IN_FLIGHT:
                break
            op = self.placement.prepare(Kind.DEMOTE, [node])
            if op is None:
                break
            self.submit_store(op)
            in_flight += 1

    def persist_prefixes(self) -> None:
        """Restart persistence: put the ancestors of what landed on NVMe there too.

        HBM eviction takes leaves first, so without this the first pages of a prefix (a system
        prompt, an early turn) would stay in HBM/DRAM and every persisted page below them would
        be unreachable after a restart (SGLang HiCache's "0 cached tokens after restart").
        Ancestors in DRAM are stored (their DRAM copy stays unless DRAM is short); ancestors only
        in HBM (``write_back``) are backed up to DRAM first; one only the cluster store holds has
        no local copy to write down (its descendants wait).
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
                kind = Kind.DEMOTE if ancestor.in_tier(Tier.DRAM) else Kind.BACKUP if ancestor.in_tier(Tier.HBM) else None
                op = self.placement.prepare(kind, [ancestor]) if kind is not None else None
                if op is None:
                    continue
                if kind == Kind.DEMOTE:
                    self.submit_store(op)
                    in_flight += 1
                else:
                    self.mover.backup(op)
        self.journal.landed = waiting
        self.journal.sync()
