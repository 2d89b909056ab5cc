"""The transfer ledger: two-phase transfers between tiers and the DRAM/NVMe page books.

Pure bookkeeping, no I/O. A transfer is prepared here (destination pages taken from the free
list, source copies pinned so they can be neither evicted nor reused), carried out by the data
movers (:class:`hiradix.core.ports.HostMover` for HBM <-> DRAM, :class:`hiradix.core.ports.IOClient`
for DRAM <-> NVMe), and completed here by its id. Completing an unknown id (late, duplicate,
after :meth:`TierBooks.reset`) changes nothing. This mirrors vLLM's ``v1/kv_offload``
prepare/complete split and CachedAttention §3.2-3.3.

The ledger records; it decides nothing. Allocation is atomic and never evicts: a transfer
whose destination has too few free pages is refused and nothing changes. Which copies leave a
tier to make room is :class:`hiradix.core.placement.Placement`'s decision; when to move what is
:class:`hiradix.core.controller.TierController`'s. The one consequence the ledger applies on
its own: a page that fails its checksum on a PREFETCH is a bad copy, so that NVMe copy (and
what hangs below it, unreachable without it) is dropped.

Kinds, by source and destination tier:

* ``BACKUP``   HBM -> DRAM  (write-through at insert, or write-back before an HBM eviction)
* ``PROMOTE``  DRAM -> HBM  (load back at admission; HBM slots are attached at prepare time)
* ``DEMOTE``   DRAM -> NVMe (store; the DRAM copy stays, see ``Placement.after_demote``)
* ``PREFETCH`` NVMe -> DRAM (load, before admission; the request waits for it, up to a timeout)
* ``PUT``      DRAM -> cluster store (share; the destination ids are the pages' keys)
* ``GET``      cluster store -> DRAM (load, before admission, like PREFETCH)

A failed GET page means the store no longer holds that object (or it did not verify): the store
copy is forgotten like a bad NVMe copy. A failed PUT attaches nothing.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Optional, Sequence

from hiradix.core.allocator import PageAllocator
from hiradix.core.node import NUM_TIERS, IntegrityError, Tier, TreeNode
from hiradix.core.ports import NvmeJournal
from hiradix.core.tree import TieredRadixTree

logger = logging.getLogger(__name__)


class Kind(Enum):
    BACKUP = (Tier.HBM, Tier.DRAM)
    PROMOTE = (Tier.DRAM, Tier.HBM)
    DEMOTE = (Tier.DRAM, Tier.NVME)
    PREFETCH = (Tier.NVME, Tier.DRAM)
    PUT = (Tier.DRAM, Tier.STORE)
    GET = (Tier.STORE, Tier.DRAM)

    @property
    def src(self) -> Tier:
        return self.value[0]

    @property
    def dst(self) -> Tier:
        return self.value[1]


@dataclass(eq=False)
class Transfer:
    """One in-flight transfer. ``src_ids``/``dst_ids`` are page ids in page order (for HBM: the
    device slot of each page's first token, ``hbm_parts`` holds all slots; for the store: keys)."""

    op_id: int
    kind: Kind
    nodes: list[TreeNode]  # nodes it covers; grows when one of them is split
    src_ids: list[Any]
    dst_ids: list[Any]
    # Device slot arrays in page order, their lengths summing to pages * page_size: one per
    # node (BACKUP source) or the one allocated array (PROMOTE destination); empty otherwise.
    hbm_parts: list = field(default_factory=list)
    dst_of: dict[int, int] = field(default_factory=dict)  # src page id -> dst page id
    ahead: bool = False  # PREFETCH/GET started by the look-ahead window, before admission


def page_ids(node: TreeNode, tier: Tier, page_size: int) -> list[Any]:
    """Per-page ids of ``node``'s copy in ``tier`` (HBM: first slot of each page; store: keys)."""
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
    """

    def __init__(self, tree: TieredRadixTree, dram_pages: int, nvme_slots: int):
        self.tree = tree
        self.dram = PageAllocator(dram_pages)
        self.nvme = PageAllocator(nvme_slots) if nvme_slots > 0 else None
        # Whether the NVMe tier takes new copies; only Placement.forget_nvme (called by the
        # controller when it switches the tier off) clears it.
        self.nvme_enabled = self.nvme is not None
        self.ops: dict[int, Transfer] = {}
        self._op_ids = itertools.count(1)
        self._quarantine: dict[int, list[tuple[Tier, list[int]]]] = {}  # op id -> ids freed at its ack
        self.dropped_tokens = [0] * NUM_TIERS  # tokens that left their last tier, per tier
        self.wasted_prefetch_tokens = 0  # prefetched into DRAM from NVMe, dropped before a promotion
        self.wasted_store_tokens = 0  # fetched into DRAM from the store, dropped before a promotion
        # Durable NVMe index (hiradix.persistence.journal), injected at assembly:
        # ``invalidate(slots)`` before a slot is rewritten or when it is freed, and
        # ``stored(node, slots)`` once a demotion landed. None: nothing is persisted.
        self.nvme_journal: Optional[NvmeJournal] = None
        tree.on_split = self._follow_split

    # ------------------------------------------------------------- allocation
    def allocator(self, tier: Tier) -> Optional[PageAllocator]:
        """The page allocator of DRAM or NVMe; None for HBM (SGLang's) and the store (keys)."""
        if tier == Tier.DRAM:
            return self.dram
        return self.nvme if tier == Tier.NVME else None

    def alloc(self, tier: Tier, n: int) -> Optional[list[int]]:
        """Take ``n`` free pages of ``tier``, all or nothing; never evicts.

        Returns:
            Page ids, or ``None`` (nothing changed) when fewer than ``n`` pages are free.
        """
        pool = self.allocator(tier)
        if pool is None or n > pool.num_free:
            return None
        ids = pool.alloc(n)
        if ids and tier == Tier.NVME and self.nvme_journal is not None:
            self.nvme_journal.invalidate(ids)  # durable before any new byte reaches the slot
        return ids

    def drop_copy(self, node: TreeNode, tier: Tier, held: frozenset | set = frozenset()) -> int:
        """Detach and free ``node``'s copy in ``tier`` (DRAM, NVMe; store: forget); returns pages freed.

        ``held``: ``(tier, id)`` pairs the quarantine keeps reserved (freed at their ack).
        """
        assert tier != Tier.HBM
        if node.num_tiers == 1:
            self.dropped_tokens[tier] += node.num_tokens
        if tier == Tier.DRAM and node.dram_from == Tier.NVME:
            self.wasted_prefetch_tokens += node.num_tokens  # read up from NVMe, never used
        elif tier == Tier.DRAM and node.dram_from == Tier.STORE:
            self.wasted_store_tokens += node.num_tokens  # fetched from the store, never used
        ids = [i for i in self.tree.detach(node, tier) if (tier, i) not in held]
        if tier == Tier.STORE:
            return 0  # a forgotten record: the store keeps or evicts the object on its own
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
        ahead: bool = False,
        store_keys: Optional[Sequence[str]] = None,
    ) -> Optional[Transfer]:
        """Take the destination from the free pages and pin the sources of a transfer of ``nodes``.

        Args:
            kind: what moves where.
            nodes: nodes holding a copy in ``kind.src`` and none in ``kind.dst``.
            hbm_slots: PROMOTE only: the new device slots (allocated by SGLang), shape
                ``(pages * page_size,)``; the other kinds take their destination here.
            ahead: PREFETCH/GET started by the look-ahead window, before admission (a request
                that uses its pages did not wait for them).
            store_keys: PUT only: the key of each page, in page order.

        Returns:
            The transfer, or ``None`` when the destination has too few free pages (nothing
            changed; :meth:`hiradix.core.placement.Placement.prepare` makes room first).
        """
        ps = self.tree.page_size
        src_ids = [i for n in nodes for i in page_ids(n, kind.src, ps)]
        if kind == Kind.PROMOTE:
            assert hbm_slots is not None and len(hbm_slots) == len(src_ids) * ps
            dst_ids = hbm_slots[::ps].tolist() if hasattr(hbm_slots, "tolist") else list(hbm_slots[::ps])
        elif kind == Kind.PUT:
            assert store_keys is not None and len(store_keys) == len(src_ids)
            dst_ids = list(store_keys)
        else:
            dst_ids = self.alloc(kind.dst, len(src_ids))
            if dst_ids is None:
                return None
        op = Transfer(next(self._op_ids), kind, list(nodes), src_ids, dst_ids, dst_of=dict(zip(src_ids, dst_ids)), ahead=ahead)
        if kind == Kind.BACKUP:
            op.hbm_parts = [n.hbm_slots for n in nodes]
        elif kind == Kind.PROMOTE:
            op.hbm_parts = [hbm_slots]
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

    def new_op_id(self) -> int:
        """A fresh op id for a job the ledger does not track (a store lookup); ids stay ascending."""
        return next(self._op_ids)

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
        are freed; for PREFETCH/GET the source copy is dropped (it failed its checksum, or the
        store no longer has it), with what hangs below it.
        ``aborted`` (the worker died or refused the job): nothing moved, the sources stay.
        """
        if op_id in self._quarantine:
            for tier, ids in self._quarantine.pop(op_id):
                self.allocator(tier).free(ids)  # only DRAM/NVMe ids are quarantined
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
        pool = self.allocator(op.kind.dst)
        if pool is not None:
            leftover = [d for d in op.dst_ids if d not in used]
            if leftover:
                pool.free(leftover)
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
            if node.pinned[Tier.DRAM] == 0:
                node.dram_from, node.waited_for_read = None, False
            return []
        src = page_ids(node, kind.src, ps) if node.in_tier(kind.src) else []
        if not src or not all(flags.get(s, False) for s in src) or node.in_tier(kind.dst):
            if kind in (Kind.PREFETCH, Kind.GET) and src and not all(flags.get(s, False) for s in src):
                what = "NVMe read" if kind == Kind.PREFETCH else "store read"
                logger.warning("hiradix: %s of %s failed (missing or not verified); treated as a miss", what, node)
                self.drop_subtree(node)
            return []
        dst = [op.dst_of[s] for s in src]
        self.tree.attach(node, kind.dst, dst)
        if kind == Kind.DEMOTE and self.nvme_journal is not None:
            self.nvme_journal.stored(node, dst)
        if kind in (Kind.PREFETCH, Kind.GET):
            node.dram_from = kind.src
            node.waited_for_read = not op.ahead
        return dst

    def close_nvme(self) -> None:
        """Take no new NVMe copies from now on (the tier was switched off)."""
        self.nvme_enabled = False

    def drop_subtree(self, node: TreeNode) -> None:
        """Forget ``node`` and its descendants on DRAM/NVMe/store (none of them is in HBM)."""
        for child in list(node.children.values()):
            self.drop_subtree(child)
        for tier in (Tier.STORE, Tier.NVME, Tier.DRAM):
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
            for tier in (Tier.STORE, Tier.NVME, Tier.DRAM):
                if n.alive and n.in_tier(tier):
                    self.drop_copy(n, tier, held)
        return True

    def _quarantine_op(self, op: Transfer) -> None:
        """Forget transfer ``op``; its worker-side pages stay reserved until its ack."""
        del self.ops[op.op_id]
        worker = op.kind in (Kind.DEMOTE, Kind.PREFETCH, Kind.PUT, Kind.GET)
        held = [(op.kind.src, list(op.src_ids)), (op.kind.dst, list(op.dst_ids))] if worker else []
        self._quarantine[op.op_id] = [(tier, ids) for tier, ids in held if self.allocator(tier) is not None]

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
