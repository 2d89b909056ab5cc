"""One tier's eviction candidates in policy order, kept between evictions (pure).

Rebuilding a heap over every candidate at each eviction costs O(candidates) policy keys: at
100,000 HBM nodes about 0.35 s per eviction on this CPU (``bench/micro/step_cost.py --nodes``),
on the admission path. :class:`VictimHeap` keeps the heap instead and fixes it lazily, which is
exact for a policy whose keys only grow (``EvictionPolicy.keys_grow``: a touch makes a node more
recent, a queued request protects it) as long as the policy reports the nodes whose key went down
(:meth:`~hiradix.core.policy.EvictionPolicy.take_lowered`: a request left the look-ahead window):

* a node that becomes a candidate is pushed with its key then (:meth:`VictimHeap.joined`);
* an entry popped whose key is no longer the node's is pushed again with the current key (the
  node's key grew since: it waits for its turn);
* an entry of a node that is no longer a candidate is dropped;
* a node yielded but still a candidate when the walk ends (the caller had freed enough) is pushed
  back; the heap is rebuilt when stale entries outnumber the candidates.

Every candidate so has an entry whose key is at most its current key, so the entry popped with
its current key is the smallest: the order is the one a fresh heap would give (ties by node id).
"""

from __future__ import annotations

import heapq
from typing import Callable, Iterable, Iterator

from hiradix.core.node import Tier, TreeNode

STALE_SLACK = 1024  # stale entries tolerated beyond the number of candidates before a rebuild


class VictimHeap:
    """The candidates of ``tier`` by ``key`` (the policy's priority), smallest first.

    Args:
        tier: the tier whose copies the candidates hold.
        candidates: the live candidate set (the tree's; read, never changed here).
        key: the policy's priority, ``key(node, tier)``.
    """

    def __init__(self, tier: Tier, candidates: set[TreeNode], key: Callable[[TreeNode, Tier], tuple]):
        self.tier, self.candidates, self.key = tier, candidates, key
        self._heap: list[tuple[tuple, int, TreeNode]] = []
        self.rebuild()

    def __len__(self) -> int:
        return len(self._heap)

    def rebuild(self) -> None:
        """One entry per candidate, with its current key (O(candidates))."""
        self._heap = [(self.key(n, self.tier), n.id, n) for n in self.candidates]
        heapq.heapify(self._heap)

    def joined(self, node: TreeNode) -> None:
        """``node`` just became a candidate (or its key may have gone down): push its entry."""
        heapq.heappush(self._heap, (self.key(node, self.tier), node.id, node))

    def rekey(self, nodes: Iterable[TreeNode]) -> None:
        """Nodes whose key may have gone down: push fresh entries for those still candidates."""
        for node in nodes:
            if node in self.candidates:
                self.joined(node)

    def walk(self) -> Iterator[TreeNode]:
        """Candidates in key order, each once; the caller detaches (or backs up) each yielded node
        before asking for the next, and may stop at any point. A node that becomes a candidate
        meanwhile (a parent left without children in the tier) is yielded in its turn."""
        if len(self._heap) > 2 * len(self.candidates) + STALE_SLACK:
            self.rebuild()
        heap, cands, key, tier = self._heap, self.candidates, self.key, self.tier
        yielded: list[TreeNode] = []
        seen: set[int] = set()
        try:
            while heap:
                stored, node_id, node = heap[0]
                if node not in cands or node_id in seen:
                    heapq.heappop(heap)
                    continue
                current = key(node, tier)
                if current != stored:
                    heapq.heapreplace(heap, (current, node_id, node))
                    continue
                heapq.heappop(heap)
                seen.add(node_id)
                yielded.append(node)
                yield node
        finally:
            self.rekey(yielded)  # those the caller kept stay candidates: back in the heap
