"""The tiered radix tree: prefix match, insert, split, lock references, eviction candidates.

Pure bookkeeping: no I/O, no torch, no threads; only token ids and slot/page ids. The node
records are in :mod:`hiradix.core.node`; the two-phase transfers between tiers and the DRAM/NVMe
page books in :mod:`hiradix.core.ledger`; which copy leaves which tier in
:mod:`hiradix.core.placement`. The tree owns the loops over candidates (:meth:`victims`,
:meth:`plan_evict`); a policy (:mod:`hiradix.core.policy`) only ranks them, as SGLang 0.5.23's
``mem_cache/evict_policy.py`` ranks the nodes of ``radix_cache.py``.

Keys are whole pages. A child is indexed by its first page (prefixed by the namespace at the
root). A split at ``n`` tokens makes a new *upper* node holding the first ``n`` tokens (and the
first ``n / page_size`` pages of every tier's ids); the existing node keeps the rest and moves
below it, so references to the lower node (locks, in-flight transfers) stay valid.

Invariants (checked by :meth:`TieredRadixTree.check_integrity`):

* keys are page-aligned; a child is indexed by its first page;
* HBM residency is prefix-closed: a node in HBM has its parent in HBM (or is a root child);
* every non-root node is held by at least one tier (a node no tier holds is deleted);
* a node's ``lock_ref`` is at least the sum of its children's (locks propagate to the root);
* locked nodes are in HBM; HBM evictable + protected == HBM tokens the tree holds;
* the candidate and sole-copy sets equal a recount.

DRAM/NVMe page ownership (free + held by nodes + reserved == capacity) is checked by
:meth:`hiradix.core.ledger.TierBooks.check_integrity`.
"""

from __future__ import annotations

import heapq
import itertools
import time
from array import array
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from hiradix.core.node import NUM_TIERS, IntegrityError, Tier, TreeMatch, TreeNode
from hiradix.core.page_index import PageContentIndex
from hiradix.core.policy import EvictionPolicy, LRUPolicy
from hiradix.core.victim_heap import VictimHeap

if TYPE_CHECKING:
    from hiradix.core.kv_events import TierEvents

__all__ = ["IntegrityError", "Tier", "TieredRadixTree", "TreeMatch", "TreeNode"]


class TieredRadixTree:
    """A page-granular radix tree whose nodes carry per-tier KV records.

    Args:
        page_size: tokens per page (>= 1); keys are truncated to whole pages.
        policy: ranks eviction candidates (see :mod:`hiradix.core.policy`); default LRU.
        clock: monotonic time source in seconds (injectable for tests).

    Raises:
        ValueError: ``page_size`` < 1.
    """

    def __init__(
        self,
        page_size: int,
        policy: Optional[EvictionPolicy] = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.policy = policy or LRUPolicy()
        self.clock = clock
        self.on_split: Optional[Callable[[TreeNode, TreeNode], None]] = None  # (lower, new upper)
        self.page_index: Optional[PageContentIndex] = None  # pages by content (context overflow only)
        self.events: Optional[TierEvents] = None  # tier changes for SGLang's KV events (None: off)
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Drop every node. The caller frees the slots it handed over (see :meth:`all_hbm_slots`)."""
        self._ids = itertools.count()
        self.root = TreeNode(id=next(self._ids), parent=None, tokens=array("q"), namespace=None)
        self.root.lock_ref = 1
        self.root.hbm_slots = []
        self.hbm_evictable_tokens = 0  # unlocked tokens the tree holds in HBM
        self.hbm_protected_tokens = 0  # locked tokens the tree holds in HBM
        self.tier_tokens = [0] * NUM_TIERS  # tokens held per tier
        self._candidates: list[set[TreeNode]] = [set() for _ in Tier]  # eviction candidates per tier
        self._sole: list[set[TreeNode]] = [set() for _ in Tier]  # nodes whose last copy that tier holds (TreeNode.sole_tier)
        self._hbm_heap: Optional[VictimHeap] = None  # HBM candidates kept in order (policies whose keys grow)
        if self.page_index is not None:
            self.page_index = PageContentIndex(self.page_size)
        if self.events is not None:
            self.events.cleared()

    def iter_nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_hbm_slots(self) -> list[Any]:
        """HBM slot arrays of every node (to free them before :meth:`reset`)."""
        return [n.hbm_slots for n in self.iter_nodes() if n.hbm_slots is not None]

    def candidates(self, tier: Tier) -> set[TreeNode]:
        """Nodes whose copy in ``tier`` may be evicted now (read-only view)."""
        return self._candidates[tier]

    def sole_copies(self, tier: Tier) -> set[TreeNode]:
        """Nodes whose last copy ``tier`` holds (:meth:`TreeNode.sole_tier`: a DRAM copy the store
        also holds counts; read-only view)."""
        return self._sole[tier]

    # ------------------------------------------------------------------ match
    def match(
        self,
        tokens: Sequence[int],
        namespace: Optional[tuple] = None,
        *,
        split: bool = True,
        touch: bool = True,
    ) -> TreeMatch:
        """Find the longest cached prefix of ``tokens`` (truncated to whole pages).

        Args:
            tokens: token ids, ``array('q')`` or list of int.
            namespace: keeps prefixes of different LoRA adapters / cache salts apart.
            split: split a node the match ends inside, so the result ends on a node
                boundary (modifies the tree); ``False`` gives a read-only peek whose last
                node may extend past the match.
            touch: refresh ``last_access_s`` along the matched path.

        Returns:
            A :class:`TreeMatch`; lengths in tokens, multiples of ``page_size``.
        """
        node, pos, nodes = self.root, 0, []
        limit = len(tokens) - len(tokens) % self.page_size
        while pos < limit:
            child = node.children.get(self._child_key(node, tokens, pos, namespace))
            if child is None:
                break
            n = self._common_len(child.tokens, tokens, pos, limit)
            if n < child.num_tokens:
                if not split:
                    nodes.append(child)
                    pos += n
                    break
                child = self._split(child, n)
            nodes.append(child)
            pos += child.num_tokens
            node = child
        if touch:
            now = self.clock()
            for n_ in nodes:
                n_.last_access_s = now
        return self._summarize(nodes, pos)

    def _summarize(self, nodes: list[TreeNode], matched: int) -> TreeMatch:
        lens = [0] * NUM_TIERS
        ends = [self.root] * NUM_TIERS
        seen, stage = 0, Tier.HBM
        for node in nodes:
            n = min(node.num_tokens, matched - seen)
            seen += n
            tier = next((t for t in Tier if t >= stage and node.in_tier(t)), None)
            if tier is None:
                break
            stage = tier
            lens[tier] += n
            ends[tier] = node
        for tier in (Tier.DRAM, Tier.NVME, Tier.STORE):
            if not lens[tier]:
                ends[tier] = ends[tier - 1]
        last = nodes[-1] if nodes else self.root
        return TreeMatch(lens[0], ends[0], lens[1], ends[1], lens[2], ends[2], tuple(nodes), last,
                         store_len=lens[3], store_node=ends[3], matched_len=matched)

    def summarize(self, nodes: Sequence[TreeNode], matched: int) -> TreeMatch:
        """The :class:`TreeMatch` of a path of ``matched`` tokens (read-only; see :meth:`match`)."""
        return self._summarize(list(nodes), matched)

    def path_unchanged(self, nodes: Sequence[TreeNode], tokens: Sequence[int], matched: int,
                       namespace: Optional[tuple] = None) -> bool:
        """Whether a peek of ``tokens`` that matched ``nodes`` (``matched`` tokens) would still
        match them: no node on the path was split or deleted, and none was added after it.

        O(len(nodes)): a split or a deletion changes some node's ``parent``; a new node after a
        path that ended on a node boundary is a child for the next page.
        """
        parent, total = self.root, 0
        for node in nodes:
            if node.parent is not parent:
                return False
            parent, total = node, total + node.num_tokens
        if total > matched:
            return True  # the peek ended inside the last node
        limit = len(tokens) - len(tokens) % self.page_size
        return matched >= limit or self._child_key(parent, tokens, matched, namespace) not in parent.children

    def touch(self, tokens: Sequence[int], namespace: Optional[tuple] = None) -> None:
        """Refresh recency along the cached path of ``tokens`` without splitting."""
        self.match(tokens, namespace, split=False, touch=True)

    # ----------------------------------------------------------------- insert
    def insert(
        self,
        tokens: Sequence[int],
        hbm_slots: Any,
        namespace: Optional[tuple] = None,
        inserted_len: int = 0,
    ) -> tuple[int, TreeNode, list[TreeNode]]:
        """Insert ``tokens`` with their HBM slots; the tree takes ownership of new slots.

        Args:
            tokens: token ids; truncated to whole pages.
            hbm_slots: device slot ids, shape ``(>= len(tokens),)`` (tensor or list).
            namespace: see :meth:`match`.
            inserted_len: tokens of this key the same request inserted before (they are not
                counted as hits again).

        Returns:
            ``(dup_len, last_node, new_hbm_nodes)``: the first ``dup_len`` tokens were already
            in HBM, so the caller still owns ``hbm_slots[:dup_len]`` and frees them (unless they
            are the tree's own); the rest now belong to the tree. ``last_node`` ends the path;
            ``new_hbm_nodes`` are the nodes that took slots (candidates for a DRAM backup).
        """
        limit = len(tokens) - len(tokens) % self.page_size
        now = self.clock()
        node, pos, dup_len, adopted = self.root, 0, 0, []
        while pos < limit:
            key = self._child_key(node, tokens, pos, namespace)
            child = node.children.get(key)
            if child is None:
                child = TreeNode(next(self._ids), node, array("q", tokens[pos:limit]), namespace)
                node.children[key] = child
                if self.page_index is not None:
                    self.page_index.add(child)
            n = self._common_len(child.tokens, tokens, pos, limit)
            if n < child.num_tokens:
                child = self._split(child, n)
            child.last_access_s = now
            if pos + n > inserted_len:
                child.hit_count += 1
            if child.hbm_slots is None:
                self.attach(child, Tier.HBM, hbm_slots[pos : pos + n])
                adopted.append(child)
            elif pos == dup_len:
                dup_len += n
            pos += n
            node = child
        return dup_len, node, adopted

    # ------------------------------------------------------- tier records
    def attach(self, node: TreeNode, tier: Tier, ids: Any) -> None:
        """Record that ``tier`` now holds ``node``'s KV at ``ids`` (slots or pages)."""
        assert not node.in_tier(tier), (node, tier)
        expect = node.num_tokens if tier == Tier.HBM else node.num_tokens // self.page_size
        assert len(ids) == expect, (node, tier, len(ids))
        if tier == Tier.HBM:
            node.hbm_slots = ids
            if node.lock_ref > 0:
                self.hbm_protected_tokens += node.num_tokens
            else:
                self.hbm_evictable_tokens += node.num_tokens
        elif tier == Tier.DRAM:
            node.dram_pages = list(ids)
        elif tier == Tier.NVME:
            node.nvme_slots = list(ids)
        else:
            node.store_keys = list(ids)
        self.tier_tokens[tier] += node.num_tokens
        self._refresh_around(node)
        if self.events is not None:
            self.events.stored(node, tier)

    def detach(self, node: TreeNode, tier: Tier) -> Any:
        """Forget ``node``'s copy in ``tier``; returns its ids for the caller to free.

        A node left with no tier is deleted (it must have no children).
        """
        ids = node.ids_in(tier)
        assert ids is not None, (node, tier)
        if self.events is not None:
            self.events.removed(node, tier)  # while it is linked: its keys follow its parent's
        if tier == Tier.HBM:
            assert node.lock_ref == 0, node
            node.hbm_slots = None
            self.hbm_evictable_tokens -= node.num_tokens
        elif tier == Tier.DRAM:
            node.dram_pages = None
            node.dram_from, node.waited_for_read = None, False
        elif tier == Tier.NVME:
            node.nvme_slots = None
        else:
            node.store_keys = None
        self.tier_tokens[tier] -= node.num_tokens
        if not node.tiers():
            self._delete(node)
        else:
            self._refresh_around(node)
        return ids

    def add_child(self, parent: TreeNode, tokens: Sequence[int], namespace: Optional[tuple], tier: Tier,
                  ids: Sequence[Any]) -> TreeNode:
        """Add a child of ``parent`` held only in ``tier`` (DRAM, NVMe or the store).

        For KV this tree did not compute: NVMe pages re-indexed at start, store pages another
        server put. The child gets a fresh access time.

        Args:
            parent: the root or a node already in the tree.
            tokens: the child's token ids, whole pages.
            namespace: see :meth:`match`.
            tier: the tier holding it.
            ids: one page id (slot, key) per page.

        Raises:
            ValueError: ``tokens`` is not whole pages, the id count differs, ``tier`` is HBM, or
                ``parent`` already has a child starting with this page.
        """
        if tier == Tier.HBM:
            raise ValueError("add_child cannot add HBM copies; insert() does")
        if not tokens or len(tokens) % self.page_size or len(ids) != len(tokens) // self.page_size:
            raise ValueError(f"{len(tokens)} tokens / {len(ids)} ids is not whole pages of {self.page_size}")
        key = self._child_key(parent, tokens, 0, namespace)
        if key in parent.children:
            raise ValueError(f"{parent} already has a child for page {key}")
        node = TreeNode(next(self._ids), parent, array("q", tokens), namespace)
        node.last_access_s = self.clock()
        parent.children[key] = node
        if self.page_index is not None:
            self.page_index.add(node)
        self.attach(node, tier, list(ids))
        return node

    def restore(self, parent: TreeNode, tokens: Sequence[int], namespace: Optional[tuple], nvme_slots: Sequence[int]) -> TreeNode:
        """:meth:`add_child` on NVMe (re-indexing persisted pages at start)."""
        return self.add_child(parent, tokens, namespace, Tier.NVME, nvme_slots)

    def _delete(self, node: TreeNode) -> None:
        assert not node.children and not node.tiers(), node
        parent = node.parent
        del parent.children[self._key_in_parent(node)]
        for cands in (*self._candidates, *self._sole):
            cands.discard(node)
        node.parent = None
        self._refresh(parent)
        if self.policy.uses_history:
            self.policy.observe_delete(node, self.clock())

    # ------------------------------------------------------------------ split
    def _split(self, node: TreeNode, n: int) -> TreeNode:
        """Split ``node`` after ``n`` tokens; returns the new upper node (the prefix)."""
        assert 0 < n < node.num_tokens and n % self.page_size == 0
        p = n // self.page_size
        upper = TreeNode(
            id=next(self._ids),
            parent=node.parent,
            tokens=node.tokens[:n],
            namespace=node.namespace,
            lock_ref=node.lock_ref,
            ops=set(node.ops),
            pinned=list(node.pinned),
            last_access_s=node.last_access_s,
            hit_count=node.hit_count,
            dram_from=node.dram_from,
            waited_for_read=node.waited_for_read,
            policy_stamp=node.policy_stamp,
        )
        if node.hbm_slots is not None:
            upper.hbm_slots, node.hbm_slots = node.hbm_slots[:n], node.hbm_slots[n:]
        if node.dram_pages is not None:
            upper.dram_pages, node.dram_pages = node.dram_pages[:p], node.dram_pages[p:]
        if node.nvme_slots is not None:
            upper.nvme_slots, node.nvme_slots = node.nvme_slots[:p], node.nvme_slots[p:]
        if node.store_keys is not None:
            upper.store_keys, node.store_keys = node.store_keys[:p], node.store_keys[p:]
        if node.event_keys is not None:
            upper.event_keys, node.event_keys = node.event_keys[:p], node.event_keys[p:]
        parent_key = self._key_in_parent(node)
        node.tokens = node.tokens[n:]
        node.parent = upper
        upper.children[self._child_key(upper, node.tokens, 0, node.namespace)] = node
        upper.parent.children[parent_key] = upper
        if self.on_split is not None:
            self.on_split(node, upper)
        if self.page_index is not None:
            self.page_index.add(upper)
            self.page_index.add(node)  # its pages moved back by n tokens
        self._refresh(upper)
        self._refresh(node)
        return upper

    # ------------------------------------------------------------------ locks
    def inc_lock(self, node: TreeNode) -> int:
        """Pin the path root..``node`` in HBM for one running request.

        Returns:
            Change of ``hbm_evictable_tokens`` (<= 0), as SGLang's ``IncLockRefResult.delta``.

        Raises:
            ValueError: a node on the path is not in HBM.
        """
        delta = 0
        while node is not self.root:
            if node.hbm_slots is None:
                raise ValueError(f"cannot lock {node}: not in HBM")
            if node.lock_ref == 0:
                self.hbm_evictable_tokens -= node.num_tokens
                self.hbm_protected_tokens += node.num_tokens
                delta -= node.num_tokens
            node.lock_ref += 1
            self._refresh(node)
            node = node.parent
        return delta

    def dec_lock(self, node: TreeNode) -> int:
        """Undo one :meth:`inc_lock` on ``node``; returns the change of evictable tokens (>= 0).

        Raises:
            ValueError: a node on the path is not locked (unbalanced release).
        """
        delta = 0
        while node is not self.root:
            if node.lock_ref <= 0:
                raise ValueError(f"unbalanced unlock of {node}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.hbm_evictable_tokens += node.num_tokens
                self.hbm_protected_tokens -= node.num_tokens
                delta += node.num_tokens
            self._refresh(node)
            node = node.parent
        return delta

    # ---------------------------------------------------------------- evict
    def victims(self, tier: Tier) -> Iterator[TreeNode]:
        """Eviction candidates of ``tier`` in policy order, re-checked lazily.

        The caller detaches (or backs up) each yielded node before asking for the next; a
        parent that becomes a candidate meanwhile is yielded in its turn.
        """
        if tier == Tier.HBM and self.policy.keys_grow:
            yield from self._hbm_victims().walk()
            return
        key = self.policy.priority
        cands = self._candidates[tier]
        heap = [(key(n, tier), n.id, n) for n in cands]
        heapq.heapify(heap)
        while heap:
            _, _, node = heapq.heappop(heap)
            if node not in cands:
                continue
            parent = node.parent
            yield node
            if parent is not None and parent in cands:
                heapq.heappush(heap, (key(parent, tier), parent.id, parent))

    def plan_evict(self, tier: Tier, num_pages: int, allow_sole: bool, spare: Optional[Tier] = None) -> list[TreeNode]:
        """Choose copies of ``tier`` (DRAM or NVMe) to drop so ``num_pages`` pages come free.

        Read-only: nothing changes. Policy order within two passes: copies another local tier
        also holds first (except, with ``spare``, those whose one other local copy is in
        ``spare``: dropping one would leave a last copy there); then, if ``allow_sole``, last
        local copies (a store copy is only a hint), each node after its children in this tier
        (dropping a last copy deletes the node, which may make its parent a leaf; a child the
        store still holds stays, so its parent's last copy does not go).

        Returns:
            The nodes, in the order to drop them (children before parents): just enough for
            ``num_pages`` pages, or every candidate when they hold fewer.
        """
        key, ps = self.policy.priority, self.page_size
        cands = self._candidates[tier]
        chosen: list[TreeNode] = []
        freed = 0
        redundant = (n for n in cands if n.num_local_tiers > 1
                     and (spare is None or n.num_local_tiers > 2 or not n.in_tier(spare)))
        for node in sorted(redundant, key=lambda n: (key(n, tier), n.id)):
            if freed >= num_pages:
                return chosen
            chosen.append(node)
            freed += node.num_tokens // ps
        if freed >= num_pages or not allow_sole:
            return chosen
        gone: set[TreeNode] = set()  # nodes the plan deletes (no copy left, not even in the store)
        heap = [(key(n, tier), n.id, n) for n in cands if n.num_local_tiers == 1]
        heapq.heapify(heap)
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            chosen.append(node)
            if node.num_tiers == 1:  # a store record keeps the node (and its parent's child) alive
                gone.add(node)
            freed += node.num_tokens // ps
            parent = node.parent
            if (parent is not self.root and parent.tiers() == [tier] and parent.pinned[tier] == 0
                    and all(c in gone for c in parent.children.values())):
                heapq.heappush(heap, (key(parent, tier), parent.id, parent))
        return chosen

    def _hbm_victims(self) -> VictimHeap:
        """The kept heap of HBM candidates, with the nodes whose key went down since re-keyed
        (built anew for a new policy, or when the policy lost count of them)."""
        heap = self._hbm_heap
        if heap is None or heap.key != self.policy.priority:
            heap = self._hbm_heap = VictimHeap(Tier.HBM, self._candidates[Tier.HBM], self.policy.priority)
            self.policy.take_lowered()  # the new heap has every current key
            return heap
        lowered = self.policy.take_lowered()
        if lowered is None:
            heap.rebuild()
        else:
            heap.rekey(lowered)
        return heap

    # ------------------------------------------------------------ candidates
    def _refresh_around(self, node: TreeNode) -> None:
        self._refresh(node)
        self._refresh(node.parent)

    def _refresh(self, node: Optional[TreeNode]) -> None:
        """Recompute in which tiers ``node`` is an eviction candidate."""
        if node is None or node is self.root or not node.alive:
            return
        sole = node.sole_tier()
        for tier in Tier:
            if self._is_candidate(node, tier):
                if tier == Tier.HBM and self._hbm_heap is not None and node not in self._candidates[tier]:
                    self._hbm_heap.joined(node)
                self._candidates[tier].add(node)
            else:
                self._candidates[tier].discard(node)
            if tier == sole:
                self._sole[tier].add(node)
            else:
                self._sole[tier].discard(node)

    def _is_candidate(self, node: TreeNode, tier: Tier) -> bool:
        if not node.in_tier(tier) or node.pinned[tier] > 0 or tier == Tier.STORE:
            return False  # the store evicts on its own; a store copy is only forgotten
        if tier == Tier.HBM:
            # The evictor backs a last HBM copy up to DRAM first (or drops the subtree below).
            return node.lock_ref == 0 and not any(c.hbm_slots is not None for c in node.children.values())
        if tier == Tier.NVME and any(c.in_tier(Tier.NVME) for c in node.children.values()):
            # NVMe stays closed under ancestors (``NvmeLink.persist_prefixes`` puts them there): a page
            # whose parent is not on NVMe cannot be re-indexed after a restart (an orphan).
            return False
        # Dropping the last copy of a node with children would orphan them.
        return node.num_tiers > 1 or not node.children

    def refresh(self, node: TreeNode) -> None:
        """Re-evaluate ``node`` after a pin change (used by :mod:`hiradix.core.ledger`)."""
        self._refresh(node)

    # ---------------------------------------------------------------- paths
    def path(self, node: TreeNode) -> list[TreeNode]:
        """Nodes from the root's child down to ``node``."""
        out = []
        while node is not self.root:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def path_hbm_slots(self, node: TreeNode) -> list[Any]:
        """HBM slot arrays along the path to ``node`` (concatenate for the prefix's slots).

        Raises:
            ValueError: a node on the path is not in HBM.
        """
        out = []
        for n in self.path(node):
            if n.hbm_slots is None:
                raise ValueError(f"{n} on the path is not in HBM")
            out.append(n.hbm_slots)
        return out

    # ---------------------------------------------------------------- keys
    def _child_key(self, parent: TreeNode, tokens, pos: int, namespace) -> tuple:
        page = tuple(tokens[pos : pos + self.page_size])
        if parent is self.root and namespace is not None:
            return (namespace, page)
        return page

    def _key_in_parent(self, node: TreeNode) -> tuple:
        return self._child_key(node.parent, node.tokens, 0, node.namespace)

    def _common_len(self, edge: array, tokens, pos: int, limit: int) -> int:
        """Tokens (whole pages) shared by ``edge`` and ``tokens[pos:limit]``."""
        n = min(len(edge), limit - pos)
        other = array("q", tokens[pos : pos + n])
        if edge[:n] == other:
            return n
        ps = self.page_size
        lo, hi = 0, n // ps  # in pages: [0, lo) known equal; page hi-1 or earlier differs
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if edge[lo * ps : mid * ps] == other[lo * ps : mid * ps]:
                lo = mid
            else:
                hi = mid
        if lo < n // ps and edge[lo * ps : (lo + 1) * ps] == other[lo * ps : (lo + 1) * ps]:
            lo += 1
        return lo * ps

    # ------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Verify the structural and HBM invariants in the module docstring.

        DRAM/NVMe page ownership against their allocators is checked by
        :meth:`hiradix.core.ledger.TierBooks.check_integrity`.

        Raises:
            IntegrityError: naming the first broken invariant.
        """
        from hiradix.core.tree_integrity import check_tree

        check_tree(self)

    def is_candidate(self, node: TreeNode, tier: Tier) -> bool:
        """Whether ``node``'s copy in ``tier`` may be evicted now (the rule behind :meth:`candidates`)."""
        return self._is_candidate(node, tier)

    def key_in_parent(self, node: TreeNode) -> tuple:
        """The key ``node`` is indexed by in its parent's children."""
        return self._key_in_parent(node)
