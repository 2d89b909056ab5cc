"""Eviction policies: a policy ranks nodes, the tree owns the eviction loop.

A policy is a strategy object with one method, ``priority(node, tier)``, returning a sort key;
the node with the smallest key is evicted (or demoted) first. The tree keeps the candidate
set, the heap walk, the lock counts and the accounting (mirrors the split in SGLang 0.5.23's
``sglang/srt/mem_cache/evict_policy.py`` + ``radix_cache.py::evict``).

Policies are looked up by name through :func:`make_policy`; an unknown name raises
``ValueError`` listing the supported ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from hiradix.tree import Tier, TreeNode


class EvictionPolicy(Protocol):
    """Ranks eviction candidates of one tier; smallest key goes first."""

    name: str

    def priority(self, node: TreeNode, tier: Tier) -> tuple:
        """Sort key of ``node`` as an eviction candidate in ``tier`` (smaller = evict sooner)."""
        ...


class LRUPolicy:
    """Least recently used first, as stock RadixAttention does (kept for A/B)."""

    name = "lru"

    def priority(self, node: TreeNode, tier: Tier) -> tuple:
        return (node.last_access_s, node.id)


class LookaheadPolicy:
    """Queue-aware order (CachedAttention §3.3): the scheduler's waiting queue decides.

    Nodes no queued request needs go first, least recently used first; nodes needed by a
    request inside the look-ahead window go last, and among them the one needed latest (the
    largest queue position) goes first. Protection is only a priority: when the allocator
    needs memory, needed nodes are still evicted (or demoted) after all the others.

    ``needed_at`` maps node id -> earliest queue position (0 = next to run) of a request in
    the window that needs the node; the scheduler hook replaces it every step
    (:meth:`update`).
    """

    name = "lookahead"

    def __init__(self) -> None:
        self.needed_at: dict[int, int] = {}

    def update(self, needed_at: dict[int, int]) -> None:
        """Replace the look-ahead view (node id -> earliest queue position)."""
        self.needed_at = needed_at

    def priority(self, node: TreeNode, tier: Tier) -> tuple:
        pos = self.needed_at.get(node.id)
        if pos is None:
            return (0, 0, node.last_access_s, node.id)
        return (1, -pos, node.last_access_s, node.id)


_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy, "lookahead": LookaheadPolicy}


def register_policy(name: str, factory: Callable[[], EvictionPolicy]) -> None:
    """Add a policy under ``name``. Raises ``ValueError`` if the name is taken."""
    if name in _POLICIES:
        raise ValueError(f"eviction policy {name!r} is already registered")
    _POLICIES[name] = factory


def make_policy(name: str) -> EvictionPolicy:
    """Build the policy registered as ``name``.

    Raises:
        ValueError: unknown name; the message lists the supported names.
    """
    try:
        return _POLICIES[name]()
    except KeyError:
        supported = ", ".join(sorted(_POLICIES))
        raise ValueError(f"unknown eviction policy {name!r}; supported: {supported}") from None


def policy_names() -> list[str]:
    """Names accepted by :func:`make_policy`."""
    return sorted(_POLICIES)
