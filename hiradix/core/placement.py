"""Placement: which copy leaves which tier. The one owner of that decision (pure bookkeeping).

The tree lists the candidates and walks them in the policy's order; the ledger records what
moved. Everything that decides to drop a copy is here:

* :meth:`Placement.prepare` / :meth:`room_for`: room in DRAM or NVMe for a transfer. Copies
  another tier also holds go first; a last copy goes only when the tier below has no room (NVMe
  full or absent) or the caller allows it. Atomic: either enough room is made, or nothing is
  dropped (the plan is made read-only first, :meth:`TieredRadixTree.plan_evict`).
* :meth:`Placement.evict_hbm`: HBM slots for SGLang's allocator. A last HBM copy is first
  saved to DRAM by the caller's write-back (``backup``); if it cannot be, the node's KV is
  lost, and so is what hangs below it on lower tiers (unreachable without this prefix).
* :meth:`Placement.after_demote`: whether the DRAM copy of a page just stored on NVMe stays
  (a DRAM hit for the next turn) or goes (DRAM is short: below ``DRAM_FREE_LOW`` free; always
  in staging mode). :meth:`Placement.after_promote`: staging mode drops a promoted page's DRAM
  copy when NVMe holds it too.
* :meth:`Placement.forget_nvme` / :meth:`forget`: what the copies of NVMe or the cluster store
  become when that tier is switched off.

Rule: a copy leaves the last tier holding it only when there is nowhere below to keep it;
every other eviction drops a redundant copy (CachedAttention §3.3, write-back to the SSD).
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Optional, Sequence

from hiradix.core.ledger import Kind, TierBooks, Transfer, page_ids
from hiradix.core.node import Tier, TreeNode
from hiradix.core.tree import TieredRadixTree

# A stored (demoted) page also leaves DRAM while fewer than this fraction of DRAM pages is free.
DRAM_FREE_LOW = 0.25


class Placement:
    """Decides which copies leave DRAM, NVMe and HBM, and drops them through the ledger.

    Args:
        tree: the tree whose copies it drops.
        books: the ledger of the DRAM/NVMe tiers, or None (HBM only: last copies just go).
        dram_free_low_pages: a stored page's DRAM copy is dropped while fewer DRAM pages than
            this are free; default: always (a demotion moves the page down).
    """

    def __init__(self, tree: TieredRadixTree, books: Optional[TierBooks], dram_free_low_pages: Optional[int] = None):
        self.tree = tree
        self.books = books
        capacity = books.dram.capacity if books is not None else 0
        self.dram_free_low_pages = capacity if dram_free_low_pages is None else dram_free_low_pages

    # ------------------------------------------------------------ DRAM / NVMe room
    def lower_has_room(self, tier: Tier) -> bool:
        """Whether the tier below ``tier`` exists, takes copies and has a free page."""
        books = self.books
        if tier == Tier.DRAM and books is not None:
            return books.nvme_enabled and books.nvme is not None and books.nvme.num_free > 0
        return False

    def make_room(self, tier: Tier, num_pages: int, allow_drop: Optional[bool] = None) -> int:
        """Drop copies of ``tier`` (DRAM or NVMe) until ``num_pages`` more pages are free, or
        every copy that may go is gone (best effort; :meth:`room_for` is the atomic form).

        Args:
            tier: DRAM or NVMe.
            num_pages: pages to free, beyond those already free.
            allow_drop: may last copies go (default: only when the tier below has no room).

        Returns:
            Pages freed.
        """
        return self._drop(self._plan(tier, num_pages, allow_drop), tier)

    def room_for(self, tier: Tier, n: int, allow_drop: Optional[bool] = None) -> bool:
        """Make ``n`` pages of ``tier`` free, atomically: either they are free afterwards, or
        nothing was dropped (and False is returned)."""
        pool = self.books.allocator(tier) if self.books is not None else None
        if pool is None or n > pool.capacity:
            return False
        short = n - pool.num_free
        if short <= 0:
            return True
        plan = self._plan(tier, short, allow_drop)
        if sum(node.num_tokens for node in plan) // self.tree.page_size < short:
            return False
        self._drop(plan, tier)
        return True

    def alloc(self, tier: Tier, n: int, allow_drop: Optional[bool] = None) -> Optional[list[int]]:
        """``n`` pages of ``tier``, making room first (:meth:`room_for`); None: nothing changed."""
        if not self.room_for(tier, n, allow_drop):
            return None
        return self.books.alloc(tier, n)

    def _plan(self, tier: Tier, num_pages: int, allow_drop: Optional[bool]) -> list[TreeNode]:
        if self.books is None or num_pages <= 0:
            return []
        if allow_drop is None:
            allow_drop = not self.lower_has_room(tier)
        # NVMe's room is only ever for DRAM's pages (DEMOTE is the one transfer into NVMe): an
        # NVMe copy whose node keeps only its DRAM copy is no room at all, since dropping it makes
        # that DRAM copy a last copy needing the same store (two such nodes displaced each other
        # at every step, forever: an idle server kept writing).
        spare = Tier.DRAM if tier == Tier.NVME else None
        return self.tree.plan_evict(tier, num_pages, allow_sole=allow_drop, spare=spare)

    def _drop(self, plan: list[TreeNode], tier: Tier) -> int:
        return sum(self.books.drop_copy(node, tier) for node in plan)

    def prepare(self, kind: Kind, nodes: Sequence[TreeNode], hbm_slots: Any = None,
                allow_drop: Optional[bool] = None, ahead: bool = False) -> Optional[Transfer]:
        """Make room for a transfer of ``nodes`` and open it in the ledger.

        Returns:
            The transfer, or None (nothing dropped, nothing reserved) when no room can be made.
        """
        if kind != Kind.PROMOTE:
            pages = sum(len(page_ids(n, kind.src, self.tree.page_size)) for n in nodes)
            if not self.room_for(kind.dst, pages, allow_drop):
                return None
        return self.books.prepare(kind, nodes, hbm_slots=hbm_slots, ahead=ahead)

    def after_demote(self, op: Transfer, keep: Optional[Callable[[TreeNode], bool]] = None) -> None:
        """A store to NVMe landed: drop the DRAM copies it made redundant while DRAM is short,
        except those ``keep`` names (a cluster-store PUT waits to read them)."""
        books = self.books
        for node in op.nodes:
            if keep is not None and keep(node):
                continue
            if (node.alive and node.in_tier(Tier.NVME) and node.in_tier(Tier.DRAM)
                    and node.pinned[Tier.DRAM] == 0 and books.dram.num_free < self.dram_free_low_pages):
                books.drop_copy(node, Tier.DRAM)

    def after_promote(self, op: Transfer) -> None:
        """Staging mode only: a promotion to HBM landed; drop the DRAM copies NVMe also holds."""
        for node in op.nodes:
            if node.alive and node.in_tier(Tier.NVME) and node.in_tier(Tier.DRAM) and node.pinned[Tier.DRAM] == 0:
                self.books.drop_copy(node, Tier.DRAM)

    def demotion_order(self, limit: Optional[int] = None) -> list[TreeNode]:
        """Nodes whose last local copy is in DRAM (:meth:`TreeNode.sole_tier`), not in a transfer,
        in policy order: the next (at most ``limit``) to store to NVMe."""
        todo = [n for n in self.tree.sole_copies(Tier.DRAM) if n.pinned[Tier.DRAM] == 0]
        key = self.tree.policy.priority
        if limit is not None and limit < len(todo):
            return heapq.nsmallest(limit, todo, key=lambda n: key(n, Tier.DRAM))
        todo.sort(key=lambda n: key(n, Tier.DRAM))
        return todo

    def forget_nvme(self) -> int:
        """The NVMe tier is switched off: drop every NVMe copy it can no longer serve (:meth:`forget`).

        Returns the NVMe pages freed.
        """
        books = self.books
        books.close_nvme()
        if books.nvme is None:
            return 0
        before = books.nvme.num_free
        self.forget(Tier.NVME)
        return books.nvme.num_free - before

    def forget(self, tier: Tier) -> int:
        """Drop every copy in ``tier`` (NVMe or the store, switched off) no transfer is using.

        Nodes whose only copy was there go too, with what hangs below them (unreachable without
        them); copies pinned by a transfer in flight stay until it completes (call again later).
        Returns the nodes whose copy was dropped.
        """
        held = [n for n in self.tree.iter_nodes() if n.in_tier(tier) and n.pinned[tier] == 0]
        for node in sorted(held, key=lambda n: -n.num_tokens):
            if node.alive and node.in_tier(tier) and node.pinned[tier] == 0:
                if node.num_tiers > 1 or not node.children:
                    self.books.drop_copy(node, tier)
                else:
                    self.books.drop_subtree(node)
        return len(held)

    # ------------------------------------------------------------ HBM
    def evict_hbm(self, num_tokens: int, backup: Optional[Callable[[TreeNode], bool]] = None,
                  left: Optional[list] = None) -> list[Any]:
        """Drop HBM copies of at least ``num_tokens`` tokens if that many are evictable.

        Victims come in policy order (:meth:`TieredRadixTree.victims`); locked or pinned
        nodes are never chosen. A victim also held on a lower tier keeps its node. A last HBM
        copy is saved with ``backup(node)`` (write-back to DRAM) when given; if that fails (or
        there is no backup) the node's KV is lost together with what hangs below it. A node
        whose children are pinned by a transfer in flight is taken last, abandoning those
        transfers, only if the others did not free enough: SGLang counted it as evictable.

        Args:
            left: if given, the nodes that lost their HBM copy and stay in the tree are appended.

        Returns:
            The freed HBM slot arrays, for the caller to return to the device allocator.
        """
        freed, evicted, stuck = [], 0, []
        for node in self.tree.victims(Tier.HBM):
            if evicted >= num_tokens:
                break
            if node.num_local_tiers == 1 and (backup is None or not backup(node)) and node.num_tiers == 1:
                # No copy anywhere else (a store copy keeps the node and what hangs below it):
                # the KV is lost, and so is what hangs below it, unreachable without it.
                for child in list(node.children.values()):
                    self.books.drop_subtree(child)
                if node.children:
                    stuck.append(node)  # a child's copy is pinned by a transfer in flight
                    continue
                self._lost(node)
            evicted += node.num_tokens
            freed.append(self.tree.detach(node, Tier.HBM))
            if left is not None and node.alive:
                left.append(node)
        for node in stuck:  # only with lower tiers: without them an HBM candidate has no children
            if evicted >= num_tokens or not node.alive or node.lock_ref or node.tiers() != [Tier.HBM]:
                continue
            if all(self.books.abandon_subtree(child) for child in list(node.children.values())) and not node.children:
                self._lost(node)
                evicted += node.num_tokens
                freed.append(self.tree.detach(node, Tier.HBM))
        return freed

    def _lost(self, node: TreeNode) -> None:
        """Count a last HBM copy that leaves without a copy below (books.dropped_tokens[HBM])."""
        if self.books is not None:
            self.books.dropped_tokens[Tier.HBM] += node.num_tokens
