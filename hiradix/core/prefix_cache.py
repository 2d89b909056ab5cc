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
from hiradix.core.dram_stream import DramStream
from hiradix.core.admission_holds import AdmissionHolds
from hiradix.core.lookahead import QueuedKey, QueueView, plan
from hiradix.core.node import IntegrityError, Tier, TreeMatch, TreeNode
from hiradix.core.ledger import Kind
from hiradix.core.partial_pages import PartialPage
from hiradix.core.partial_reuse import PartialReuse
from hiradix.core.placement import Placement
from hiradix.core.ports import DevicePool, Slots
from hiradix.core.tree import TieredRadixTree

Key = Sequence[int]  # token ids
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
            request of the prefix (:mod:`hiradix.core.partial_reuse`); needs pages of > 1 token.
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
        use_partial = partial_pages and tree.page_size > 1
        self.partial = PartialReuse(tree, device, copy_rows, self._loading) if use_partial else None
        self.streamed: Optional[tuple[int, LoadBack]] = None  # what the last match promoted early
        dram_pages = tiers.books.dram.capacity if tiers is not None else 0
        self.stream = DramStream(tree.page_size, dram_pages)
        self.holds = AdmissionHolds(tree, tiers, load_timeout_s) if tiers is not None else None
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
                self.tiers.backups.after_hit(m.stage(Tier.HBM))
            self._start_reads(m, tokens, namespace, ahead=False)
            self.streamed = None
            if self.stream.promote_first(m) and self._promote_held(m):  # a history larger than DRAM
                m = self.tree.match(tokens, namespace)
                self._start_reads(m, tokens, namespace, ahead=False)
        return m

    def _promote_held(self, m: TreeMatch) -> int:
        """Promote ``m``'s DRAM part into HBM now, for a request still waiting for the rest of its
        history (:mod:`hiradix.core.dram_stream`); returns tokens promoted (0: no HBM room).
        :attr:`streamed` tells the caller: ``(first token promoted, LoadBack)``."""
        self.lock(m.hbm_node)
        try:
            back = self.promote_now(m.hbm_node, m.dram_node, m.dram_len)
        finally:
            self.unlock(m.hbm_node)
        self.tiers.stats.streamed_tokens += back.loaded
        self.streamed = (m.hbm_len, back) if back.loaded else None
        return back.loaded

    def _start_reads(self, m: TreeMatch, tokens: Key, namespace: Namespace, ahead: bool) -> None:
        # The room a read makes must not be the request's own DRAM pages it reads next (DramStream.to_hold).
        dram = self.stream.to_hold(m) if m.nvme_len or m.store_len else []
        self.tiers.books.hold(dram, Tier.DRAM)
        try:
            if m.nvme_len and (nodes := self.stream.readable(m, Tier.NVME)):
                self.tiers.prefetch(nodes, self.load_timeout_s, ahead=ahead)
            self._start_store_reads(m, tokens, namespace, ahead)
        finally:
            self.tiers.books.release(dram, Tier.DRAM)

    def _start_store_reads(self, m: TreeMatch, tokens: Key, namespace: Namespace, ahead: bool) -> None:
        if m.store_len and self.tiers.store_read_worth(m.store_len) and (nodes := self.stream.readable(m, Tier.STORE)):
            self.tiers.prefetch(nodes, self.load_timeout_s, ahead=ahead, src=Tier.STORE)  # (else: recomputed)
        if m.matched_len == m.cached_len:  # the tree knows nothing more: ask the store what follows
            self.tiers.lookup(m, tokens, namespace, self.load_timeout_s, ahead=ahead)

    def should_wait(self, tokens: Key | QueuedKey, namespace: Namespace = None) -> bool:
        """Whether admission should skip this request for now (:meth:`AdmissionHolds.hold`): part of
        its prefix is on NVMe or in the store and not yet in DRAM, within ``load_timeout_s``. Pass
        the request's :class:`QueuedKey` (the one the look-ahead keeps) to reuse its last peek and
        time its holds by cause."""
        if self.tiers is None:
            return False
        held = self.holds.hold(tokens if isinstance(tokens, QueuedKey) else QueuedKey(tokens, namespace),
                               per_request=isinstance(tokens, QueuedKey))
        self.held_for_reads |= held
        return held

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

    def promote_now(self, start: TreeNode, end: TreeNode, num_tokens: int) -> LoadBack:
        """:meth:`load_back`, then finish the copies now (not layer by layer with a forward): for a
        context-overflow reuse (:mod:`hiradix.sglang_plugin.overflow`) that copies the promoted
        slots at once, and for a history streamed through DRAM while its request waits (no forward
        may run). The DRAM copies stay as written."""
        back = self.load_back(start, end, num_tokens)
        if back.loaded:
            self.tiers.land_now()
        return back

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
            evicted += self.partial.evict(num_tokens - evicted, tree_evicted=evicted > 0)
        if self.on_evict is not None:
            self.on_evict(evicted, started_s)  # SGLang's eviction metrics take perf_counter()
        if self.check_every_step:
            self.check_integrity()
        return evicted

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
            self.tiers.backups.after_insert(new_nodes)
        key_len = len(tokens) - len(tokens) % self.tree.page_size
        return key_len, last

    # ------------------------------------------------------------ partial last pages
    def match_partial(self, node: TreeNode, namespace: Namespace, next_tokens: Key,
                      claimer: Any) -> tuple[int, Optional[PartialPage]]:
        """The partial page that continues a whole-page prefix in HBM (:meth:`PartialReuse.match`);
        ``(0, None)`` when partial pages are off."""
        return (0, None) if self.partial is None else self.partial.match(node, namespace, next_tokens, claimer)

    def take_partial(self, page: PartialPage, claimer: Any, num_tokens: int) -> Slots:
        """Hand a claimed partial page to its request (:meth:`PartialReuse.take`)."""
        return self.partial.take(page, claimer, num_tokens)

    def keep_partial(self, node: TreeNode, namespace: Namespace, tokens: Key, slots: Slots) -> bool:
        """Keep a released request's last page (:meth:`PartialReuse.keep`); False: not kept."""
        return self.partial is not None and self.partial.keep(node, namespace, tokens, slots)

    def _loading(self, node: TreeNode) -> bool:
        """Whether ``node``'s HBM rows are still being written (a promotion from DRAM in flight:
        its slots are set at admission, its rows arrive layer by layer in the next forward)."""
        if self.tiers is None or not node.ops:
            return False
        ops = self.tiers.books.ops
        return any(ops[i].kind == Kind.PROMOTE for i in node.ops if i in ops)

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

    def land_queued_reads(self, head: Sequence[QueuedKey], timeout_s: float) -> bool:
        """Right before a prefill batch forms: wait up to ``timeout_s`` for the reads the requests
        at the queue's ``head`` wait on (their keys as :meth:`observe_queue` last peeked them), then
        apply what landed, so they join this batch instead of waiting for its forward
        (:mod:`hiradix.core.read_landing`). Returns whether the tiers took one more step."""
        if self.tiers is None:
            return False
        return self.tiers.land_queued_reads([n for key in head for n in key.nodes], timeout_s)

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

