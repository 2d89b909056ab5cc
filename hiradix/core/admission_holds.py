"""Whether admission holds a request for its reads, and for how long by cause (pure decisions).

A request whose prefix continues on NVMe or in the cluster store is skipped at admission until
that part is in DRAM: its read is in flight, or could not start yet (no DRAM room; the next
attempt's match tries again), or a store lookup of what follows it is in flight. Within the load
timeout only; afterwards it runs with what is ready and recomputes the rest. With the request's own
:class:`~hiradix.core.lookahead.QueuedKey` its last peek is reused (O(path nodes) per attempt), its
whole wait is bounded however often its reads restart (``ReadWaits.request_pending``), and its
holds are timed by cause (:mod:`hiradix.core.hold_times`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from hiradix.core.hold_times import HoldTimes
from hiradix.core.lookahead import QueuedKey, peek
from hiradix.core.node import Tier
from hiradix.core.tree import TieredRadixTree

if TYPE_CHECKING:
    from hiradix.core.controller import TierController


class AdmissionHolds:
    """Admission's holds for one tree (one TP rank).

    Args:
        tree: the tree.
        tiers: its lower tiers (reads, their deadlines, the store's lookups, the counters).
        load_timeout_s: how long a request may be held.
    """

    def __init__(self, tree: TieredRadixTree, tiers: TierController, load_timeout_s: float):
        self.tree, self.tiers, self.load_timeout_s = tree, tiers, load_timeout_s

    def hold(self, key: QueuedKey, per_request: bool) -> bool:
        """Whether admission should skip the request of ``key`` now (``per_request``: ``key`` is the
        request's own, kept between attempts)."""
        tiers = self.tiers
        lower = self.tree.tier_tokens[Tier.NVME] or self.tree.tier_tokens[Tier.STORE]
        if not (lower or tiers.books.in_flight() or (tiers.store is not None and tiers.store.lookups)):
            cause = None
        else:
            cause = self.cause(key)
            if cause is not None and per_request and not tiers.waits.request_pending(key, self.load_timeout_s):
                cause = None  # its whole wait is over, however often its reads restarted
        if per_request and (cause is not None or key.holds is not None):
            self._time(key, cause)
        tiers.stats.admission_skips += cause is not None
        return cause is not None

    def cause(self, key: QueuedKey) -> Optional[str]:
        """Why admission should hold this request now (a cause of :mod:`hiradix.core.hold_times`), or None."""
        tiers, m = self.tiers, peek(self.tree, key)
        causes = []  # every wait is asked (each starts its deadline at the first attempt); the first names the hold
        for tier, read in ((Tier.NVME, "nvme_read"), (Tier.STORE, "store_read")):
            if m.length(tier) and (tier == Tier.NVME or tiers.store_read_worth(m.length(tier))):
                stage = m.stage(tier)
                if tiers.waits.any_pending(stage, self.load_timeout_s):
                    causes.append(read)
                elif tiers.waits.unread_pending(stage, self.load_timeout_s):
                    causes.append("dram_room")
        if tiers.lookup_pending(m, key.tokens, key.namespace, self.load_timeout_s):
            causes.append("store_lookup")
        return causes[0] if causes else None

    def _time(self, key: QueuedKey, cause: Optional[str]) -> None:
        """Charge the time since the request's last hold to that hold's cause (TierStats)."""
        if key.holds is None:
            key.holds = HoldTimes()
        charged, seconds, first = key.holds.attempt(self.tiers.clock(), cause)
        stats = self.tiers.stats
        if charged is not None:
            stats.admission_wait_s[charged] += seconds
        stats.held_requests += first
