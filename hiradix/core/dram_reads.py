"""Reads into DRAM: from NVMe (PREFETCH) or from the cluster store (GET), at three priorities (pure).

A request whose match continues below DRAM has that part read into DRAM before it is promoted to
HBM. :class:`DramReads` opens those transfers and hands them to the I/O port, in the I/O worker's
order (``hiradix.core.ports.READ_*``):

* at admission (``READ_AT_ADMISSION``): the request waits for it up to its load timeout; a read
  that finds DRAM full of copies still on their way to NVMe drops the least valuable of those
  (policy order) rather than leave the request to recompute;
* ahead (``READ_QUEUED``): started by the look-ahead window for a queued request; its wait starts
  only when the request reaches admission;
* background (``READ_BACKGROUND``): a prefix the policy predicts will return
  (:mod:`hiradix.core.returns`); no request waits for it, it runs behind every other read, and it
  displaces only redundant copies.
"""

from __future__ import annotations

from typing import Callable, Optional

from hiradix.core import returns
from hiradix.core.ledger import Kind, TierBooks
from hiradix.core.node import Tier, TreeNode
from hiradix.core.placement import Placement
from hiradix.core.ports import READ_AT_ADMISSION, READ_BACKGROUND, READ_QUEUED, IOClient
from hiradix.core.read_waits import ReadWaits
from hiradix.core.stats import TierStats
from hiradix.core.store_tier import StoreTier
from hiradix.core.tree import TieredRadixTree


class DramReads:
    """Opens the reads into DRAM of one tree (one TP rank).

    Args:
        tree, books, placement: the tree, its ledger and its placement (makes DRAM room).
        client: the I/O client (None: no tier below DRAM, nothing is read).
        waits: the deadlines admissions wait for.
        reads_ahead: the background reads' budget and accounting.
        stats: the counters.
        store: the cluster store's decisions (None: no store).
        clock: monotonic seconds.
    """

    def __init__(self, tree: TieredRadixTree, books: TierBooks, placement: Placement, client: Optional[IOClient],
                 waits: ReadWaits, reads_ahead: returns.ReadAhead, stats: TierStats, store: Optional[StoreTier],
                 clock: Callable[[], float]):
        self.tree, self.books, self.placement, self.client = tree, books, placement, client
        self.waits, self.reads_ahead, self.stats, self.store, self.clock = waits, reads_ahead, stats, store, clock

    def _source_on(self, src: Tier) -> bool:
        if self.client is None:
            return False
        return self.books.nvme_enabled if src == Tier.NVME else self.store is not None and self.store.enabled

    def start(self, nodes: list[TreeNode], timeout_s: float, ahead: bool = False, src: Tier = Tier.NVME,
              deadline_s: Optional[float] = None, background: bool = False) -> bool:
        """Start reads into DRAM of ``nodes`` (a matched path's tail held only on NVMe, or only in
        the cluster store with ``src=Tier.STORE``).

        Args:
            nodes: the tail of one request's matched path in ``src``.
            timeout_s: how long the request may wait for them at admission.
            ahead: started by the look-ahead window: the wait starts only at admission.
            src: NVME (PREFETCH jobs) or STORE (GET jobs).
            deadline_s: give-up time inherited from a store lookup (instead of now + timeout).
            background: a read for a predicted return (:meth:`read_ahead`).

        Returns:
            True if a read is in flight for these nodes (started now or earlier).
        """
        if not self._source_on(src):
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
        tokens = len(op.src_ids) * self.tree.page_size
        if background:
            self.reads_ahead.started(op.op_id, len(op.src_ids))
            self.stats.read_ahead_tokens["started"] += tokens
        priority = READ_BACKGROUND if background else READ_QUEUED if ahead else READ_AT_ADMISSION
        if kind == Kind.PREFETCH:
            self.client.submit_load(op.op_id, op.src_ids, op.dst_ids, priority=priority)
            self.stats.prefetch_tokens["started"] += tokens
        else:
            self.client.submit_get(op.op_id, op.src_ids, op.dst_ids, priority=priority)
        # A look-ahead read may start deep in the queue: its request's wait (the timeout)
        # starts only when the request reaches admission (ReadWaits.any_pending).
        self.waits.start(op.op_id, timeout_s, waits_now=not (ahead or background), deadline_s=deadline_s)
        return True

    def read_store(self, nodes: list[TreeNode], deadline_s: Optional[float]) -> bool:
        """Read what a store lookup found, within its deadline (None: no request waits yet)."""
        return self.start(nodes, 0.0, ahead=deadline_s is None, src=Tier.STORE, deadline_s=deadline_s)

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
        store_on = self._source_on(Tier.STORE) and self.store.reads.reads_store
        for src, on in ((Tier.NVME, self.books.nvme_enabled), (Tier.STORE, store_on)):
            for tail in returns.plan(self.tree, key, free, budget, src, worth) if on and budget > 0 else ():
                pages = sum(n.num_tokens for n in tail) // self.tree.page_size
                if budget > 0 and self.start(tail, timeout_s, src=src, background=True):
                    started, budget, free = started + 1, budget - pages, max(0, free - pages)
                    budget = 0 if self.reads_ahead.probing else budget  # a probe is one read
        self.reads_ahead.planned(now, started)
        return started
