"""The tree's invariants, recounted from scratch (for tests and ``HIRADIX_CHECK_INTEGRITY``).

See the invariants listed in :mod:`hiradix.core.tree`; page ownership of DRAM and NVMe is the
ledger's check (:meth:`hiradix.core.ledger.TierBooks.check_integrity`).
"""

from __future__ import annotations

from hiradix.core.node import NUM_TIERS, Tier, TreeNode, require
from hiradix.core.tree import TieredRadixTree


def check_tree(tree: TieredRadixTree) -> None:
    """Verify the structural and HBM invariants in the module docstring.

    DRAM/NVMe page ownership against their allocators is checked by
    :meth:`hiradix.core.ledger.TierBooks.check_integrity`.

    Raises:
        IntegrityError: naming the first broken invariant.
    """
    evictable = protected = 0
    tier_tokens = [0] * NUM_TIERS
    seen_slots: set[int] = set()
    cands: list[set] = [set() for _ in Tier]
    sole: list[set] = [set() for _ in Tier]
    for node in tree.iter_nodes():
        _check_node(tree, node, seen_slots)
        tiers = node.tiers()
        if node.sole_tier() is not None:
            sole[node.sole_tier()].add(node)
        for tier in tiers:
            tier_tokens[tier] += node.num_tokens
            if tree.is_candidate(node, tier):
                cands[tier].add(node)
        if node.hbm_slots is not None:
            if node.lock_ref > 0:
                protected += node.num_tokens
            else:
                evictable += node.num_tokens
    require(evictable == tree.hbm_evictable_tokens, f"HBM evictable {tree.hbm_evictable_tokens} != recount {evictable}")
    require(protected == tree.hbm_protected_tokens, f"HBM protected {tree.hbm_protected_tokens} != recount {protected}")
    require(tier_tokens == tree.tier_tokens, f"tier tokens {tree.tier_tokens} != recount {tier_tokens}")
    for tier in Tier:
        extra, missing = tree.candidates(tier) - cands[tier], cands[tier] - tree.candidates(tier)
        require(not extra and not missing, f"{tier.name} candidates differ: extra={extra} missing={missing}")
        require(sole[tier] == tree.sole_copies(tier), f"{tier.name} sole-copy set differs")


def _check_node(tree: TieredRadixTree, node: TreeNode, seen_slots: set[int]) -> None:
    ps, parent = tree.page_size, node.parent
    require(parent is not None and parent.children.get(tree.key_in_parent(node)) is node, f"{node} not indexed by its parent")
    require(node.num_tokens > 0 and node.num_tokens % ps == 0, f"{node} key not page-aligned")
    require(bool(node.tiers()), f"{node} is held by no tier")
    require(node.namespace == parent.namespace or parent is tree.root, f"{node} namespace differs from parent")
    child_locks = sum(c.lock_ref for c in node.children.values())
    require(node.lock_ref >= child_locks, f"{node} lock_ref {node.lock_ref} < children's {child_locks}")
    if node.lock_ref > 0:
        require(node.hbm_slots is not None, f"{node} locked but not in HBM")
    if node.hbm_slots is not None:
        require(parent is tree.root or parent.hbm_slots is not None, f"{node} in HBM but parent {parent} is not")
        require(len(node.hbm_slots) == node.num_tokens, f"{node} has {len(node.hbm_slots)} HBM slots")
        slots = node.hbm_slots.tolist() if hasattr(node.hbm_slots, "tolist") else list(node.hbm_slots)
        before = len(seen_slots)
        seen_slots.update(slots)
        require(len(seen_slots) - before == len(slots), f"{node} shares an HBM slot with another node")
    for pages in (node.dram_pages, node.nvme_slots, node.store_keys):
        if pages is not None:
            require(len(pages) == node.num_tokens // ps, f"{node} has {len(pages)} pages for {node.num_tokens} tokens")
