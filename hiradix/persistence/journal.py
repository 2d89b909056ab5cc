"""Glue between the tree and the NVMe tier's durable index (restart persistence).

:class:`IndexJournal` is the real :class:`hiradix.core.ports.NvmeJournal`, what the ledger
(:class:`hiradix.core.ledger.TierBooks`) reports NVMe slot changes to: it turns a node into its
pages' prefix-chain records for :class:`hiradix.persistence.index.NvmeIndex`
(a slot is invalidated before it is rewritten; put once its demotion landed). :func:`restore`
rebuilds NVMe-only nodes from the index's pages at start, merging single-child chains into
one node per edge, as :meth:`TieredRadixTree.insert` would have built them.

Only slot ids, token ids and hashes cross here; the index file is the only I/O.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from hiradix.core.ledger import TierBooks
from hiradix.core.node import TreeNode
from hiradix.core.tree import TieredRadixTree
from hiradix.core.keys import page_tokens, prefix_hash
from hiradix.persistence.index import NvmeIndex, Page

logger = logging.getLogger(__name__)


class IndexJournal:
    """Implements :class:`hiradix.core.ports.NvmeJournal` over an :class:`NvmeIndex`.

    Every call writes to the index file on the calling (scheduler) thread: ``invalidate`` and
    ``stored`` append a record, ``sync`` fsyncs at most once a second.

    Attributes:
        landed: nodes whose NVMe copy landed since the caller last drained it (the tier
            controller persists their ancestors too, so a restart finds whole prefixes).
    """

    def __init__(self, index: NvmeIndex, tree: TieredRadixTree):
        self.index = index
        self.tree = tree
        self.landed: list[TreeNode] = []

    def invalidate(self, slots: Sequence[int]) -> None:
        self.index.invalidate(slots)

    def sync(self) -> None:
        self.index.sync()

    def durable_pages(self, slots: Optional[Sequence[int]] = None) -> Optional[int]:
        """How many of ``slots`` (None: of all slots) the durable index lists now; a landed page
        whose parent page is not listed yet is not (:meth:`NvmeIndex.record`)."""
        return self.index.num_pages if slots is None else self.index.listed(slots)

    def stored(self, node: TreeNode, slots: Sequence[int]) -> None:
        pages = self._pages(node)
        node.chain_hash = self.index.record(slots, self._parent_hash(node), pages, node.namespace)
        self.landed.append(node)

    def _pages(self, node: TreeNode) -> list:
        return page_tokens(node.tokens, self.tree.page_size)

    def _parent_hash(self, node: TreeNode) -> bytes:
        """Chain hash of the prefix above ``node`` (cached on the nodes, :mod:`hiradix.core.keys`)."""
        return prefix_hash(self.tree.root, node.parent, self.tree.page_size)


def restore(tree: TieredRadixTree, books: TierBooks, pages: list[Page]) -> int:
    """Re-index persisted pages as NVMe-only nodes of an empty ``tree``; claim their slots.

    Args:
        pages: from :meth:`NvmeIndex.open`, parents before children.

    Returns:
        Pages restored. Slots the NVMe allocator cannot take (out of range) are skipped.
    """
    if books.nvme is None or not pages:
        return 0
    children: dict[bytes, list[Page]] = {}
    for page in pages:
        if page.slot < books.nvme.capacity:
            children.setdefault(page.parent_hash, []).append(page)
    restored = 0
    stack: list[tuple[TreeNode, Page]] = [(tree.root, p) for p in children.get(b"", [])]
    while stack:
        parent_node, first = stack.pop()
        chain = [first]
        while len(children.get(chain[-1].hash, ())) == 1:
            chain.append(children[chain[-1].hash][0])
        node = _restore_edge(tree, books, parent_node, chain)
        if node is None:
            continue
        restored += len(chain)
        stack.extend((node, p) for p in children.get(chain[-1].hash, []))
    return restored


def _restore_edge(tree: TieredRadixTree, books: TierBooks, parent: TreeNode, chain: list[Page]) -> Optional[TreeNode]:
    tokens = [t for p in chain for t in p.tokens]
    slots = [p.slot for p in chain]
    try:
        books.nvme.claim(slots)
    except ValueError:
        logger.warning("hiradix: persisted NVMe slots %s are claimed twice; not re-indexed", slots[:4])
        return None
    try:
        return tree.restore(parent, tokens, chain[0].namespace, slots)
    except ValueError as exc:
        books.nvme.free(slots)
        logger.warning("hiradix: persisted pages not re-indexed: %s", exc)
        return None
