"""Write-through backups that found DRAM full, opened once it has room (pure bookkeeping).

Write-through copies a node's KV to DRAM when it is inserted (CachedAttention §3.2). A DRAM full
of last copies still on their way to NVMe may have no room at that moment, and without a retry
the node would stay HBM-only: with a cluster store nothing would be shared (PUTs start from DRAM,
:mod:`hiradix.core.store_tier`) until HBM evicted it, so a turn moved to another server would
miss it. :class:`DeferredBackups` remembers such nodes, oldest first and at most
``MAX_DEFERRED_NODES``, and opens their backups per scheduler step once room was made (the
demotions landed); a node that meanwhile got a DRAM copy (write-back at eviction), lost its HBM
copy or left the tree is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

from hiradix.core.node import Tier, TreeNode

MAX_DEFERRED_NODES = 4096  # the oldest are forgotten beyond this (their write-back still shares them)


class DeferredBackups:
    """Nodes whose write-through backup is owed, in the order they were deferred.

    Args:
        limit: most nodes remembered.
    """

    def __init__(self, limit: int = MAX_DEFERRED_NODES):
        self.limit = limit
        self._nodes: OrderedDict[int, TreeNode] = OrderedDict()  # node id -> node
        self.deferred_nodes = 0  # nodes deferred since start (a node counts each time)
        self.opened_nodes = 0  # of them, backups opened later

    def __len__(self) -> int:
        return len(self._nodes)

    def defer(self, nodes: Sequence[TreeNode]) -> None:
        """Owe ``nodes`` a backup (DRAM had no room for them now)."""
        for node in nodes:
            if node.id not in self._nodes:
                self._nodes[node.id] = node
                self.deferred_nodes += 1
        while len(self._nodes) > self.limit:
            self._nodes.popitem(last=False)

    def retry(self, open_backup: Callable[[list[TreeNode]], bool]) -> int:
        """Open the owed backups, oldest first, until one finds no room.

        Args:
            open_backup: opens the backup of the given nodes and starts it; False if DRAM still
                has no room (nothing changed).

        Returns:
            Nodes whose backup was opened.
        """
        opened = 0
        for node_id, node in list(self._nodes.items()):
            if not node.alive or not node.in_tier(Tier.HBM) or node.in_tier(Tier.DRAM):
                del self._nodes[node_id]  # evicted, or written back at eviction: nothing owed
                continue
            if node.ops:
                continue  # a transfer of it is in flight (a write-back backup): look again later
            if not open_backup([node]):
                break
            del self._nodes[node_id]
            opened += 1
        self.opened_nodes += opened
        return opened

    def clear(self) -> None:
        """Forget every owed backup (the tree is being reset)."""
        self._nodes.clear()
