"""Eviction policies and their registry: a policy ranks nodes, the tree owns the loops.

A policy is a strategy object with one required method, ``priority(node, tier)``, returning a
sort key; the candidate with the smallest key is evicted (or demoted) first. The tree keeps the
candidate sets, the heap walk, the lock counts and the accounting (the split of SGLang 0.5.23's
``sglang/srt/mem_cache/evict_policy.py`` + ``radix_cache.py::evict``).

A policy that wants to see the waiting queue sets ``uses_queue = True``: each scheduler step the
prefix cache then plans the look-ahead window (:func:`hiradix.core.lookahead.plan`) and hands
the view to :meth:`EvictionPolicy.observe_queue`. That is the only hook; a policy never moves
or drops anything itself.

Policies are registered by name (:func:`register_policy`) and built by :func:`make_policy`; an
unknown name raises ``ValueError`` listing the registered ones. The flag
``--hiradix-policy`` accepts exactly :func:`policy_names`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from hiradix.core.lookahead import QueueView
    from hiradix.core.node import Tier, TreeNode


class EvictionPolicy:
    """Ranks eviction candidates of one tier; the smallest key goes first.

    Attributes:
        name: the registry name (``--hiradix-policy``).
        uses_queue: plan the look-ahead window each step and call :meth:`observe_queue`.
    """

    name: str = ""
    uses_queue: bool = False

    def priority(self, node: TreeNode, tier: Tier) -> tuple:
        """Sort key of ``node`` as an eviction candidate in ``tier`` (smaller = evict sooner)."""
        raise NotImplementedError

    def observe_queue(self, view: QueueView) -> None:
        """What the look-ahead window saw this step (called only when ``uses_queue``)."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first, as stock RadixAttention does (kept for A/B)."""

    name = "lru"

    def priority(self, node: TreeNode, tier: Tier) -> tuple:
        return (node.last_access_s, node.id)


class LookaheadPolicy(EvictionPolicy):
    """Queue-aware order (CachedAttention §3.3): the scheduler's waiting queue decides.

    Nodes no queued request needs go first, least recently used first; nodes needed by a
    request inside the look-ahead window go last, and among them the one needed latest (the
    largest queue position) goes first. Protection is only a priority: when the allocator
    needs memory, needed nodes are still evicted (or demoted) after all the others.

    ``needed_at`` maps node id -> earliest queue position (0 = next to run) of a request in
    the window that needs the node; it is replaced every step (:meth:`observe_queue`).
    """

    name = "lookahead"
    uses_queue = True

    def __init__(self) -> None:
        self.needed_at: dict[int, int] = {}

    def observe_queue(self, view: QueueView) -> None:
        """Take this step's look-ahead view (node id -> earliest queue position)."""
        self.needed_at = view.needed_at

    def priority(self, node: TreeNode, tier: Tier) -> tuple:
        pos = self.needed_at.get(node.id)
        if pos is None:
            return (0, 0, node.last_access_s, node.id)
        return (1, -pos, node.last_access_s, node.id)


_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {}


def register_policy(name: str, factory: Callable[[], EvictionPolicy]) -> None:
    """Add a policy under ``name``.

    Raises:
        ValueError: the name is taken or empty.
    """
    if not name:
        raise ValueError("a policy needs a name")
    if name in _POLICIES:
        raise ValueError(f"eviction policy {name!r} is already registered")
    _POLICIES[name] = factory


def make_policy(name: str) -> EvictionPolicy:
    """Build the policy registered as ``name``.

    Raises:
        ValueError: unknown name; the message lists the registered names.
    """
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; registered: {', '.join(policy_names())}") from None


def policy_names() -> list[str]:
    """Names accepted by :func:`make_policy`, in registration order."""
    return list(_POLICIES)


register_policy(LRUPolicy.name, LRUPolicy)
register_policy(LookaheadPolicy.name, LookaheadPolicy)
