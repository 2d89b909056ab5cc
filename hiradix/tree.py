"""The tiered radix tree: prefix match, insert, split, lock references, eviction, accounting.

Pure bookkeeping: no I/O, no CUDA, no threads. Data movement (pools, the I/O worker, copies)
lives elsewhere; only slot/page ids cross the boundary. The prefix-cache contract it serves
is SGLang 0.5.23's ``BasePrefixCache`` (``sglang/srt/mem_cache/base_prefix_cache.py``); the
adapter that speaks that contract is :mod:`hiradix.cache`.

Every node records which tiers hold its KV (CachedAttention, USENIX ATC '24, §3):

* ``hbm_slots``  -- token slot ids in SGLang's device KV pool, shape ``(num_tokens,)``;
* ``dram_pages`` -- DRAM page ids, one per page;
* ``nvme_slots`` -- NVMe slot ids, one per page.

Invariants (checked by :meth:`TieredRadixTree.check_integrity`):

* keys are page-aligned; a child is indexed by its first page;
* HBM residency is prefix-closed: a node in HBM has its parent in HBM (or is a root child);
* every non-root node is held by at least one tier (a node no tier holds is deleted);
* a node's ``lock_ref`` is at least the sum of its children's (locks propagate to the root);
* locked nodes are in HBM; per tier, evictable + protected == tokens the tree holds there;
* no slot or page is owned by two nodes.
"""

from __future__ import annotations

import heapq
import itertools
import time
from array import array
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Callable, Iterator, Optional, Sequence

from hiradix.policy import EvictionPolicy, LRUPolicy


class Tier(IntEnum):
    """Storage tiers, fastest first."""

    HBM = 0
    DRAM = 1
    NVME = 2


class IntegrityError(AssertionError):
    """Raised by :meth:`TieredRadixTree.check_integrity` when an invariant is broken."""


@dataclass(slots=True, eq=False)
class TreeNode:
    """One edge of the radix tree with the KV records of its tokens.

    Every field is mutated only by :class:`TieredRadixTree`.
    """

    id: int  # from the tree's own counter; stable for the node's lifetime
    parent: Optional[TreeNode]  # None only for the root
    tokens: array  # token ids of this edge, array('q'); len is a multiple of page_size
    namespace: Optional[tuple]  # (extra_key, cache_salt) or None; same along a path
    children: dict = field(default_factory=dict)  # first-page key -> TreeNode
    hbm_slots: Optional[Any] = None  # Shape (num_tokens,) int64 device slot ids, or None
    dram_pages: Optional[list[int]] = None  # one DRAM page id per page, or None
    nvme_slots: Optional[list[int]] = None  # one NVMe slot id per page, or None
    lock_ref: int = 0  # running requests whose prefix passes through here (HBM pin)
    last_access_s: float = 0.0  # monotonic seconds of the last match/insert touching it
    hit_count: int = 0  # times a request other than the inserter reused it

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def in_tier(self, tier: Tier) -> bool:
        if tier == Tier.HBM:
            return self.hbm_slots is not None
        if tier == Tier.DRAM:
            return self.dram_pages is not None
        return self.nvme_slots is not None

    def tiers(self) -> list[Tier]:
        return [t for t in Tier if self.in_tier(t)]

    def __repr__(self) -> str:
        tiers = "".join(t.name[0] for t in self.tiers())
        return f"TreeNode(id={self.id}, tokens={self.num_tokens}, tiers={tiers}, lock={self.lock_ref})"


@dataclass(frozen=True, slots=True)
class TreeMatch:
    """Result of :meth:`TieredRadixTree.match`, in tokens.

    ``hbm_len`` tokens are in HBM along the path to ``hbm_node``; the following ``dram_len``
    tokens are in DRAM (loadable to HBM); then ``nvme_len`` tokens only on NVMe (readable into
    DRAM first). ``last_node`` is the deepest matched node; ``nodes`` the matched path.
    """

    hbm_len: int
    hbm_node: TreeNode
    dram_len: int
    nvme_len: int
    last_node: TreeNode
    nodes: tuple[TreeNode, ...]


class TieredRadixTree:
    """A page-granular radix tree whose nodes carry per-tier KV records.

    Args:
        page_size: tokens per page (>= 1); keys are truncated to whole pages.
        policy: ranks eviction candidates (see :mod:`hiradix.policy`); default LRU.
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
        self._hbm_leaves: set[TreeNode] = set()  # candidates for HBM eviction

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
        now = self.clock() if touch else 0.0
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
            for n_ in nodes:
                n_.last_access_s = now
        return self._summarize(nodes, pos)

    def _summarize(self, nodes: list[TreeNode], matched: int) -> TreeMatch:
        hbm_len = dram_len = nvme_len = 0
        hbm_node = self.root
        tokens_seen = 0
        stage = Tier.HBM
        for node in nodes:
            n = min(node.num_tokens, matched - tokens_seen)
            tokens_seen += n
            if stage == Tier.HBM and node.hbm_slots is not None:
                hbm_len += n
                hbm_node = node
                continue
            if stage <= Tier.DRAM and node.dram_pages is not None:
                stage = Tier.DRAM
                dram_len += n
                continue
            if node.nvme_slots is not None:
                stage = Tier.NVME
                nvme_len += n
                continue
            break
        last = nodes[-1] if nodes else self.root
        return TreeMatch(hbm_len, hbm_node, dram_len, nvme_len, last, tuple(nodes))

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
    ) -> tuple[int, TreeNode]:
        """Insert ``tokens`` with their HBM slots; the tree takes ownership of new slots.

        Args:
            tokens: token ids; truncated to whole pages.
            hbm_slots: device slot ids, shape ``(>= len(tokens),)`` (tensor or list).
            namespace: see :meth:`match`.
            inserted_len: tokens of this key the same request inserted before (they are not
                counted as hits again).

        Returns:
            ``(dup_len, last_node)``: the first ``dup_len`` tokens were already in HBM, so the
            caller still owns ``hbm_slots[:dup_len]`` and must free those slots (unless they
            are the tree's own); the rest now belong to the tree. ``last_node`` ends the path.
        """
        limit = len(tokens) - len(tokens) % self.page_size
        now = self.clock()
        node, pos, dup_len = self.root, 0, 0
        while pos < limit:
            key = self._child_key(node, tokens, pos, namespace)
            child = node.children.get(key)
            if child is None:
                node = self._add_leaf(node, key, tokens, pos, limit, hbm_slots, namespace, now)
                pos = limit
                break
            n = self._common_len(child.tokens, tokens, pos, limit)
            if n < child.num_tokens:
                child = self._split(child, n)
            child.last_access_s = now
            if pos + n > inserted_len:
                child.hit_count += 1
            if child.hbm_slots is None:
                self._adopt_hbm(child, hbm_slots[pos : pos + n])
            elif pos == dup_len:
                dup_len += n
            pos += n
            node = child
        return dup_len, node

    def _add_leaf(self, parent, key, tokens, pos, limit, hbm_slots, namespace, now) -> TreeNode:
        leaf = TreeNode(
            id=next(self._ids),
            parent=parent,
            tokens=array("q", tokens[pos:limit]),
            namespace=namespace,
            last_access_s=now,
        )
        parent.children[key] = leaf
        self._adopt_hbm(leaf, hbm_slots[pos:limit])
        self._refresh(parent)
        return leaf

    def _adopt_hbm(self, node: TreeNode, slots: Any) -> None:
        assert node.hbm_slots is None and len(slots) == node.num_tokens
        node.hbm_slots = slots
        if node.lock_ref > 0:
            self.hbm_protected_tokens += node.num_tokens
        else:
            self.hbm_evictable_tokens += node.num_tokens
        self._refresh(node)
        self._refresh(node.parent)

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
            last_access_s=node.last_access_s,
            hit_count=node.hit_count,
        )
        if node.hbm_slots is not None:
            upper.hbm_slots, node.hbm_slots = node.hbm_slots[:n], node.hbm_slots[n:]
        if node.dram_pages is not None:
            upper.dram_pages, node.dram_pages = node.dram_pages[:p], node.dram_pages[p:]
        if node.nvme_slots is not None:
            upper.nvme_slots, node.nvme_slots = node.nvme_slots[:p], node.nvme_slots[p:]
        parent_key = self._key_in_parent(node)
        node.tokens = node.tokens[n:]
        node.parent = upper
        upper.children[self._child_key(upper, node.tokens, 0, node.namespace)] = node
        upper.parent.children[parent_key] = upper
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
    def evict_hbm(self, num_tokens: int) -> list[Any]:
        """Free at least ``num_tokens`` HBM tokens if that many are evictable, in policy order.

        A victim whose KV is also on a lower tier keeps its node (only the HBM copy goes);
        otherwise the node is deleted. Locked nodes are never chosen.

        Returns:
            The freed HBM slot arrays; the caller returns them to the device allocator.
        """
        heap = [(self.policy.priority(n, Tier.HBM), n.id, n) for n in self._hbm_leaves]
        heapq.heapify(heap)
        freed: list[Any] = []
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node not in self._hbm_leaves:
                continue
            parent = node.parent
            freed.append(node.hbm_slots)
            evicted += node.num_tokens
            self._drop_hbm(node)
            if parent is not self.root and parent in self._hbm_leaves:
                heapq.heappush(heap, (self.policy.priority(parent, Tier.HBM), parent.id, parent))
        return freed

    def _drop_hbm(self, node: TreeNode) -> None:
        assert node.lock_ref == 0
        node.hbm_slots = None
        self.hbm_evictable_tokens -= node.num_tokens
        if not node.tiers():
            self._delete(node)
        else:
            self._refresh(node)
            self._refresh(node.parent)

    def _delete(self, node: TreeNode) -> None:
        assert not node.children and not node.tiers(), node
        parent = node.parent
        del parent.children[self._key_in_parent(node)]
        self._hbm_leaves.discard(node)
        node.parent = None
        self._refresh(parent)

    # ------------------------------------------------------------ candidates
    def _refresh(self, node: Optional[TreeNode]) -> None:
        """Recompute whether ``node`` is an HBM eviction candidate."""
        if node is None or node is self.root:
            return
        if self._is_hbm_candidate(node):
            self._hbm_leaves.add(node)
        else:
            self._hbm_leaves.discard(node)

    def _is_hbm_candidate(self, node: TreeNode) -> bool:
        if node.hbm_slots is None or node.lock_ref > 0 or node.parent is None:
            return False
        if any(c.hbm_slots is not None for c in node.children.values()):
            return False
        # Dropping the last copy of a node with children would orphan them.
        return bool(node.dram_pages is not None or node.nvme_slots is not None or not node.children)

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
        if edge[:n] == array("q", tokens[pos : pos + n]):
            return n
        ps = self.page_size
        lo, hi = 0, n // ps  # pages: lo known equal, hi known to differ or end
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if edge[lo * ps : mid * ps] == array("q", tokens[pos + lo * ps : pos + mid * ps]):
                lo = mid
            else:
                hi = mid
        if lo < n // ps and edge[lo * ps : (lo + 1) * ps] == array("q", tokens[pos + lo * ps : pos + (lo + 1) * ps]):
            lo += 1
        return lo * ps

    # ------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Verify every invariant listed in the module docstring.

        Raises:
            IntegrityError: naming the first broken invariant.
        """
        evictable = protected = 0
        seen_slots: set[int] = set()
        leaves: set[TreeNode] = set()
        for node in self.iter_nodes():
            self._check_node(node, seen_slots)
            if node.hbm_slots is not None:
                if node.lock_ref > 0:
                    protected += node.num_tokens
                else:
                    evictable += node.num_tokens
            if self._is_hbm_candidate(node):
                leaves.add(node)
        _require(evictable == self.hbm_evictable_tokens, f"HBM evictable {self.hbm_evictable_tokens} != recount {evictable}")
        _require(protected == self.hbm_protected_tokens, f"HBM protected {self.hbm_protected_tokens} != recount {protected}")
        _require(leaves == self._hbm_leaves, f"HBM candidate set differs: extra={self._hbm_leaves - leaves} missing={leaves - self._hbm_leaves}")

    def _check_node(self, node: TreeNode, seen_slots: set[int]) -> None:
        ps, parent = self.page_size, node.parent
        _require(parent is not None and parent.children.get(self._key_in_parent(node)) is node, f"{node} not indexed by its parent")
        _require(node.num_tokens > 0 and node.num_tokens % ps == 0, f"{node} key not page-aligned")
        _require(bool(node.tiers()), f"{node} is held by no tier")
        _require(node.namespace == parent.namespace or parent is self.root, f"{node} namespace differs from parent")
        child_locks = sum(c.lock_ref for c in node.children.values())
        _require(node.lock_ref >= child_locks, f"{node} lock_ref {node.lock_ref} < children's {child_locks}")
        if node.lock_ref > 0:
            _require(node.hbm_slots is not None, f"{node} locked but not in HBM")
        if node.hbm_slots is not None:
            _require(parent is self.root or parent.hbm_slots is not None, f"{node} in HBM but parent {parent} is not")
            _require(len(node.hbm_slots) == node.num_tokens, f"{node} has {len(node.hbm_slots)} HBM slots")
            slots = [int(s) for s in node.hbm_slots]
            before = len(seen_slots)
            seen_slots.update(slots)
            _require(len(seen_slots) - before == len(slots), f"{node} shares an HBM slot with another node")
        for pages in (node.dram_pages, node.nvme_slots):
            if pages is not None:
                _require(len(pages) == node.num_tokens // ps, f"{node} has {len(pages)} pages for {node.num_tokens} tokens")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise IntegrityError(message)
