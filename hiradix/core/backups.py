"""Copies of HBM pages into DRAM: write-through, selective write-through and write-back (pure decisions).

CachedAttention §3.2 keeps a copy below HBM of what HBM holds, so an eviction drops a redundant
copy instead of losing KV. :class:`DramBackups` opens those copies (BACKUP transfers, carried out by
the in-process :class:`~hiradix.core.ports.HostMover`):

* write-through (:meth:`DramBackups.after_insert`): a node that just took HBM slots is copied to
  DRAM at once; when DRAM has no room (full of last copies on their way to NVMe) the backup is owed
  (:class:`~hiradix.core.deferred_backups.DeferredBackups`) and opened once room was made;
* selective write-through: only nodes used again (:data:`SELECTIVE_MIN_HITS`), at insert or on a hit;
* write-back (:meth:`DramBackups.backup_now`): at HBM eviction, a last HBM copy is copied to DRAM
  synchronously; DRAM may then drop its own last copies (eviction must make progress), after
  waiting at most ``DEMOTION_WAIT_S`` for stores to NVMe in flight to land (TP = 1 only).
"""

from __future__ import annotations

from typing import Callable, Optional

from hiradix.core.deferred_backups import DeferredBackups
from hiradix.core.ledger import Kind, TierBooks
from hiradix.core.node import Tier, TreeNode
from hiradix.core.placement import Placement
from hiradix.core.plan import TierPlan
from hiradix.core.ports import HostMover

# An HBM eviction that needs DRAM room waits at most this long for stores in flight.
DEMOTION_WAIT_S = 0.2
# Selective write-through backs up a node once used again: its insert counts 1 in hit_count.
SELECTIVE_MIN_HITS = 2


class DramBackups:
    """Opens the BACKUP transfers of one tree (one TP rank).

    Args:
        plan: the tiers' plan (write policy).
        books, placement, mover: the ledger, the placement (makes DRAM room), the copier.
        clock: monotonic seconds.
        wait_demotions: ``wait_demotions(timeout_s)`` applies the I/O results that arrive within
            ``timeout_s``; None under TP (waiting outside the per-step agreement would let ranks diverge).
        land_copies: lands every pending in-process copy now and applies the outcomes.
    """

    def __init__(self, plan: TierPlan, books: TierBooks, placement: Placement, mover: HostMover,
                 clock: Callable[[], float], wait_demotions: Optional[Callable[[float], None]],
                 land_copies: Callable[[], None]):
        self.plan, self.books, self.placement, self.mover, self.clock = plan, books, placement, mover, clock
        self.wait_demotions, self.land_copies = wait_demotions, land_copies
        self.deferred = DeferredBackups()  # write-through backups DRAM had no room for yet

    def after_insert(self, new_nodes: list[TreeNode]) -> None:
        """Write-through: start DRAM backups of nodes that just took HBM slots."""
        if not self.plan.write_through:
            return
        nodes = [n for n in new_nodes if n.alive and not n.in_tier(Tier.DRAM) and n.in_tier(Tier.HBM)]
        if self.plan.write_selective:
            nodes = [n for n in nodes if n.hit_count >= SELECTIVE_MIN_HITS]
        if nodes and not self.open(nodes):
            self.deferred.defer(nodes)  # DRAM full of copies on their way to NVMe: later

    def after_hit(self, nodes: list[TreeNode]) -> None:
        """Selective write-through only: back up the HBM-only nodes a request just hit again."""
        if self.plan.write_selective:
            self.after_insert(nodes)

    def open(self, nodes: list[TreeNode]) -> bool:
        """Open and start a write-through backup of ``nodes``; False if DRAM has no room now."""
        op = self.placement.prepare(Kind.BACKUP, nodes)
        if op is None:
            return False
        self.mover.backup(op)
        return True

    def retry_deferred(self) -> int:
        """Open the owed backups that fit now (the room landed demotions made); returns nodes opened."""
        return self.deferred.retry(self.open)

    def for_eviction(self) -> Callable[[TreeNode], bool]:
        """The write-back an HBM eviction calls for a last HBM copy (selective: only nodes used again)."""
        if self.plan.write_selective:
            return lambda n: n.hit_count >= SELECTIVE_MIN_HITS and self.backup_now(n)
        return self.backup_now

    def backup_now(self, node: TreeNode) -> bool:
        """Write-back: copy a last HBM copy to DRAM synchronously; False if DRAM has no room.

        Eviction must always make progress, so DRAM may drop its own last copies here
        (least valuable first by the policy) even while NVMe has room.
        """
        op = self.placement.prepare(Kind.BACKUP, [node])
        deadline_s = self.clock() + DEMOTION_WAIT_S
        while op is None and self.wait_demotions is not None and self.books.in_flight(Kind.DEMOTE) and self.clock() < deadline_s:
            # DRAM is full of last copies on their way to NVMe: let some land (bounded).
            self.wait_demotions(deadline_s - self.clock())
            op = self.placement.prepare(Kind.BACKUP, [node])
        op = op or self.placement.prepare(Kind.BACKUP, [node], allow_drop=True)
        if op is None:
            return False
        self.mover.backup(op)
        self.land_copies()
        return node.in_tier(Tier.DRAM)
