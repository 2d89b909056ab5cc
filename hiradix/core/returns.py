"""Reads ahead for predicted returns: which NVMe-only prefixes to bring into DRAM before they are asked for.

Pure planning, read-only (the tree is not touched). A policy with ``reads_ahead``
(:class:`hiradix.core.predict.PredictivePolicy`) ranks every node by how likely it is to be
reused soon; this module turns that ranking into reads: a prefix whose hit would stop on NVMe
(or in the cluster store) is worth reading into DRAM when its last node ranks above the DRAM
copies the read would displace. The look-ahead window does the same for requests already queued
(:mod:`hiradix.core.lookahead`); this is for the conversations predicted to come back.

The DRAM such a read may use: free DRAM pages above the placement's low-water mark, plus
redundant DRAM copies (the node is on another local tier too; a store copy is only a hint) that
rank below the prefix read (so none a queued request needs) and were not themselves read ahead
and left unused since. Last local copies are never displaced. The caller bounds the pages in
flight (``max_pages``) and runs the reads at background priority, behind every read a request
waits for.
"""

from __future__ import annotations

import heapq
from typing import Callable, Optional

from hiradix.core.node import Tier, TreeNode
from hiradix.core.tree import TieredRadixTree

MAX_PATHS_RANKED = 16  # best-ranked prefixes looked at per plan


def unread_tail(tree: TieredRadixTree, leaf: TreeNode, src: Tier) -> list[TreeNode] | None:
    """The nodes on the path to ``leaf`` in neither HBM nor DRAM, root side first, if all of them
    can be read from ``src`` now (held there, no transfer using them); else None."""
    tail = []
    node = leaf
    while node is not tree.root:
        if not (node.in_tier(Tier.HBM) or node.in_tier(Tier.DRAM)):
            if not node.in_tier(src) or node.ops or node.pinned[src]:
                return None
            tail.append(node)
        node = node.parent
    tail.reverse()
    return tail


def plan(tree: TieredRadixTree, key: Callable[[TreeNode, Tier], tuple], free_pages: int, max_pages: int,
         src: Tier = Tier.NVME, worth: Callable[[TreeNode], bool] = lambda node: True) -> list[list[TreeNode]]:
    """Prefixes to read from ``src`` into DRAM, best first.

    Args:
        tree: the tree (read only).
        key: the policy's priority (larger = more likely reused soon).
        worth: the policy's filter: only prefixes whose last node it accepts are read (asked of
            the best-ranked ones only: what it refuses must rank below what it accepts).
        free_pages: free DRAM pages this may take (above the low-water mark), >= 0.
        max_pages: pages all the reads together may cover (the budget left in flight).
        src: NVME, or STORE for prefixes another server put in the cluster store.

    Returns:
        Per prefix, its unread nodes (root side first); their pages fit in ``max_pages`` and in
        ``free_pages`` plus the redundant DRAM copies ranked below the prefix's last node.
    """
    if max_pages <= 0:
        return []
    ps = tree.page_size
    held = tree.sole_copies(Tier.STORE) if src == Tier.STORE else tree.candidates(src)  # the store evicts on its own
    leaves = [n for n in held if not n.children and not n.in_tier(Tier.DRAM) and not n.in_tier(Tier.HBM)]
    best = [n for n in heapq.nlargest(MAX_PATHS_RANKED, leaves, key=lambda n: key(n, Tier.DRAM)) if worth(n)]
    if not best:
        return []
    # Redundant DRAM copies, most valuable first (pop() = least); not those read ahead and not
    # used yet, so two prefixes never displace each other in turn.
    victims = sorted(((key(n, Tier.DRAM), len(n.dram_pages)) for n in tree.candidates(Tier.DRAM)
                      if n.num_local_tiers > 1 and n.dram_from is None), reverse=True)
    room, budget, out = free_pages, max_pages, []
    for leaf in best:
        tail = unread_tail(tree, leaf, src)
        if not tail:
            continue
        pages = sum(n.num_tokens for n in tail) // ps
        if pages > budget:
            continue
        leaf_key = key(leaf, Tier.DRAM)
        while room < pages and victims and victims[-1][0] < leaf_key:
            room += victims.pop()[1]
        if room < pages:
            break  # the rest rank lower: they would displace even less
        room -= pages
        budget -= pages
        out.append(tail)
    return out


READ_AHEAD_EVERY_S = 1.0  # how often reads for predicted returns are planned (while some start)
READ_AHEAD_DRAM_SHARE = 1 / 16  # DRAM pages these reads may have in flight, at full trust
TRUST_FULL = 0.5  # the full budget once this share of the tokens read ahead is used
TRUST_MIN = 0.1  # below this share, only a probe: one read every PROBE_EVERY_S
PROBE_EVERY_S = 30.0
TRUST_DECAY = 0.98  # per plan: the record follows the workload


class ReadAhead:
    """When, and how much, to read ahead for predicted returns, judged by its own record.

    A read ahead pays only if a request uses its pages before DRAM drops them. ``trust`` is the
    decaying share of tokens read ahead that were used (1 before any record); the pages in
    flight are bounded by ``READ_AHEAD_DRAM_SHARE`` of DRAM times ``trust / TRUST_FULL``. Below
    ``TRUST_MIN`` only a probe is made, one read every ``PROBE_EVERY_S``, so that a workload whose
    returns become predictable earns the budget back. A plan is made at most every
    ``READ_AHEAD_EVERY_S``, up to 8x less often while none starts, and never while a read that a
    request waits for (or will) is in flight: those come first.

    Args:
        dram_pages: DRAM capacity, in pages.
        tokens: where the totals go (``TierStats.read_ahead_tokens``: ``used``, ``wasted``).
    """

    def __init__(self, dram_pages: int, tokens: Optional[dict] = None):
        self.max_pages = max(1, int(READ_AHEAD_DRAM_SHARE * dram_pages))
        self.in_flight: dict[int, int] = {}  # op id -> pages
        self.unused: dict[int, TreeNode] = {}  # node id -> node whose DRAM copy was read ahead, unused
        self.tokens = tokens if tokens is not None else {"used": 0, "wasted": 0}  # totals
        self._used = self._wasted = 0.0  # decayed
        self.next_s, self._idle = 0.0, 0

    @property
    def trust(self) -> float:
        total = self._used + self._wasted
        return 1.0 if total <= 0 else self._used / total

    @property
    def probing(self) -> bool:
        """Too few reads ahead were used: one probe read per ``PROBE_EVERY_S`` only."""
        return self.trust < TRUST_MIN

    def budget(self, now_s: float, other_reads: bool) -> int:
        """Pages a plan made now may read (0: not now)."""
        if now_s < self.next_s or other_reads:
            return 0
        self._settle()
        if self.probing:
            return self.max_pages if not self.in_flight else 0
        cap = max(1, int(self.max_pages * min(1.0, self.trust / TRUST_FULL)))
        return max(0, cap - sum(self.in_flight.values()))

    def planned(self, now_s: float, started: int) -> None:
        """A plan at ``now_s`` started ``started`` reads: the next plan comes sooner or later."""
        self._idle = 0 if started else min(self._idle + 1, 3)
        wait_s = PROBE_EVERY_S if self.probing and started else READ_AHEAD_EVERY_S * 2 ** self._idle
        self.next_s = now_s + wait_s

    def started(self, op_id: int, pages: int) -> None:
        self.in_flight[op_id] = pages

    def landed(self, op_id: int, nodes: list[TreeNode]) -> None:
        """Transfer ``op_id`` completed (whatever its outcome): its nodes now in DRAM are on record."""
        if self.in_flight.pop(op_id, None) is None:
            return
        for node in nodes:
            if node.alive and node.in_tier(Tier.DRAM):
                self.unused[node.id] = node

    def used(self, nodes: list[TreeNode]) -> None:
        """A request loads ``nodes`` from DRAM: those read ahead paid off."""
        for node in nodes:
            if self.unused.pop(node.id, None) is not None:
                self.tokens["used"] += node.num_tokens
                self._used += node.num_tokens

    def _settle(self) -> None:
        """Pages read ahead that left DRAM unused count against the record; decay it."""
        self._used *= TRUST_DECAY
        self._wasted *= TRUST_DECAY
        for node_id, node in list(self.unused.items()):
            if not node.alive or not node.in_tier(Tier.DRAM):
                del self.unused[node_id]
                self.tokens["wasted"] += node.num_tokens
                self._wasted += node.num_tokens

    def reset(self) -> None:
        """Forget the reads in flight and the record (a flushed cache)."""
        self.in_flight.clear()
        self.unused.clear()
        self._used = self._wasted = 0.0
        self.next_s, self._idle = 0.0, 0
