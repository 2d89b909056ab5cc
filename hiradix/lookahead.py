"""The look-ahead window over the scheduler's waiting queue (CachedAttention §3.3).

Pure bookkeeping: given the token keys of the first ``W`` queued requests, find (read-only:
no splits, no access-time updates) which tree nodes each will need and where they are now.
Every needed node gets the earliest queue position that needs it; the ``lookahead`` policy
(:class:`hiradix.policy.LookaheadPolicy`) ranks eviction candidates with it, and the requests
inside the prefetch window ``L_pw`` = free DRAM bytes / mean KV bytes per queued request
(capped by ``W``) get their NVMe-only nodes read into DRAM ahead of admission.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from hiradix.tree import TieredRadixTree, Tier, TreeNode


@dataclass
class QueueView:
    """What the window saw in one scheduler step."""

    needed_at: dict[int, int] = field(default_factory=dict)  # node id -> earliest queue position
    prefetch: list[list[TreeNode]] = field(default_factory=list)  # NVMe-only nodes per request in L_pw
    window: int = 0  # requests inspected (<= W)
    prefetch_window: int = 0  # L_pw, in requests
    protected_nodes: int = 0  # distinct nodes some request in the window needs


def plan(
    tree: TieredRadixTree,
    keys: Sequence[tuple[Sequence[int], Optional[tuple]]],
    window: int,
    free_dram_bytes: int,
    kv_bytes_per_token: int,
) -> QueueView:
    """Inspect the first ``window`` queued requests.

    Args:
        tree: the tree (only peeked: nothing is split, nothing touched).
        keys: per queued request, in queue order: ``(token ids, namespace)``.
        window: ``W``, at most this many requests are inspected (``--hiradix-lookahead-window``).
        free_dram_bytes: DRAM bytes free now, for ``L_pw``.
        kv_bytes_per_token: KV bytes of one token across all layers (this rank).

    Returns:
        The :class:`QueueView` of this step.
    """
    view = QueueView()
    inspected = list(keys[:window])
    view.window = len(inspected)
    if not inspected:
        return view
    mean_tokens = sum(len(t) for t, _ in inspected) / len(inspected)
    mean_bytes = max(1.0, mean_tokens * kv_bytes_per_token)
    view.prefetch_window = min(len(inspected), int(free_dram_bytes // mean_bytes))
    for pos, (tokens, namespace) in enumerate(inspected):
        m = tree.match(tokens, namespace, split=False, touch=False)
        for node in m.nodes:
            view.needed_at.setdefault(node.id, pos)
        if pos < view.prefetch_window and m.nvme_len:
            skip = m.hbm_len + m.dram_len
            nodes, seen = [], 0
            for node in m.nodes:
                if seen >= skip and node.in_tier(Tier.NVME) and not node.in_tier(Tier.DRAM):
                    nodes.append(node)
                seen += node.num_tokens
            view.prefetch.append(nodes)
    view.protected_nodes = len(view.needed_at)
    return view
