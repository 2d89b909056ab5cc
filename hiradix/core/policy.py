"""Eviction policies and their registry: a policy ranks nodes, the tree owns the loops.

A policy is a strategy object with one required method, ``priority(node, tier)``, returning a
sort key; the candidate with the smallest key is evicted (or demoted) first. The tree keeps the
candidate sets, the heap walk, the lock counts and the accounting (the split of SGLang 0.5.23's
``sglang/srt/mem_cache/evict_policy.py`` + ``radix_cache.py::evict``).

A policy may observe more than the candidates, through a small set of optional hooks, each
switched on by a class attribute (the callers test the attribute, never the class):

* ``uses_queue``: each scheduler step the prefix cache plans the look-ahead window
  (:func:`hiradix.core.lookahead.plan`) and hands the view to :meth:`EvictionPolicy.observe_queue`;
* ``uses_history``: the prefix cache reports every insert of a request's KV
  (:meth:`EvictionPolicy.observe_insert`: the path, how much of it the request found cached)
  and the time each step (:meth:`EvictionPolicy.observe_step`); the tree reports every node that
  leaves the last tier holding it (:meth:`EvictionPolicy.observe_delete`);
* ``reads_ahead``: the prefix cache reads the nodes the policy ranks above what DRAM holds from
  NVMe (or the cluster store) into DRAM before any request asks for them
  (:mod:`hiradix.core.returns`), with the policy's key as the ranking, among the nodes
  :meth:`EvictionPolicy.worth_reading` accepts.

A policy never moves or drops anything itself. A policy may keep a record per node in
``TreeNode.policy_stamp`` (the tree copies it to the upper node of a split, nothing else
touches it).

Policies are registered by name (:func:`register_policy`) and built by :func:`make_policy`; an
unknown name raises ``ValueError`` listing the registered ones. The flag
``--hiradix-policy`` accepts exactly :func:`policy_names`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:
    from hiradix.core.lookahead import QueueView
    from hiradix.core.node import Tier, TreeNode

MAX_LOWERED = 4096  # nodes with a lowered key listed between evictions; beyond: re-rank all


class EvictionPolicy:
    """Ranks eviction candidates of one tier; the smallest key goes first.

    Attributes:
        name: the registry name (``--hiradix-policy``).
        uses_queue: plan the look-ahead window each step and call :meth:`observe_queue`.
        uses_history: call :meth:`observe_insert`, :meth:`observe_delete` and :meth:`observe_step`.
        reads_ahead: read the nodes this policy ranks above DRAM's into DRAM ahead of any request.
        clock_per_process: its order depends on ages read from this process's clock, so TP ranks
            (each its own process) could evict differently: the plugin refuses it with TP > 1.
        keys_grow: a node's key only grows (a touch, a protection), except for the nodes
            :meth:`take_lowered` returns: the tree then keeps its HBM candidates in a heap between
            evictions (:mod:`hiradix.core.victim_heap`) instead of ranking all of them each time.
    """

    name: str = ""
    uses_queue: bool = False
    uses_history: bool = False
    reads_ahead: bool = False
    clock_per_process: bool = False
    keys_grow: bool = False

    def priority(self, node: TreeNode, tier: Tier) -> tuple:
        """Sort key of ``node`` as an eviction candidate in ``tier`` (smaller = evict sooner)."""
        raise NotImplementedError

    def observe_queue(self, view: QueueView) -> None:
        """What the look-ahead window saw this step (called only when ``uses_queue``)."""

    def take_lowered(self) -> Optional[list[TreeNode]]:
        """The nodes whose key went down since the last call (only when ``keys_grow``), and
        forget them; None when there were too many to list (the caller re-ranks everything)."""
        return []

    def observe_insert(self, path: Sequence[TreeNode], reused_tokens: Optional[int], now_s: float) -> None:
        """A request's KV was inserted (called only when ``uses_history``).

        Args:
            path: the nodes of its key, root's child first, down to the last inserted node.
            reused_tokens: tokens at the start of ``path`` the request found cached (its hit);
                None when the same request inserted this key before (a later chunk or its output).
            now_s: the tree's clock, in seconds.
        """

    def observe_delete(self, node: TreeNode, now_s: float) -> None:
        """``node`` left the last tier that held it (called by the tree, only when ``uses_history``)."""

    def observe_step(self, now_s: float) -> None:
        """A scheduler step at ``now_s`` seconds (called only when ``uses_history``)."""

    def worth_reading(self, node: TreeNode) -> bool:
        """Whether a read ahead of ``node``'s prefix may pay at all (only when ``reads_ahead``)."""
        return False

    def describe(self) -> dict:
        """What the policy has learned, JSON-ready, for logs and the simulator (empty: nothing)."""
        return {}


class LRUPolicy(EvictionPolicy):
    """Least recently used first, as stock RadixAttention does (kept for A/B)."""

    name = "lru"
    keys_grow = True  # (last access, id): a touch only makes a node more recent

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
    keys_grow = True  # protection raises a key; a request leaving the window lowers it: reported

    def __init__(self) -> None:
        self.needed_at: dict[int, int] = {}
        self._view: Optional[QueueView] = None  # the last view (its matches hold the needed nodes)
        self._lowered: Optional[list[TreeNode]] = []  # keys gone down since take_lowered; None: too many

    def observe_queue(self, view: QueueView) -> None:
        """Take this step's look-ahead view (node id -> earliest queue position); with
        ``keys_grow``, note the nodes that lost their protection or moved back in the queue (their
        key went down)."""
        old, old_view = self.needed_at, self._view
        self.needed_at, self._view = view.needed_at, view
        if not self.keys_grow or self._lowered is None or old_view is None:
            return
        lowered = {i for i, pos in old.items() if view.needed_at.get(i, pos + 1) > pos}
        if lowered:
            self._lowered.extend({n.id: n for m in old_view.matches for n in m.nodes if n.id in lowered}.values())
        if len(self._lowered) > MAX_LOWERED:
            self._lowered = None

    def take_lowered(self) -> Optional[list[TreeNode]]:
        lowered, self._lowered = self._lowered, []
        return lowered

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


def _predictive() -> EvictionPolicy:
    from hiradix.core.predict import PredictivePolicy  # imports this module: built lazily

    return PredictivePolicy()


register_policy(LRUPolicy.name, LRUPolicy)
register_policy(LookaheadPolicy.name, LookaheadPolicy)
register_policy("predictive", _predictive)
