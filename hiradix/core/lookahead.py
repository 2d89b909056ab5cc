"""The look-ahead window over the scheduler's waiting queue (CachedAttention §3.3).

Pure bookkeeping: given the token keys of the first ``W`` queued requests, find (read-only:
no splits, no access-time updates) which tree nodes each will need and where they are now.
Every needed node gets the earliest queue position that needs it; a policy that uses the queue
(:class:`hiradix.core.policy.LookaheadPolicy`) ranks eviction candidates with it, and the requests
inside the prefetch window ``L_pw`` = free DRAM bytes / mean KV bytes per queued request
(capped by ``W``; both in pages) get their NVMe-only nodes read into DRAM ahead of admission.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from hiradix.core.hold_times import HoldTimes
from hiradix.core.node import Tier, TreeMatch, TreeNode
from hiradix.core.tree import TieredRadixTree


@dataclass(eq=False)
class QueuedKey:
    """A queued request's key and what its last peek matched, so the next step revalidates the
    matched path (O(nodes)) instead of matching the tokens again (O(tokens)).

    Attributes:
        tokens: token ids of the request's whole pages (not copied; must not change).
        namespace: see :meth:`TieredRadixTree.match`.
        nodes, matched_len: the last peek's path and length (``matched_len`` -1: never peeked).
    """

    tokens: Sequence[int]
    namespace: Optional[tuple] = None
    nodes: tuple = ()
    matched_len: int = -1
    wait_op: Optional[int] = None  # pseudo op id bounding this request's whole wait (ReadWaits.request_pending)
    holds: Optional[HoldTimes] = None  # how long admission held it, by cause (set at its first hold)


def peek(tree: TieredRadixTree, key: QueuedKey) -> TreeMatch:
    """Read-only match of ``key``; reuses its last peek while the tree did not change along it."""
    if key.matched_len >= 0 and tree.path_unchanged(key.nodes, key.tokens, key.matched_len, key.namespace):
        return tree.summarize(key.nodes, key.matched_len)
    m = tree.match(key.tokens, key.namespace, split=False, touch=False)
    key.nodes, key.matched_len = m.nodes, m.matched_len
    return m


@dataclass
class QueueView:
    """What the window saw in one scheduler step."""

    needed_at: dict[int, int] = field(default_factory=dict)  # node id -> earliest queue position
    prefetch: list[list[TreeNode]] = field(default_factory=list)  # NVMe-only nodes per request in L_pw
    window: int = 0  # requests inspected (<= W)
    prefetch_window: int = 0  # L_pw, in requests
    protected_nodes: int = 0  # distinct nodes some request in the window needs
    matches: list[TreeMatch] = field(default_factory=list)  # per inspected request, in queue order (peeks)


def plan(
    tree: TieredRadixTree,
    keys: Sequence[QueuedKey | tuple[Sequence[int], Optional[tuple]]],
    window: int,
    free_dram_pages: int,
) -> QueueView:
    """Inspect the first ``window`` queued requests.

    Args:
        tree: the tree (only peeked: nothing is split, nothing touched).
        keys: per queued request, in queue order: a :class:`QueuedKey` (its peek is reused
            from step to step) or ``(token ids, namespace)``.
        window: ``W``, at most this many requests are inspected (``--hiradix-lookahead-window``).
        free_dram_pages: free DRAM pages now. Redundant DRAM copies (the node is on another
            tier too) that no request in the window needs count as free as well: a prefetch
            may evict them (backups never block prefetch).

    Returns:
        The :class:`QueueView` of this step; ``L_pw`` = reclaimable DRAM pages / mean pages
        per inspected request (the paper's C_free / S_kv, both in pages), capped by ``W``.
    """
    view = QueueView()
    inspected = [k if isinstance(k, QueuedKey) else QueuedKey(*k) for k in keys[:window]]
    view.window = len(inspected)
    if not inspected:
        return view
    matches = [peek(tree, key) for key in inspected]
    view.matches = matches
    for pos, m in enumerate(matches):
        for node in m.nodes:
            view.needed_at.setdefault(node.id, pos)
    view.protected_nodes = len(view.needed_at)
    mean_pages = max(1.0, sum(len(k.tokens) for k in inspected) / len(inspected) / tree.page_size)
    enough = mean_pages * len(inspected)  # more reclaimable pages than this change nothing
    reclaimable = free_dram_pages
    if reclaimable < enough:
        for n in tree.candidates(Tier.DRAM):
            if n.num_local_tiers > 1 and n.id not in view.needed_at:
                reclaimable += len(n.dram_pages)
                if reclaimable >= enough:
                    break
    view.prefetch_window = min(len(inspected), int(reclaimable // mean_pages))
    for m in matches[: view.prefetch_window]:
        tail = [n for n in m.stage(Tier.NVME) if not n.in_tier(Tier.DRAM)]
        if tail:
            view.prefetch.append(tail)
    return view
