"""Partial last pages over the tree: match, copy-on-write, hand over, keep and evict (pure).

:class:`PartialReuse` puts :class:`~hiradix.core.partial_pages.PartialPages` (the books of kept
pages) beside the tree and the device pool, for :class:`~hiradix.core.prefix_cache.TieredPrefixCache`:

* :meth:`PartialReuse.match`: the partial page after a whole-page prefix wholly in HBM that shares
  the most of a request's next tokens, claimed for it until the next step. A kept page (a finished
  request's last page) is moved to the request; when a page the tree holds in HBM below the prefix
  shares more (the conversation diverged inside a whole page), its rows are copied into a fresh
  page first (copy-on-write; only from free device pages: a match never evicts, and never from a
  page whose promotion from DRAM is still landing);
* :meth:`PartialReuse.take` at admission, :meth:`PartialReuse.keep` at a request's release;
* :meth:`PartialReuse.evict`: pages go with the whole-page prefix they follow (once it left HBM),
  then least recently used ones when the tree has nothing left to evict.

A page's prefix is keyed by content: its namespace and chain hash (cached on the nodes).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from hiradix.core.keys import prefix_hash
from hiradix.core.node import TreeNode
from hiradix.core.partial_pages import PartialPage, PartialPages, shared_len
from hiradix.core.ports import DevicePool, Slots
from hiradix.core.tree import TieredRadixTree

MAX_CHILDREN_SCANNED = 64  # children of a node a copy-on-write match looks at (a root may have thousands)


class PartialReuse:
    """The kept partial pages of one tree (one TP rank), and the copies made for requests.

    Args:
        tree: the tree whose whole-page prefixes the pages follow (pages of > 1 token).
        device: the HBM slot pool the pages come from and go back to.
        copy_rows: ``copy_rows(src_slots, dst_slots)`` copies device KV rows (every layer); None:
            no copy-on-write (only kept pages are reused).
        loading: ``loading(node)``: whether ``node``'s HBM rows are still being written (a
            promotion in flight); its rows are not copied.
    """

    def __init__(self, tree: TieredRadixTree, device: DevicePool, copy_rows: Optional[Callable[[Slots, Slots], None]],
                 loading: Callable[[TreeNode], bool]):
        self.tree, self.device, self.copy_rows, self.loading = tree, device, copy_rows, loading
        self.pages = PartialPages(tree.page_size)

    @property
    def num_pages(self) -> int:
        return self.pages.num_pages

    @property
    def reused_tokens(self) -> int:
        return self.pages.reused_tokens

    def all_slots(self) -> list[Any]:
        return self.pages.all_slots()

    def new_step(self) -> None:
        self.pages.new_step()

    def reset(self) -> None:
        self.pages.reset()

    def _key(self, node: TreeNode, namespace: Optional[tuple]) -> tuple:
        return namespace, prefix_hash(self.tree.root, node, self.tree.page_size)

    def match(self, node: TreeNode, namespace: Optional[tuple], next_tokens: Sequence[int],
              claimer: Any) -> tuple[int, Optional[PartialPage]]:
        """The partial page after the whole-page prefix ending at ``node`` (all in HBM) that shares
        the most of ``next_tokens``, claimed for ``claimer`` until the next step; ``(0, None)`` if none."""
        if not next_tokens:
            return 0, None
        key = self._key(node, namespace)
        num, page = self.pages.match(key, next_tokens, claimer) if self.pages.num_pages else (0, None)
        if page is not None and num < len(page.tokens) and self._can_copy():
            # the request leaves the kept page inside it: copy its rows, the page stays for its own branch
            page = self._copy(key, node, page.slots[:num], next_tokens[:num], claimer)
        if num < len(next_tokens) and self._can_copy():
            child, shared = self._page_below(node, namespace, next_tokens)
            if shared > num:
                num, page = shared, self._copy(key, node, child.hbm_slots[:shared], next_tokens[:shared], claimer)
        return num, page

    def _can_copy(self) -> bool:
        """A copy-on-write is possible now: a copier, and a free device page (a match never evicts)."""
        return self.copy_rows is not None and self.device.available_size() >= self.tree.page_size

    def _copy(self, key: tuple, node: TreeNode, src_slots: Slots, tokens: Sequence[int], claimer: Any) -> PartialPage:
        """A fresh page holding a copy of ``src_slots``' rows (``tokens``), claimed by ``claimer``."""
        slots = self.device.alloc(self.tree.page_size)
        self.copy_rows(src_slots, slots[: len(tokens)])
        return self.pages.add_claimed(key, tokens, slots, node, claimer)

    def _page_below(self, node: TreeNode, namespace: Optional[tuple],
                    next_tokens: Sequence[int]) -> tuple[Optional[TreeNode], int]:
        """The child of ``node`` in HBM whose first page shares the most leading tokens with
        ``next_tokens`` (fewer than a page: else the match would have gone on), and how many."""
        best, best_len = None, 0
        for checked, child in enumerate(node.children.values()):
            if checked >= MAX_CHILDREN_SCANNED:
                break
            if child.hbm_slots is None or child.namespace != namespace or self.loading(child):
                continue
            n = shared_len(child.tokens, next_tokens)
            if n > best_len:
                best, best_len = child, n
        return best, best_len

    def take(self, page: PartialPage, claimer: Any, num_tokens: int) -> Slots:
        """Hand a claimed page to its request (the slots of its first ``num_tokens`` rows)."""
        return self.pages.take(page, claimer, num_tokens)[:num_tokens]

    def keep(self, node: TreeNode, namespace: Optional[tuple], tokens: Sequence[int], slots: Slots) -> bool:
        """Keep a released request's last page after the whole-page prefix ending at ``node``:
        ``tokens`` (fewer than a page) in its first rows, ``slots`` the whole page's; False: not
        kept (the caller frees it as before)."""
        kept, replaced = self.pages.keep(self._key(node, namespace), tokens, slots, owner=node)
        for old in replaced:
            self.device.free(old)
        return kept

    def evict(self, short_tokens: int, tree_evicted: bool) -> int:
        """Free the pages whose prefix just left HBM (if the tree evicted), then, if still
        ``short_tokens`` short (the tree had nothing more to evict), the least recently used
        ones; returns tokens freed."""
        page_size, root = self.tree.page_size, self.tree.root
        freed = self.pages.evict_orphans(lambda n: n is root or (n.alive and n.hbm_slots is not None)) if tree_evicted else []
        short_tokens -= len(freed) * page_size
        if short_tokens > 0:
            freed += self.pages.evict(-(-short_tokens // page_size))
        for slots in freed:
            self.device.free(slots)  # the whole page
        return len(freed) * page_size
