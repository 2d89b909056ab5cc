"""Two-phase transfers between tiers, and the DRAM/NVMe books (pure bookkeeping, no I/O).

A transfer is prepared here (destination pages reserved, source copies pinned so they can
be neither evicted nor reused), carried out by the data movers (:mod:`hiradix.movers` in the
scheduler process for HBM<->DRAM, the I/O worker for DRAM<->NVMe), and completed here by its
id. Completing an unknown id (late, duplicate, after :meth:`TierBooks.reset`) changes nothing.
This mirrors vLLM's ``v1/kv_offload`` prepare/complete split and CachedAttention §3.2-3.3.

Kinds, by source and destination tier:

* ``BACKUP``   HBM -> DRAM  (write-through at insert, or write-back before an HBM eviction)
* ``PROMOTE``  DRAM -> HBM  (load back at admission; HBM slots are attached at prepare time)
* ``DEMOTE``   DRAM -> NVMe (under DRAM pressure; the DRAM copy is freed when it completes)
* ``PREFETCH`` NVMe -> DRAM (before admission; the request waits for it, up to a timeout)

Rule: a copy leaves the last tier holding it only when the tier below has no room
(NVMe full, or no NVMe tier); every other eviction drops a redundant copy.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Optional, Protocol, Sequence

from hiradix.tiers.allocator import PageAllocator
from hiradix.tree import IntegrityError, TieredRadixTree, Tier, TreeNode

logger = logging.getLogger(__name__)


class Kind(Enum):
    BACKUP = (Tier.HBM, Tier.DRAM)
    PROMOTE = (Tier.DRAM, Tier.HBM)
    DEMOTE = (Tier.DRAM, Tier.NVME)
    PREFETCH = (Tier.NVME, Tier.DRAM)

    @property
    def src(self) -> Tier:
        return self.value[0]

    @property
    def dst(self) -> Tier:
        return self.value[1]


@dataclass(eq=False)
class Transfer:
    """One in-flight transfer. ``src_ids``/``dst_ids`` are page ids in page order
    (for HBM: the device slot of each page's first token; ``hbm_slots`` holds all slots)."""

    op_id: int
    kind: Kind
    nodes: list[TreeNode]  # nodes it covers; grows when one of them is split
    src_ids: list[int]
    dst_ids: list[int]
    hbm_slots: Any = None  # Shape (pages * page_size,) device slots (BACKUP src, PROMOTE dst)
    dst_of: dict[int, int] = field(default_factory=dict)  # src page id -> dst page id
    ahead: bool = False  # PREFETCH started by the look-ahead window, before admission


class NvmeJournal(Protocol):
    """What the books tell the durable NVMe index (:class:`hiradix.tiering.TierController`)."""

    def invalidate(self, slots: Sequence[int]) -> None: ...

    def stored(self, node: TreeNode, slots: Sequence[int]) -> None: ...


def page_ids(node: TreeNode, tier: Tier, page_size: int) -> list[int]:
    """Per-page ids of ``node``'s copy in ``tier`` (HBM: first slot of each page)."""
    ids = node.ids_in(tier)
    if tier == Tier.HBM:
        ids = ids[::page_size]
        return ids.tolist() if hasattr(ids, "tolist") else list(ids)
    return list(ids)


class TierBooks:
    """Owns the DRAM page and NVMe slot allocators and the in-flight transfers of one tree.

    Args:
        tree: the tree whose nodes the transfers move.
        dram_pages: DRAM tier capacity in pages (0 = no DRAM tier).
        nvme_slots: NVMe tier capacity in pages (0 = no NVMe tier).
        dram_free_low_pages: a completed demotion frees its DRAM copy only while fewer
            DRAM pages than this are free (default: always).
    """

    def __init__(self, tree: TieredRadixTree, dram_pages: int, nvme_slots: int, dram_free_low_pages: Optional[int] = None):
        self.tree = tree
        # A completed DEMOTE frees its DRAM copy only while fewer pages than this are free
        # (default: always, i.e. a demotion moves the page down).
        self.dram_free_low_pages = dram_pages if dram_free_low_pages is None else dram_free_low_pages
        self.dram = PageAllocator(dram_pages)
        self.nvme = PageAllocator(nvme_slots) if nvme_slots > 0 else None
        self.nvme_enabled = self.nvme is not None
        self.ops: dict[int, Transfer] = {}
        self._op_ids = itertools.count(1)
        self._quarantine: dict[int, list[tuple[Tier, list[int]]]] = {}  # op id -> ids freed at its ack
        self.dropped_tokens = [0, 0, 0]  # tokens that left their last tier, per tier
        self.wasted_prefetch_tokens = 0  # prefetched into DRAM, dropped before a promotion
        # Durable NVMe index (hiradix.tiers.nvme_index), injected by the tier controller:
        # ``invalidate(slots)`` before a slot is rewritten or when it is freed, and
        # ``stored(node, slots)`` once a demotion landed. None: nothing is persisted.
        self.nvme_journal: Optional[NvmeJournal] = None
        tree.on_split = self._follow_split

    # ------------------------------------------------------------- allocation
    def allocator(self, tier: Tier) -> Optional[PageAllocator]:
        return self.dram if tier == Tier.DRAM else self.nvme

    def alloc(self, tier: Tier, n: int, *, allow_drop: Optional[bool] = None) -> Optional[list[int]]:
        """Reserve ``n`` pages of ``tier``, evicting copies in policy order if needed.

        Redundant copies (the node is also on another tier) go first; a node's last copy is
        dropped only if ``allow_drop`` (default: the tier below is full or absent).

        Returns:
            Page ids, or ``None`` (nothing changed except evictions) when room cannot be made.
        """
        pool = self.allocator(tier)
        if pool is None or n > pool.capacity:
            return None
        if pool.num_free < n:
            self.make_room(tier, n - pool.num_free, allow_drop=allow_drop)
        ids = pool.alloc(n)
        if ids and tier == Tier.NVME and self.nvme_journal is not None:
            self.nvme_journal.invalidate(ids)  # durable before any new byte reaches the slot
        return ids

    def make_room(self, tier: Tier, num_pages: int, *, allow_drop: Optional[bool] = None) -> int:
        """Free at least ``num_pages`` pages of ``tier`` if possible; returns pages freed."""
        if allow_drop is None:
            allow_drop = not self.lower_has_room(tier)
        freed = 0
        for redundant_pass in (True, False):
            if not redundant_pass and not allow_drop:
                break
            for node in self.tree.victims(tier, redundant_only=redundant_pass):
                if freed >= num_pages:
                    return freed
                freed += self.drop_copy(node, tier)
        return freed

    def lower_has_room(self, tier: Tier) -> bool:
        """Whether the tier below ``tier`` exists, is enabled and has a free page."""
        if tier == Tier.DRAM:
            return self.nvme_enabled and self.nvme is not None and self.nvme.num_free > 0
        return False

    def drop_copy(self, node: TreeNode, tier: Tier, held: frozenset | set = frozenset()) -> int:
        """Detach and free ``node``'s copy in ``tier`` (DRAM or NVMe); returns pages freed.

        ``held``: ``(tier, id)`` pairs the quarantine keeps reserved (freed at their ack).
        """
        assert tier != Tier.HBM
        if node.num_tiers == 1:
            self.dropped_tokens[tier] += node.num_tokens
        if tier == Tier.DRAM and node.nvme_loaded:
            self.wasted_prefetch_tokens += node.num_tokens  # read up from NVMe, never used
        ids = [i for i in self.tree.detach(node, tier) if (tier, i) not in held]
        self.allocator(tier).free(ids)
        if tier == Tier.NVME and self.nvme_journal is not None:
            self.nvme_journal.invalidate(ids)
        return len(ids)

    # ------------------------------------------------------------- prepare
    def prepare(
        self,
        kind: Kind,
        nodes: Sequence[TreeNode],
        hbm_slots: Any = None,
        allow_drop: Optional[bool] = None,
        ahead: bool = False,
    ) -> Optional[Transfer]:
        """Reserve the destination and pin the sources of a transfer of ``nodes``.

        Args:
            kind: what moves where.
            nodes: nodes holding a copy in ``kind.src`` and none in ``kind.dst``.
            hbm_slots: PROMOTE only: the new device slots (allocated by SGLang), shape
                ``(pages * page_size,)``; the other kinds allocate their destination here.
            allow_drop: passed to :meth:`alloc` (may the destination drop last copies).
            ahead: PREFETCH started by the look-ahead window; its pages count as DRAM hits
                when used (otherwise as NVMe hits: the request waited for the read).

        Returns:
            The transfer, or ``None`` when the destination has no room (nothing changed).
        """
        ps = self.tree.page_size
        src_ids = [i for n in nodes for i in page_ids(n, kind.src, ps)]
        if kind == Kind.PROMOTE:
            assert hbm_slots is not None and len(hbm_slots) == len(src_ids) * ps
            dst_ids = hbm_slots[::ps].tolist() if hasattr(hbm_slots, "tolist") else list(hbm_slots[::ps])
        else:
            dst_ids = self.alloc(kind.dst, len(src_ids), allow_drop=allow_drop)
            if dst_ids is None:
                return None
        op = Transfer(next(self._op_ids), kind, list(nodes), src_ids, dst_ids, hbm_slots, dict(zip(src_ids, dst_ids)), ahead)
        if kind == Kind.BACKUP:
            op.hbm_slots = _concat([n.hbm_slots for n in nodes])
        pos = 0
        for node in nodes:
            if kind == Kind.PROMOTE:  # attach now so the request can lock it; pin both copies
                self.tree.attach(node, Tier.HBM, hbm_slots[pos : pos + node.num_tokens])
                node.pinned[Tier.HBM] += 1
                pos += node.num_tokens
            node.pinned[kind.src] += 1
            node.ops.add(op.op_id)
            self.tree.refresh(node)
        self.ops[op.op_id] = op
        return op

    def _follow_split(self, lower: TreeNode, upper: TreeNode) -> None:
        for op_id in upper.ops:
            op = self.ops.get(op_id)
            if op is not None:
                op.nodes.append(upper)

    # ------------------------------------------------------------ complete
    def complete(self, op_id: int, ok: bool | Sequence[bool], aborted: bool = False) -> Optional[Transfer]:
        """Finish transfer ``op_id``; ``ok`` is one flag, or one per page in page order.

        Unknown ids (late, duplicate, after :meth:`reset`) change nothing and return ``None``.
        A page that failed makes its node's transfer a miss: the reserved destination pages
        are freed; for PREFETCH the source NVMe copy is dropped (it failed its checksum).
        ``aborted`` (the worker died or refused the job): nothing moved, the sources stay.
        """
        if op_id in self._quarantine:
            for tier, ids in self._quarantine.pop(op_id):
                self.allocator(tier).free(ids)
                if tier == Tier.NVME and self.nvme_journal is not None:
                    self.nvme_journal.invalidate(ids)
            return None
        op = self.ops.pop(op_id, None)
        if op is None:
            return None
        flags = dict(zip(op.src_ids, [ok] * len(op.src_ids) if isinstance(ok, bool) else ok))
        used: set[int] = set()
        for node in op.nodes:
            self._unpin(node, op)
            if node.alive and not aborted:
                used.update(self._finish_node(op, node, flags))
        if op.kind != Kind.PROMOTE:
            leftover = [d for d in op.dst_ids if d not in used]
            if leftover:
                self.allocator(op.kind.dst).free(leftover)
        return op

    def _unpin(self, node: TreeNode, op: Transfer) -> None:
        node.ops.discard(op.op_id)
        node.pinned[op.kind.src] -= 1
        if op.kind == Kind.PROMOTE:
            node.pinned[Tier.HBM] -= 1
        if node.alive:
            self.tree.refresh(node)

    def _finish_node(self, op: Transfer, node: TreeNode, flags: dict[int, bool]) -> list[int]:
        """Apply ``op``'s outcome to one node; returns the destination ids it kept."""
        kind, ps = op.kind, self.tree.page_size
        if kind == Kind.PROMOTE:
            if node.nvme_loaded and node.pinned[Tier.DRAM] == 0:
                node.nvme_loaded = False
            return []
        src = page_ids(node, kind.src, ps) if node.in_tier(kind.src) else []
        if not src or not all(flags.get(s, False) for s in src) or node.in_tier(kind.dst):
            if kind == Kind.PREFETCH and src and not all(flags.get(s, False) for s in src):
                logger.warning("hiradix: NVMe read of %s failed verification; treated as a miss", node)
                self.drop_subtree(node)
            return []
        dst = [op.dst_of[s] for s in src]
        self.tree.attach(node, kind.dst, dst)
        if kind == Kind.DEMOTE and self.nvme_journal is not None:
            self.nvme_journal.stored(node, dst)
        if kind == Kind.PREFETCH:
            node.nvme_loaded = not op.ahead
        if kind == Kind.DEMOTE and node.pinned[Tier.DRAM] == 0 and self.dram.num_free < self.dram_free_low_pages:
            self.drop_copy(node, Tier.DRAM)  # DRAM is short: the demotion moved it
        return dst

    def forget_nvme(self) -> int:
        """The NVMe tier was switched off: drop every NVMe copy it can no longer serve.

        Nodes whose only copy was on NVMe go too (with what hangs below them); copies pinned
        by a transfer in flight stay until it completes. Returns the NVMe pages freed.
        """
        self.nvme_enabled = False
        before = self.nvme.num_free if self.nvme is not None else 0
        for node in sorted(self.tree.sole_copies(Tier.NVME) | self.tree.candidates(Tier.NVME), key=lambda n: -n.num_tokens):
            if node.alive and node.in_tier(Tier.NVME) and node.pinned[Tier.NVME] == 0:
                if node.num_tiers > 1 or not node.children:
                    self.drop_copy(node, Tier.NVME)
                else:
                    self.drop_subtree(node)
        return (self.nvme.num_free - before) if self.nvme is not None else 0

    def drop_subtree(self, node: TreeNode) -> None:
        """Forget ``node`` and its descendants on DRAM/NVMe (none of them is in HBM)."""
        for child in list(node.children.values()):
            self.drop_subtree(child)
        for tier in (Tier.NVME, Tier.DRAM):
            # A pinned copy stays until its own transfer completes.
            if node.alive and node.in_tier(tier) and node.pinned[tier] == 0 and (node.num_tiers > 1 or not node.children):
                self.drop_copy(node, tier)

    def abandon_subtree(self, node: TreeNode) -> bool:
        """Forget ``node`` and its descendants on DRAM/NVMe, even copies transfers are using.

        For an HBM eviction that must make progress after the prefix above them was lost
        (their KV is unreachable now). The worker transfers touching them go to the
        quarantine, as in :meth:`reset`: their pages stay reserved until the ack, so a late
        write cannot land in a reused page. None of the nodes may be in HBM.

        Returns:
            False (and nothing changed) if a transfer also moves a node outside the subtree.
        """
        nodes, stack = [], [node]
        while stack:
            n = stack.pop()
            nodes.append(n)
            stack.extend(n.children.values())
        inside = set(nodes)
        ops = {op_id: self.ops[op_id] for n in nodes for op_id in n.ops if op_id in self.ops}
        if any(m.alive and m not in inside for op in ops.values() for m in op.nodes):
            return False
        for op in ops.values():
            self._quarantine_op(op)
            for m in op.nodes:
                if m.alive:
                    self._unpin(m, op)
        held = self._held()
        for n in reversed(nodes):  # children before their parents
            for tier in (Tier.NVME, Tier.DRAM):
                if n.alive and n.in_tier(tier):
                    self.drop_copy(n, tier, held)
        return True

    def _quarantine_op(self, op: Transfer) -> None:
        """Forget transfer ``op``; its worker-side pages stay reserved until its ack."""
        del self.ops[op.op_id]
        worker = op.kind in (Kind.DEMOTE, Kind.PREFETCH)
        self._quarantine[op.op_id] = [(op.kind.src, list(op.src_ids)), (op.kind.dst, list(op.dst_ids))] if worker else []

    def _held(self) -> set[tuple[Tier, int]]:
        """``(tier, id)`` pairs reserved by the quarantine."""
        return {(t, i) for q in self._quarantine.values() for t, ids in q for i in ids}

    # --------------------------------------------------------------- reset
    def reset(self) -> None:
        """Forget every node's lower-tier copy; pages of in-flight worker transfers stay
        reserved until their ack (so a late write cannot land in a reused page)."""
        for op in list(self.ops.values()):
            self._quarantine_op(op)
        held = self._held()
        for tier in (Tier.DRAM, Tier.NVME):
            pool = self.allocator(tier)
            if pool is not None:
                used = [i for i in range(pool.capacity) if pool.is_used(i) and (tier, i) not in held]
                pool.free(used)
                if tier == Tier.NVME and self.nvme_journal is not None:
                    self.nvme_journal.invalidate(used)

    def hold(self, nodes: Iterable[TreeNode], tier: Tier) -> None:
        """Pin ``nodes``' copies in ``tier`` for a moment (nothing may evict them)."""
        for node in nodes:
            node.pinned[tier] += 1
            self.tree.refresh(node)

    def release(self, nodes: Iterable[TreeNode], tier: Tier) -> None:
        """Undo :meth:`hold`."""
        for node in nodes:
            node.pinned[tier] -= 1
            if node.alive:
                self.tree.refresh(node)

    def pending_ids(self) -> list[int]:
        """Ids of transfers in flight and of quarantined ones (after a reset), ascending."""
        return sorted(set(self.ops) | set(self._quarantine))

    def in_flight(self, kind: Optional[Kind] = None) -> list[Transfer]:
        return [op for op in self.ops.values() if kind is None or op.kind == kind]

    # ----------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Per DRAM/NVMe tier: free + held by nodes + reserved == capacity; one owner per page.

        Raises:
            IntegrityError: naming the broken invariant.
        """
        self.tree.check_integrity()
        for tier in (Tier.DRAM, Tier.NVME):
            pool = self.allocator(tier)
            if pool is None:
                continue
            pool.check_integrity()
            owners: dict[int, str] = {}
            for node in self.tree.iter_nodes():
                for i in node.ids_in(tier) or ():
                    _claim(owners, i, f"node {node.id}", tier)
            for op in self.ops.values():
                if op.kind.dst == tier:
                    for i in op.dst_ids:
                        if not any(n.alive and i in (n.ids_in(tier) or ()) for n in op.nodes):
                            _claim(owners, i, f"op {op.op_id}", tier)
            for op_id, held in self._quarantine.items():
                for t, ids in held:
                    if t == tier:
                        for i in ids:
                            _claim(owners, i, f"quarantine {op_id}", tier, allow_dup=True)
            used = {i for i in range(pool.capacity) if pool.is_used(i)}
            if used != set(owners):
                raise IntegrityError(
                    f"{tier.name}: used pages without owner {sorted(used - set(owners))[:8]}, "
                    f"owned pages marked free {sorted(set(owners) - used)[:8]}"
                )
            if pool.num_free + len(used) != pool.capacity:
                raise IntegrityError(f"{tier.name}: free {pool.num_free} + used {len(used)} != {pool.capacity}")


def _claim(owners: dict[int, str], page: int, who: str, tier: Tier, allow_dup: bool = False) -> None:
    if page in owners and not allow_dup:
        raise IntegrityError(f"{tier.name} page {page} owned by {owners[page]} and {who}")
    owners.setdefault(page, who)


def _concat(parts: Iterable[Any]) -> Any:
    parts = list(parts)
    if parts and hasattr(parts[0], "tolist"):
        import torch

        return torch.cat(parts)
    return [x for p in parts for x in p]
