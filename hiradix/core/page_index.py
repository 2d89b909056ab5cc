"""An index of the tree's pages by content alone, independent of the prefix before them.

The radix tree finds a page only after its whole prefix. A client that drops a conversation's
oldest messages sends ``A ‖ C`` where the tree holds ``A ‖ B ‖ C``; C is cached, but not as a
continuation of A. This index maps ``(namespace, page tokens)`` to the nodes and page offsets
holding such a page, so C's pages can be found wherever they sit (:mod:`hiradix.core.context_shift`)
and reused at their new positions (AttentionStore §3.4: positions decoupled from saved KV).

The tree registers every node it creates or splits (:meth:`PageContentIndex.add`); entries are
checked when looked up and stale ones (a node deleted, or split so its offsets moved) are
dropped then, so the tree never has to report deletions. Pure bookkeeping: token ids only.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable, Optional, Sequence

COMPACT_SLACK_ENTRIES = 4096  # stale entries tolerated before a rebuild (plus the live count)


class PageContentIndex:
    """``(namespace, page) -> [(node, page offset in node)]`` over a tree's nodes.

    Args:
        page_size: tokens per page (the tree's).
    """

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._where: dict[tuple, list[tuple[Any, int]]] = defaultdict(list)
        self._entries = 0
        self._live_at_rebuild = 0

    def __len__(self) -> int:
        """Entries held, stale ones included."""
        return self._entries

    def add(self, node: Any) -> None:
        """Register every page of ``node`` (a new node, or one whose tokens a split changed)."""
        ps, tokens = self.page_size, node.tokens
        for i in range(len(tokens) // ps):
            self._where[(node.namespace, tuple(tokens[i * ps : (i + 1) * ps]))].append((node, i))
        self._entries += len(tokens) // ps

    def find(self, namespace: Optional[tuple], page: Sequence[int]) -> list[tuple[Any, int]]:
        """Live ``(node, page offset)`` holding ``page`` in ``namespace`` (stale entries dropped)."""
        key = (namespace, tuple(page))
        found = self._where.get(key)
        if not found:
            return []
        ps = self.page_size
        live = [(node, i) for node, i in dict.fromkeys(found)
                if node.parent is not None and tuple(node.tokens[i * ps : (i + 1) * ps]) == key[1]]
        self._entries -= len(found) - len(live)
        if live:
            self._where[key] = live
        else:
            del self._where[key]
        return live

    def compact(self, nodes: Iterable[Any]) -> bool:
        """Rebuild from ``nodes`` (the tree's) when stale entries outnumber the live ones by
        :data:`COMPACT_SLACK_ENTRIES`; returns whether it did."""
        if self._entries <= 2 * self._live_at_rebuild + COMPACT_SLACK_ENTRIES:
            return False
        self._where.clear()
        self._entries = 0
        for node in nodes:
            self.add(node)
        self._live_at_rebuild = self._entries
        return True
