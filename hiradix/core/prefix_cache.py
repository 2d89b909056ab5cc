"""The prefix cache over the tiered tree: the one copy of its logic, for the server and the simulator.

:class:`TieredPrefixCache` is what SGLang's ``BasePrefixCache`` contract
(``sglang/srt/mem_cache/base_prefix_cache.py``) asks of a radix cache, in the core's own terms:
token ids, a namespace, device slot arrays from a :class:`~hiradix.core.ports.DevicePool`.
The server's seam (:class:`hiradix.sglang_plugin.cache.TieredRadixCache`) translates SGLang's
``RadixKey``/``Req``/``MatchResult`` into these calls; the trace simulator (``bench/sim/simulate.py``)
makes the same calls over data-less ports, so it proves what the server does.

Lengths are in tokens, whole pages (keys are truncated to whole pages by the tree). Slot arrays
returned are valid while the node they belong to is locked (or, for freshly allocated ones,
until handed to :meth:`checkpoint`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from hiradix.core.controller import TierController
from hiradix.core.lookahead import QueuedKey, QueueView, peek, plan
from hiradix.core.node import IntegrityError, Tier, TreeMatch, TreeNode
from hiradix.core.keys import prefix_hash
from hiradix.core.ledger import Kind
from hiradix.core.partial_pages import PartialPage, PartialPages, shared_len
from hiradix.core.placement import Placement
from hiradix.core.ports import DevicePool, Slots
from hiradix.core.tree import TieredRadixTree

Key = Sequence[int]  # token ids
MAX_CHILDREN_SCANNED = 64  # children of a node a copy-on-write match looks at (a root may have thousands)
Namespace = Optional[tuple]  # (extra_key, cache_salt) or None


@dataclass(frozen=True)
class LoadBack:
    """What :meth:`TieredPrefixCache.load_back` promoted, in tokens.

    Attributes:
        loaded: tokens now in HBM (0: nothing, the request recomputes them).
        read_from: tokens whose DRAM copy had been read from ``Tier.NVME`` / ``Tier.STORE``
            (early by the look-ahead window or while the request waited).
        waited_from: those of them the request waited for at admission.
        node: the new last node of the request's prefix.
    """

    loaded: int
    read_from: dict
    waited_from: dict
    node: TreeNode

    @property
    def waited(self) -> int:
        """Tokens the request waited for while they were read from NVMe or the store."""
        return sum(self.waited_from.values())


class TieredPrefixCache:
    """Match, load back, insert, evict and look ahead over one tree and its lower tiers.

    Args:
        tree: the tree (its policy decides eviction order).
        device: the HBM slot pool (SGLang's device allocator, or a stand-in).
        tiers: the DRAM/NVMe controller, or None (HBM only: stock RadixAttention's behaviour).
        lookahead_window: ``W``, waiting requests inspected per step (policies that use the queue).
        load_timeout_s: how long a request waits at admission for its NVMe reads, in seconds.
        check_every_step: prove the invariants after every step and eviction (slow; tests).
        on_evict: called with ``(tokens evicted, time.perf_counter() at its start)`` after each
            HBM eviction (SGLang's ``update_eviction_metrics`` takes these).
        partial_pages: keep finished requests' partly filled last pages in HBM for the next
            request of the prefix (:mod:`hiradix.core.partial_pages`); needs pages of > 1 token.
        copy_rows: ``copy_rows(src_slots, dst_slots)`` copies device KV rows (every layer); with
            it, a request whose next tokens begin a page the tree holds in HBM gets those rows
            copied into a fresh page of its own (copy-on-write).
    """

    def __init__(
        self,
        tree: TieredRadixTree,
        device: DevicePool,
        tiers: Optional[TierController],
        lookahead_window: int = 64,
        load_timeout_s: float = 2.0,
        check_every_step: bool = False,
        on_evict: Optional[Callable[[int, float], None]] = None,
        partial_pages: bool = False,
        copy_rows: Optional[Callable[[Slots, Slots], None]] = None,
    ):
        self.tree = tree
        self.device = device
        self.tiers = tiers
        self.placement = tiers.placement if tiers is not None else Placement(tree, None)
        self.lookahead_window = lookahead_window
        self.load_timeout_s = load_timeout_s
        self.check_every_step = check_every_step
        self.on_evict = on_evict
        self.partial = PartialPages(tree.page_size) if partial_pages and tree.page_size > 1 else None
        self.copy_rows = copy_rows
        self.last_view: Optional[QueueView] = None
        # Admission skipped a request for its reads since the last step: a scheduler with nothing
        # to run may then block on the I/O results (wait_for_reads) instead of spinning.
        self.held_for_reads = False

    # ------------------------------------------------------------ match
    def match(self, tokens: Key, namespace: Namespace = None) -> TreeMatch:
        """Longest cached prefix across tiers; splits and touches (modifies the tree).

        Tokens only on NVMe or in the cluster store start a read into DRAM, and the pages after
        the local match are looked up in the store; the request waits for both at admission
        (:meth:`should_wait`) up to ``load_timeout_s``.
        """
        m = self.tree.match(tokens, namespace)
        if self.tiers is not None:
            if m.hbm_len and self.tiers.plan.write_selective:
                self.tiers.after_hit(m.stage(Tier.HBM))
            self._start_reads(m, tokens, namespace, ahead=False)
        return m

    def _start_reads(self, m: TreeMatch, tokens: Key, namespace: Namespace, ahead: bool) -> None:
        # The room a read makes must not be the request's own DRAM pages (before or after the read).
        dram = [n for n in m.nodes if n.in_tier(Tier.DRAM)] if m.nvme_len or m.store_len else []
        self.tiers.books.hold(dram, Tier.DRAM)
        try:
            if m.nvme_len:
                self.tiers.prefetch(m.stage(Tier.NVME), self.load_timeout_s, ahead=ahead)
            self._start_store_reads(m, tokens, namespace, ahead)
        finally:
            self.tiers.books.release(dram, Tier.DRAM)

    def _start_store_reads(self, m: TreeMatch, tokens: Key, namespace: Namespace, ahead: bool) -> None:
        if m.store_len and self.tiers.store_read_worth(m.store_len):  # else: recomputed (load or recompute)
            self.tiers.prefetch(m.stage(Tier.STORE), self.load_timeout_s, ahead=ahead, src=Tier.STORE)
        if m.matched_len == m.cached_len:  # the tree knows nothing more: ask the store what follows
            self.tiers.lookup(m, tokens, namespace, self.load_timeout_s, ahead=ahead)

    def should_wait(self, tokens: Key | QueuedKey, namespace: Namespace = None) -> bool:
        """Whether admission should skip this request for now, because part of its prefix is on
        NVMe or in the store and not yet in DRAM: its read is in flight, or could not start yet
        (no DRAM room; the next attempt's :meth:`match` tries again), or a store lookup of what
        follows it is in flight. Within ``load_timeout_s`` only; afterwards it runs with what is
        ready (and recomputes the rest). Pass the request's :class:`QueuedKey` (the one the
        look-ahead keeps) to reuse its last peek: O(path nodes) instead of O(tokens) per attempt."""
        tiers = self.tiers
        if tiers is None:
            return False
        lower = self.tree.tier_tokens[Tier.NVME] or self.tree.tier_tokens[Tier.STORE]
        if not (lower or tiers.books.in_flight() or (tiers.store is not None and tiers.store.lookups)):
            return False
        per_request = isinstance(tokens, QueuedKey)  # the request's own key: its whole wait is bounded
        key = tokens if per_request else QueuedKey(tokens, namespace)
        tokens, namespace = key.tokens, key.namespace
        m = peek(self.tree, key)
        wait = False
        for tier in (Tier.NVME, Tier.STORE):
            if m.length(tier) and (tier == Tier.NVME or tiers.store_read_worth(m.length(tier))):
                stage = m.stage(tier)
                wait |= tiers.waits.any_pending(stage, self.load_timeout_s) or tiers.waits.unread_pending(stage, self.load_timeout_s)
        wait |= tiers.lookup_pending(m, tokens, namespace, self.load_timeout_s)
        if wait and per_request:  # however often its reads restart (ReadWaits.request_pending)
            wait = tiers.waits.request_pending(key, self.load_timeout_s)
        tiers.stats.admission_skips += wait
        self.held_for_reads |= wait
        return wait

    def load_back(self, start: TreeNode, end: TreeNode, num_tokens: int) -> LoadBack:
        """Promote the DRAM nodes below ``start`` down to ``end`` into new HBM slots (all or none).

        Args:
            start: the last HBM node of the match (locked by the caller).
            end: the last DRAM node of the match.
            num_tokens: DRAM tokens the match reported between them.

        Returns:
            A :class:`LoadBack`; ``loaded == 0`` and ``node is start`` when the path changed
            since the match or device memory cannot be found (the request recomputes).
        """
        nothing = LoadBack(0, {Tier.NVME: 0, Tier.STORE: 0}, {Tier.NVME: 0, Tier.STORE: 0}, start)
        if self.tiers is None or num_tokens <= 0 or end is start or not end.alive:
            return nothing
        nodes = self.tree.path(end)[len(self.tree.path(start)):]
        ok = bool(nodes) and nodes[0].parent is start
        ok = ok and all(n.in_tier(Tier.DRAM) and not n.in_tier(Tier.HBM) for n in nodes)
        if not ok or sum(n.num_tokens for n in nodes) != num_tokens:
            return nothing
        self.tiers.books.hold(nodes, Tier.DRAM)  # eviction for the slots must not drop them
        try:
            slots = self.alloc_device(num_tokens)
        finally:
            self.tiers.books.release(nodes, Tier.DRAM)
        if slots is None:
            return nothing
        read_from, waited_from = self.tiers.load_back(nodes, slots)
        return LoadBack(num_tokens, read_from, waited_from, end)

    def promote_now(self, start: TreeNode, end: TreeNode, num_tokens: int) -> int:
        """:meth:`load_back`, then finish the copies now (not layer by layer with a forward).

        For a context-overflow reuse (:mod:`hiradix.sglang_plugin.overflow`) that copies the
        promoted slots at once; the DRAM copies stay as written. Returns tokens promoted.
        """
        back = self.load_back(start, end, num_tokens)
        if back.loaded:
            self.tiers.land_now()
        return back.loaded

    def start_loading(self) -> int:
        """Start the promotions queued while building a batch; returns its consumer index (-1: none)."""
        return -1 if self.tiers is None else self.tiers.start_loading()

    # ------------------------------------------------------------ memory
    def alloc_device(self, num_tokens: int) -> Optional[Slots]:
        """Device slots for ``num_tokens`` tokens, evicting in policy order when short; None if it cannot."""
        short = num_tokens - self.device.available_size()
        if short > 0:
            self.evict(short)
        return self.device.alloc(num_tokens)

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots (if evictable); returns tokens freed."""
        started_s = time.perf_counter()
        evicted = 0
        for slots in self.tiers.evict_hbm(num_tokens) if self.tiers is not None else self.placement.evict_hbm(num_tokens):
            self.device.free(slots)
            evicted += len(slots)
        if self.partial is not None and self.partial.num_pages:
            evicted += self._evict_partial(num_tokens - evicted, tree_evicted=evicted > 0)
        if self.on_evict is not None:
            self.on_evict(evicted, started_s)  # SGLang's eviction metrics take perf_counter()
        if self.check_every_step:
            self.check_integrity()
        return evicted

    def _evict_partial(self, short_tokens: int, tree_evicted: bool) -> int:
        """Free the partial pages whose prefix just left HBM, then, if still ``short_tokens``
        short (the tree had nothing more to evict), the least recently used ones; tokens freed."""
        page_size, root = self.tree.page_size, self.tree.root
        freed = self.partial.evict_orphans(lambda n: n is root or (n.alive and n.hbm_slots is not None)) if tree_evicted else []
        short_tokens -= len(freed) * page_size
        if short_tokens > 0:
            freed += self.partial.evict(-(-short_tokens // page_size))
        for slots in freed:
            self.device.free(slots)  # the whole page
        return len(freed) * page_size

    # ------------------------------------------------------------ insert / locks
    def checkpoint(self, tokens: Key, namespace: Namespace, slots: Slots, protected_len: int,
                   inserted_len: int = 0) -> tuple[int, TreeNode]:
        """Insert a request's KV: ``tokens`` with their device ``slots`` (shape ``(len(tokens),)``).

        The first ``protected_len`` tokens are the tree's own already (the request's match);
        slots of the tokens after them that the tree already held are freed (duplicates); the
        rest now belong to the tree, and write-through backups start.

        Args:
            inserted_len: tokens of this key the same request inserted before (not hits again).

        Returns:
            ``(key_len, last_node)``: tokens now in the tree for this key and the node ending
            them. The caller moves its lock to ``last_node`` and repoints its row onto
            :meth:`path_slots` of it.
        """
        dup_len, last, new_nodes = self.tree.insert(tokens, slots, namespace, inserted_len=inserted_len)
        policy = self.tree.policy
        if policy.uses_history:
            policy.observe_insert(self.tree.path(last), protected_len if inserted_len == 0 else None, self.tree.clock())
        if dup_len > protected_len:
            self.device.free(slots[protected_len:dup_len])
        if self.tiers is not None:
            self.tiers.after_insert(new_nodes)
        key_len = len(tokens) - len(tokens) % self.tree.page_size
        return key_len, last

    # ------------------------------------------------------------ partial last pages
    def _partial_key(self, node: TreeNode, namespace: Namespace) -> tuple:
        """A whole-page prefix, by content: its namespace and chain hash (cached on the nodes)."""
        return namespace, prefix_hash(self.tree.root, node, self.tree.page_size)

    def match_partial(self, node: TreeNode, namespace: Namespace, next_tokens: Key,
                      claimer: Any) -> tuple[int, Optional[PartialPage]]:
        """The partial page after the whole-page prefix ending at ``node`` (all in HBM) that shares
        the most of ``next_tokens``, claimed for ``claimer`` until the next step; ``(0, None)``
        if none. A kept page (a finished request's last page) is moved to the request; when a
        page the tree holds in HBM below ``node`` shares more (the conversation diverged inside
        a whole page), its rows are copied into a fresh page first (copy-on-write; only from
        free device pages: a match never evicts)."""
        if self.partial is None or not next_tokens:
            return 0, None
        key = self._partial_key(node, namespace)
        num, page = self.partial.match(key, next_tokens, claimer) if self.partial.num_pages else (0, None)
        if page is not None and num < len(page.tokens) and self._can_copy():
            # the request leaves the kept page inside it: copy its rows, the page stays for its own branch
            page = self._copy_page(key, node, page.slots[:num], next_tokens[:num], claimer)
        if num < len(next_tokens) and self._can_copy():
            child, shared = self._page_below(node, namespace, next_tokens)
            if shared > num:
                num, page = shared, self._copy_page(key, node, child.hbm_slots[:shared], next_tokens[:shared], claimer)
        return num, page

    def _can_copy(self) -> bool:
        """A copy-on-write is possible now: a copier, and a free device page (a match never evicts)."""
        return self.copy_rows is not None and self.device.available_size() >= self.tree.page_size

    def _copy_page(self, key: tuple, node: TreeNode, src_slots: Slots, tokens: Key, claimer: Any) -> PartialPage:
        """A fresh page holding a copy of ``src_slots``' rows (``tokens``), claimed by ``claimer``."""
        slots = self.device.alloc(self.tree.page_size)
        self.copy_rows(src_slots, slots[: len(tokens)])
        return self.partial.add_claimed(key, tokens, slots, node, claimer)

    def _loading(self, node: TreeNode) -> bool:
        """Whether ``node``'s HBM rows are still being written (a promotion from DRAM in flight:
        its slots are set at admission, its rows arrive layer by layer in the next forward)."""
        if self.tiers is None or not node.ops:
            return False
        ops = self.tiers.books.ops
        return any(ops[i].kind == Kind.PROMOTE for i in node.ops if i in ops)

    def _page_below(self, node: TreeNode, namespace: Namespace, next_tokens: Key) -> tuple[Optional[TreeNode], int]:
        """The child of ``node`` in HBM whose first page shares the most leading tokens with
        ``next_tokens`` (fewer than a page: else the match would have gone on), and how many."""
        best, best_len = None, 0
        for checked, child in enumerate(node.children.values()):
            if checked >= MAX_CHILDREN_SCANNED:
                break
            if child.hbm_slots is None or child.namespace != namespace or self._loading(child):
                continue
            n = shared_len(child.tokens, next_tokens)
            if n > best_len:
                best, best_len = child, n
        return best, best_len

    def take_partial(self, page: PartialPage, claimer: Any, num_tokens: int) -> Slots:
        """Hand a claimed partial page to its request (the slots of its first ``num_tokens`` rows)."""
        return self.partial.take(page, claimer, num_tokens)[:num_tokens]

    def keep_partial(self, node: TreeNode, namespace: Namespace, tokens: Key, slots: Slots) -> bool:
        """Keep a released request's last page after the whole-page prefix ending at ``node``:
        ``tokens`` (fewer than a page) in its first rows, ``slots`` the whole page's; False: not
        kept (the caller frees it as before)."""
        if self.partial is None:
            return False
        kept, replaced = self.partial.keep(self._partial_key(node, namespace), tokens, slots, owner=node)
        for old in replaced:
            self.device.free(old)
        return kept

    def lock(self, node: TreeNode) -> int:
        """Pin the path to ``node`` in HBM; returns the change of evictable tokens (<= 0)."""
        return self.tree.inc_lock(node)

    def unlock(self, node: TreeNode) -> int:
        """Undo one :meth:`lock`; returns the change of evictable tokens (>= 0)."""
        return self.tree.dec_lock(node)

    def path_slots(self, node: TreeNode) -> Slots:
        """Device slots on the path root..``node``, shape ``(tokens,)``; valid while it is locked."""
        return self.device.concat(self.tree.path_hbm_slots(node))

    @property
    def evictable_tokens(self) -> int:
        """Unlocked HBM tokens the tree holds, kept partial pages counted whole (SGLang's ``evictable_size``)."""
        partial = self.partial.num_pages * self.tree.page_size if self.partial is not None else 0
        return self.tree.hbm_evictable_tokens + partial

    @property
    def protected_tokens(self) -> int:
        """Locked HBM tokens the tree holds (SGLang's ``protected_size``)."""
        return self.tree.hbm_protected_tokens

    # ------------------------------------------------------------ per step
    def step(self) -> None:
        """Per scheduler step: reap copies and I/O results, store DRAM-only pages down; with a
        policy that reads ahead, start reads of the prefixes it predicts will return soon."""
        self.held_for_reads = False
        if self.partial is not None:
            self.partial.new_step()
        policy = self.tree.policy
        if policy.uses_history:
            policy.observe_step(self.tree.clock())
        if self.tiers is not None:
            self.tiers.step()
            if policy.reads_ahead:
                self.tiers.read_ahead(policy.priority, policy.worth_reading, self.load_timeout_s)
        if self.check_every_step:
            self.check_integrity()

    def wait_for_reads(self, timeout_s: float, wake: Sequence[Any] = ()) -> bool:
        """If admission held a request for its reads since the last step, block until an I/O
        result arrives, a ``wake`` socket is readable or ``timeout_s`` passes (for a scheduler
        with nothing else to run). Returns whether it waited."""
        if not self.held_for_reads or self.tiers is None:
            return False
        self.tiers.wait_for_io(timeout_s, wake)
        self.held_for_reads = False
        return True

    def observe_queue(self, keys: Sequence[QueuedKey | tuple[Key, Namespace]]) -> Optional[QueueView]:
        """Look ahead over the waiting requests' keys, in queue order (policies that use the queue).

        Pass each request's :class:`QueuedKey` again every step: its last peek is revalidated
        (O(path nodes)) instead of matching its tokens again.

        Hands the policy this step's view (what queued requests need: soft protection) and
        starts NVMe -> DRAM reads for the requests inside the prefetch window.
        """
        policy = self.tree.policy
        if not policy.uses_queue:
            return None
        window = keys[: self.lookahead_window]
        free_pages = self.tiers.books.dram.num_free if self.tiers is not None else 0
        view = plan(self.tree, window, self.lookahead_window, free_pages)
        policy.observe_queue(view)
        if self.tiers is not None:
            for nodes in view.prefetch:
                self.tiers.prefetch(nodes, self.load_timeout_s, ahead=True)
            if self.tiers.store_enabled:
                for m, key in zip(view.matches[: view.prefetch_window], window):
                    tokens, namespace = (key.tokens, key.namespace) if isinstance(key, QueuedKey) else key
                    self._start_store_reads(m, tokens, namespace, ahead=True)
        self.last_view = view
        return view

    # ------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        """Forget every node and lower-tier copy. The caller resets the device allocator
        (SGLang's ``flush_cache`` does), so the tree's HBM slots are not freed here."""
        if self.tiers is not None:
            self.tiers.reset()
        if self.partial is not None:
            self.partial.reset()
        self.tree.reset()

    def check_integrity(self, request_tokens: Optional[int] = None, used_tokens: Optional[int] = None) -> None:
        """Tree + DRAM/NVMe books; with ``used_tokens``, also HBM: used == tree + ``request_tokens``.

        Args:
            request_tokens: HBM slots owned by requests (not yet, or never, in the tree).
            used_tokens: device slots handed out, if the device pool can tell.

        Raises:
            hiradix.core.node.IntegrityError: naming the broken invariant.
        """
        (self.tree if self.tiers is None else self.tiers.books).check_integrity()  # books check the tree too
        if used_tokens is not None:
            held = self.evictable_tokens + self.tree.hbm_protected_tokens
            if used_tokens != held + (request_tokens or 0):
                raise IntegrityError(f"HBM: {used_tokens} slots used != tree {held} + requests {request_tokens or 0}")

