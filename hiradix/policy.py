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


_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy}


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
