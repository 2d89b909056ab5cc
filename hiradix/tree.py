"""The tiered radix tree: prefix match, insert, split, lock references, per-tier eviction.

Pure bookkeeping: no I/O, no CUDA, no threads. Data movement (pools, the I/O worker, copies)
lives elsewhere; only slot/page ids and operation ids cross the boundary. The prefix-cache
contract it serves is SGLang 0.5.23's ``BasePrefixCache``
(``sglang/srt/mem_cache/base_prefix_cache.py``); the adapter that speaks that contract is
:mod:`hiradix.cache`. Two-phase transfers between tiers are in :mod:`hiradix.transfers`.

Every node records which tiers hold its KV (CachedAttention, USENIX ATC '24, §3):

* ``hbm_slots``  -- token slot ids in SGLang's device KV pool, shape ``(num_tokens,)``;
* ``dram_pages`` -- DRAM page ids, one per page;
* ``nvme_slots`` -- NVMe slot ids, one per page.

Invariants (checked by :meth:`TieredRadixTree.check_integrity`):

* keys are page-aligned; a child is indexed by its first page;
* HBM residency is prefix-closed: a node in HBM has its parent in HBM (or is a root child);
* every non-root node is held by at least one tier (a node no tier holds is deleted);
* a node's ``lock_ref`` is at least the sum of its children's (locks propagate to the root);
* locked nodes are in HBM; HBM evictable + protected == HBM tokens the tree holds;
* per DRAM/NVMe tier: free + held by nodes + reserved by in-flight transfers == capacity,
  and no slot or page has two owners.
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

    Every field is mutated only by :class:`TieredRadixTree` and :mod:`hiradix.transfers`.
    """

    id: int  # from the tree's own counter; stable for the node's lifetime
    parent: Optional[TreeNode]  # None for the root and for deleted nodes
    tokens: array  # token ids of this edge, array('q'); len is a multiple of page_size
    namespace: Optional[tuple]  # (extra_key, cache_salt) or None; same along a path
    children: dict = field(default_factory=dict)  # first-page key -> TreeNode
    hbm_slots: Optional[Any] = None  # Shape (num_tokens,) int64 device slot ids, or None
    dram_pages: Optional[list[int]] = None  # one DRAM page id per page, or None
    nvme_slots: Optional[list[int]] = None  # one NVMe slot id per page, or None
    lock_ref: int = 0  # running requests whose prefix passes through here (HBM pin)
    ops: set = field(default_factory=set)  # ids of in-flight transfers touching this node
    pinned: list = field(default_factory=lambda: [0, 0, 0])  # per tier: in-flight transfers using that copy
    last_access_s: float = 0.0  # monotonic seconds of the last match/insert touching it
    hit_count: int = 0  # times a request other than the inserter reused it
    nvme_loaded: bool = False  # DRAM copy came from NVMe and has not been promoted yet
    # hiradix.persistence: hash of the prefix through this node's last page, cached; a split
    # leaves it on the lower node (same last page) and not on the new upper one.
    chain_hash: Optional[bytes] = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def alive(self) -> bool:
        return self.parent is not None

    def ids_in(self, tier: Tier) -> Optional[list]:
        """Per-page ids of this node's copy in ``tier`` (HBM: first slot of each page)."""
        if tier == Tier.HBM:
            return None if self.hbm_slots is None else self.hbm_slots
        return self.dram_pages if tier == Tier.DRAM else self.nvme_slots

    def in_tier(self, tier: Tier) -> bool:
        return self.ids_in(tier) is not None

    def tiers(self) -> list[Tier]:
        out = []
        if self.hbm_slots is not None:
            out.append(Tier.HBM)
        if self.dram_pages is not None:
            out.append(Tier.DRAM)
        if self.nvme_slots is not None:
            out.append(Tier.NVME)
        return out

    @property
    def num_tiers(self) -> int:
        """How many tiers hold this node's KV (0 only for the root)."""
        return (self.hbm_slots is not None) + (self.dram_pages is not None) + (self.nvme_slots is not None)

    def __repr__(self) -> str:
        tiers = "".join(t.name[0] for t in self.tiers())
        return f"TreeNode(id={self.id}, tokens={self.num_tokens}, tiers={tiers}, lock={self.lock_ref}, pinned={self.pinned})"


@dataclass(frozen=True, slots=True)
class TreeMatch:
    """Result of :meth:`TieredRadixTree.match`, in tokens.

    ``hbm_len`` tokens are in HBM along the path to ``hbm_node``; the following ``dram_len``
    tokens are in DRAM (loadable to HBM) up to ``dram_node``; then ``nvme_len`` tokens only on
    NVMe (to be read into DRAM first) up to ``nvme_node``. ``nodes`` is the matched path.
    """

    hbm_len: int
    hbm_node: TreeNode
    dram_len: int
    dram_node: TreeNode
    nvme_len: int
    nvme_node: TreeNode
    nodes: tuple[TreeNode, ...]
    last_node: TreeNode  # deepest matched node (may extend past the match in a peek)

    def stage(self, tier: Tier) -> list[TreeNode]:
        """Matched nodes served from ``tier``: HBM first, then DRAM, then NVMe."""
        start = {Tier.HBM: 0, Tier.DRAM: self.hbm_len, Tier.NVME: self.hbm_len + self.dram_len}[tier]
        end = start + (self.hbm_len, self.dram_len, self.nvme_len)[tier]
        out, pos = [], 0
        for node in self.nodes:
            if start <= pos < end:
                out.append(node)
            pos += node.num_tokens
        return out


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
        self.on_split: Optional[Callable[[TreeNode, TreeNode], None]] = None  # (lower, new upper)
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
        self.tier_tokens = [0, 0, 0]  # tokens held per tier
        self._candidates: list[set[TreeNode]] = [set(), set(), set()]  # eviction candidates per tier
        self._sole: list[set[TreeNode]] = [set(), set(), set()]  # nodes held by that tier only

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
        """Nodes whose KV only ``tier`` holds (read-only view)."""
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
        lens = [0, 0, 0]
        ends = [self.root, self.root, self.root]
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
        ends[Tier.DRAM] = ends[Tier.DRAM] if lens[Tier.DRAM] else ends[Tier.HBM]
        ends[Tier.NVME] = ends[Tier.NVME] if lens[Tier.NVME] else ends[Tier.DRAM]
        last = nodes[-1] if nodes else self.root
        return TreeMatch(lens[0], ends[0], lens[1], ends[1], lens[2], ends[2], tuple(nodes), last)

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
        else:
            node.nvme_slots = list(ids)
        self.tier_tokens[tier] += node.num_tokens
        self._refresh_around(node)

    def detach(self, node: TreeNode, tier: Tier) -> Any:
        """Forget ``node``'s copy in ``tier``; returns its ids for the caller to free.

        A node left with no tier is deleted (it must have no children).
        """
        ids = node.ids_in(tier)
        assert ids is not None, (node, tier)
        if tier == Tier.HBM:
            assert node.lock_ref == 0, node
            node.hbm_slots = None
            self.hbm_evictable_tokens -= node.num_tokens
        elif tier == Tier.DRAM:
            node.dram_pages = None
            node.nvme_loaded = False
        else:
            node.nvme_slots = None
        self.tier_tokens[tier] -= node.num_tokens
        if not node.tiers():
            self._delete(node)
        else:
            self._refresh_around(node)
        return ids

    def restore(self, parent: TreeNode, tokens: Sequence[int], namespace: Optional[tuple], nvme_slots: Sequence[int]) -> TreeNode:
        """Add a child of ``parent`` held only on NVMe (re-indexing persisted pages at start).

        Args:
            parent: the root or a node already in the tree.
            tokens: the child's token ids, whole pages.
            namespace: see :meth:`match`.
            nvme_slots: one NVMe slot per page.

        Raises:
            ValueError: ``tokens`` is not whole pages, the slot count differs, or ``parent``
                already has a child starting with this page.
        """
        if not tokens or len(tokens) % self.page_size or len(nvme_slots) != len(tokens) // self.page_size:
            raise ValueError(f"{len(tokens)} tokens / {len(nvme_slots)} slots is not whole pages of {self.page_size}")
        key = self._child_key(parent, tokens, 0, namespace)
        if key in parent.children:
            raise ValueError(f"{parent} already has a child for page {key}")
        node = TreeNode(next(self._ids), parent, array("q", tokens), namespace)
        node.last_access_s = self.clock()
        parent.children[key] = node
        self.attach(node, Tier.NVME, list(nvme_slots))
        return node

    def _delete(self, node: TreeNode) -> None:
        assert not node.children and not node.tiers(), node
        parent = node.parent
        del parent.children[self._key_in_parent(node)]
        for cands in (*self._candidates, *self._sole):
            cands.discard(node)
        node.parent = None
        self._refresh(parent)

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
            nvme_loaded=node.nvme_loaded,
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
        if self.on_split is not None:
            self.on_split(node, upper)
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
    def victims(self, tier: Tier, redundant_only: bool = False) -> Iterator[TreeNode]:
        """Eviction candidates of ``tier`` in policy order, re-checked lazily.

        The caller detaches (or demotes) each yielded node before asking for the next;
        a parent that becomes a candidate meanwhile is yielded in its turn.
        ``redundant_only`` yields only nodes that another tier also holds.
        """
        key = self.policy.priority
        cands = self._candidates[tier]
        heap = [(key(n, tier), n.id, n) for n in cands if not redundant_only or n.num_tiers > 1]
        heapq.heapify(heap)
        while heap:
            _, _, node = heapq.heappop(heap)
            if node not in cands or (redundant_only and node.num_tiers < 2):
                continue
            parent = node.parent
            yield node
            if parent is not None and parent in cands and (not redundant_only or parent.num_tiers > 1):
                heapq.heappush(heap, (key(parent, tier), parent.id, parent))

    def evict_hbm(self, num_tokens: int) -> list[Any]:
        """Drop HBM copies of at least ``num_tokens`` tokens if that many are evictable.

        Victims whose KV is also on a lower tier keep their node; others are deleted.
        Locked or pinned nodes are never chosen. For demotion on eviction (write-back),
        drive :meth:`victims` from the caller instead.

        Returns:
            The freed HBM slot arrays; the caller returns them to the device allocator.
        """
        freed, evicted = [], 0
        for node in self.victims(Tier.HBM):
            if evicted >= num_tokens:
                break
            if node.children and node.num_tiers == 1:
                continue  # its children live on lower tiers; see TierController.evict_hbm
            evicted += node.num_tokens
            freed.append(self.detach(node, Tier.HBM))
        return freed

    # ------------------------------------------------------------ candidates
    def _refresh_around(self, node: TreeNode) -> None:
        self._refresh(node)
        self._refresh(node.parent)

    def _refresh(self, node: Optional[TreeNode]) -> None:
        """Recompute in which tiers ``node`` is an eviction candidate."""
        if node is None or node is self.root or not node.alive:
            return
        tiers = node.tiers()
        for tier in Tier:
            if self._is_candidate(node, tier):
                self._candidates[tier].add(node)
            else:
                self._candidates[tier].discard(node)
            if tiers == [tier]:
                self._sole[tier].add(node)
            else:
                self._sole[tier].discard(node)

    def _is_candidate(self, node: TreeNode, tier: Tier) -> bool:
        if not node.in_tier(tier) or node.pinned[tier] > 0:
            return False
        if tier == Tier.HBM:
            # The evictor backs a last HBM copy up to DRAM first (or drops the subtree below).
            return node.lock_ref == 0 and not any(c.hbm_slots is not None for c in node.children.values())
        # Dropping the last copy of a node with children would orphan them.
        return node.num_tiers > 1 or not node.children

    def refresh(self, node: TreeNode) -> None:
        """Re-evaluate ``node`` after a pin change (used by :mod:`hiradix.transfers`)."""
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
        :meth:`hiradix.transfers.TierBooks.check_integrity`.

        Raises:
            IntegrityError: naming the first broken invariant.
        """
        evictable = protected = 0
        tier_tokens = [0, 0, 0]
        seen_slots: set[int] = set()
        cands: list[set] = [set(), set(), set()]
        sole: list[set] = [set(), set(), set()]
        for node in self.iter_nodes():
            self._check_node(node, seen_slots)
            tiers = node.tiers()
            if len(tiers) == 1:
                sole[tiers[0]].add(node)
            for tier in tiers:
                tier_tokens[tier] += node.num_tokens
                if self._is_candidate(node, tier):
                    cands[tier].add(node)
            if node.hbm_slots is not None:
                if node.lock_ref > 0:
                    protected += node.num_tokens
                else:
                    evictable += node.num_tokens
        _require(evictable == self.hbm_evictable_tokens, f"HBM evictable {self.hbm_evictable_tokens} != recount {evictable}")
        _require(protected == self.hbm_protected_tokens, f"HBM protected {self.hbm_protected_tokens} != recount {protected}")
        _require(tier_tokens == self.tier_tokens, f"tier tokens {self.tier_tokens} != recount {tier_tokens}")
        for tier in Tier:
            extra, missing = self._candidates[tier] - cands[tier], cands[tier] - self._candidates[tier]
            _require(not extra and not missing, f"{tier.name} candidates differ: extra={extra} missing={missing}")
            _require(sole[tier] == self._sole[tier], f"{tier.name} sole-copy set differs")

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
            slots = node.hbm_slots.tolist() if hasattr(node.hbm_slots, "tolist") else list(node.hbm_slots)
            before = len(seen_slots)
            seen_slots.update(slots)
            _require(len(seen_slots) - before == len(slots), f"{node} shares an HBM slot with another node")
        for pages in (node.dram_pages, node.nvme_slots):
            if pages is not None:
                _require(len(pages) == node.num_tokens // ps, f"{node} has {len(pages)} pages for {node.num_tokens} tokens")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise IntegrityError(message)
