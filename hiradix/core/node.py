"""The records of the tiered radix tree: tiers, nodes, match results (pure data).

Every node records which tiers hold its KV (CachedAttention, USENIX ATC '24, §3):

* ``hbm_slots``  -- token slot ids in SGLang's device KV pool, shape ``(num_tokens,)``;
* ``dram_pages`` -- DRAM page ids, one per page;
* ``nvme_slots`` -- NVMe slot ids, one per page;
* ``store_keys`` -- keys of the page objects in the cluster store, one per page (content
  addresses: the page-hash chain of the prefix, the namespace and the KV fingerprint).

A store copy is a hint: the store may drop an object at any time (its own eviction, a holder
or master restart), so a store record is confirmed only by a read that verifies.

The tree (:mod:`hiradix.core.tree`) and the ledger (:mod:`hiradix.core.ledger`) are the only
writers of these fields.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Optional


class Tier(IntEnum):
    """Storage tiers, fastest first."""

    HBM = 0
    DRAM = 1
    NVME = 2
    STORE = 3  # the cluster store shared by the servers (Mooncake Store)


NUM_TIERS = len(Tier)
LOCAL_TIERS = (Tier.HBM, Tier.DRAM, Tier.NVME)  # this server's own tiers


class IntegrityError(AssertionError):
    """Raised by the ``check_integrity`` methods when an invariant is broken."""


def require(ok: bool, message: str) -> None:
    """Raise :class:`IntegrityError` with ``message`` unless ``ok``."""
    if not ok:
        raise IntegrityError(message)


@dataclass(slots=True, eq=False)
class TreeNode:
    """One edge of the radix tree with the KV records of its tokens.

    Every field is mutated only by :class:`hiradix.core.tree.TieredRadixTree` and
    :class:`hiradix.core.ledger.TierBooks`.
    """

    id: int  # from the tree's own counter; stable for the node's lifetime
    parent: Optional[TreeNode]  # None for the root and for deleted nodes
    tokens: array  # token ids of this edge, array('q'); len is a multiple of page_size
    namespace: Optional[tuple]  # (extra_key, cache_salt) or None; same along a path
    children: dict = field(default_factory=dict)  # first-page key -> TreeNode
    hbm_slots: Optional[Any] = None  # Shape (num_tokens,) int64 device slot ids, or None
    dram_pages: Optional[list[int]] = None  # one DRAM page id per page, or None
    nvme_slots: Optional[list[int]] = None  # one NVMe slot id per page, or None
    store_keys: Optional[list[str]] = None  # one cluster-store key per page, or None
    lock_ref: int = 0  # running requests whose prefix passes through here (HBM pin)
    ops: set = field(default_factory=set)  # ids of in-flight transfers touching this node
    pinned: list = field(default_factory=lambda: [0] * NUM_TIERS)  # per tier: in-flight transfers using that copy
    last_access_s: float = 0.0  # monotonic seconds of the last match/insert touching it
    hit_count: int = 0  # times a request other than the inserter reused it
    dram_from: Optional[Tier] = None  # NVME or STORE: the DRAM copy was read from there, not promoted since
    waited_for_read: bool = False  # ...and a request waited at admission for that read (not read ahead)
    # hiradix.persistence: hash of the prefix through this node's last page, cached; a split
    # leaves it on the lower node (same last page) and not on the new upper one.
    chain_hash: Optional[bytes] = None
    # The eviction policy's own record of this node (hiradix.core.policy); a split copies it to
    # the new upper node.
    policy_stamp: Any = None
    # hiradix.core.kv_events (only with KV events on): the key of each page, cached; a split
    # shares them out like the tiers' ids.
    event_keys: Optional[list] = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def alive(self) -> bool:
        return self.parent is not None

    def ids_in(self, tier: Tier) -> Optional[Any]:
        """Ids of this node's copy in ``tier``: HBM token slots, DRAM pages, NVMe slots or store keys."""
        if tier == Tier.HBM:
            return self.hbm_slots
        if tier == Tier.DRAM:
            return self.dram_pages
        return self.nvme_slots if tier == Tier.NVME else self.store_keys

    def in_tier(self, tier: Tier) -> bool:
        return self.ids_in(tier) is not None

    def tiers(self) -> list[Tier]:
        """The tiers holding this node's KV, fastest first."""
        out = []
        if self.hbm_slots is not None:
            out.append(Tier.HBM)
        if self.dram_pages is not None:
            out.append(Tier.DRAM)
        if self.nvme_slots is not None:
            out.append(Tier.NVME)
        if self.store_keys is not None:
            out.append(Tier.STORE)
        return out

    @property
    def num_tiers(self) -> int:
        """How many tiers hold this node's KV (0 only for the root)."""
        return ((self.hbm_slots is not None) + (self.dram_pages is not None) + (self.nvme_slots is not None)
                + (self.store_keys is not None))

    @property
    def num_local_tiers(self) -> int:
        """How many of this server's own tiers (HBM, DRAM, NVMe) hold its KV; a store copy is
        only a hint (the store may have dropped it), so it never makes a local copy redundant."""
        return (self.hbm_slots is not None) + (self.dram_pages is not None) + (self.nvme_slots is not None)

    def sole_tier(self) -> Optional[Tier]:
        """The tier holding this node's last copy: its one local tier (the store may hold it too:
        a store copy is only a hint), STORE when only the store holds it, else None."""
        local = [t for t in self.tiers() if t != Tier.STORE]
        if len(local) == 1:
            return local[0]
        return Tier.STORE if not local and self.store_keys is not None else None

    @property
    def dram_from_nvme(self) -> bool:
        """The DRAM copy was read from NVMe (and not promoted to HBM since)."""
        return self.dram_from == Tier.NVME

    def __repr__(self) -> str:
        tiers = "".join(t.name[0] for t in self.tiers())
        return f"TreeNode(id={self.id}, tokens={self.num_tokens}, tiers={tiers}, lock={self.lock_ref}, pinned={self.pinned})"


@dataclass(frozen=True, slots=True)
class TreeMatch:
    """Result of :meth:`hiradix.core.tree.TieredRadixTree.match`, in tokens.

    ``hbm_len`` tokens are in HBM along the path to ``hbm_node``; the following ``dram_len``
    tokens are in DRAM (loadable to HBM) up to ``dram_node``; then ``nvme_len`` tokens on NVMe
    (to be read into DRAM first) up to ``nvme_node``; then ``store_len`` tokens only in the
    cluster store up to ``store_node``. ``nodes`` is the matched path; ``matched_len`` all of it
    (the match may stop at a node no tier serves in order, e.g. store-only above NVMe).
    """

    hbm_len: int
    hbm_node: TreeNode
    dram_len: int
    dram_node: TreeNode
    nvme_len: int
    nvme_node: TreeNode
    nodes: tuple[TreeNode, ...]
    last_node: TreeNode  # deepest matched node (may extend past the match in a peek)
    store_len: int = 0
    store_node: Optional[TreeNode] = None
    matched_len: int = 0  # tokens of the whole matched path (>= the four lengths' sum)

    @property
    def cached_len(self) -> int:
        """Tokens served from some tier, in tier order (HBM + DRAM + NVMe + store)."""
        return self.hbm_len + self.dram_len + self.nvme_len + self.store_len

    def length(self, tier: Tier) -> int:
        return (self.hbm_len, self.dram_len, self.nvme_len, self.store_len)[tier]

    def stage(self, tier: Tier) -> list[TreeNode]:
        """Matched nodes served from ``tier``: HBM first, then DRAM, NVMe, the store."""
        start = sum(self.length(t) for t in Tier if t < tier)
        end = start + self.length(tier)
        out, pos = [], 0
        for node in self.nodes:
            if start <= pos < end:
                out.append(node)
            pos += node.num_tokens
        return out
