"""The tier plan: every fact about the tiers of one server rank, resolved once at start (pure).

The assembly (:func:`hiradix.runtime.assembly.build_tiers`, or the simulator's
:func:`hiradix.testing.sim_ports.simulated_controller`) turns the flags, the KV layout and the
machine into one frozen :class:`TierPlan`; the controller, its links and the metrics read it and
never recompute a tier's size, page bytes, format or key prefix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hiradix.core.node import Tier
from hiradix.core.store_tier import STORE_RETRY_S, WRITE_POLICIES

EXACT = "exact"  # pages as the device holds them (a compressed tier names its codec instead)


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier below HBM as this rank uses it."""

    tier: Tier
    capacity_pages: int  # pages this rank's books hold (the store: 0, it is not sized here)
    page_bytes: int  # bytes of one page as stored in this tier (encoded in a compressed tier)
    page_format: str = EXACT  # EXACT or the cold codec's name (``--hiradix-cold-format``)
    reserved_bytes: int = 0  # host bytes this process reserves for it (0: another rank's copy, or none)
    key_prefix: Optional[str] = None  # the store's keys: the KV fingerprint (other tiers: None)

    def __post_init__(self) -> None:
        assert self.capacity_pages >= 0 and self.page_bytes > 0, self
        assert (self.key_prefix is not None) == (self.tier == Tier.STORE), self


@dataclass(frozen=True, slots=True)
class TierPlan:
    """The tiers of one TP rank and the policies that move pages between them.

    ``nvme`` / ``store`` are None when the tier is off. Policies: ``write_through`` backs up to
    DRAM at insert (else at HBM eviction); ``write_selective`` (the simulator only: SGLang
    HiCache's ``write_through_selective``) backs up only nodes hit again; ``dram_staging``
    (``--hiradix-dram-mode staging``) keeps a DRAM copy only while it is in flight between HBM and
    NVMe; ``dram_free_low_pages`` (None: ``placement.DRAM_FREE_LOW`` of DRAM) is the free room
    DRAM keeps; ``store_write_policy``, ``store_read`` and ``store_retry_s`` are the cluster
    store's (:mod:`hiradix.core.store_tier`, :mod:`hiradix.core.store_reads`); ``stop_timeout_s``
    is how long a graceful stop waits for writes in flight.
    """

    hbm_page_bytes: int  # one device page, all layers, K and V
    dram: TierSpec
    nvme: Optional[TierSpec] = None
    store: Optional[TierSpec] = None
    write_through: bool = True
    write_selective: bool = False
    dram_staging: bool = False
    dram_free_low_pages: Optional[int] = None
    store_write_policy: str = "write_through"
    store_read: str = "always"
    store_retry_s: float = STORE_RETRY_S
    stop_timeout_s: float = 0.0

    def __post_init__(self) -> None:
        assert self.hbm_page_bytes > 0, self
        assert self.dram.tier == Tier.DRAM, self.dram
        assert self.nvme is None or self.nvme.tier == Tier.NVME, self.nvme
        assert self.store is None or self.store.tier == Tier.STORE, self.store
        assert self.store_write_policy in WRITE_POLICIES, self.store_write_policy

    @property
    def nvme_slots(self) -> int:
        return self.nvme.capacity_pages if self.nvme is not None else 0

    @property
    def store_key_prefix(self) -> Optional[str]:
        return self.store.key_prefix if self.store is not None else None

    @property
    def page_bytes_by_tier(self) -> tuple[int, int, int, int]:
        """Bytes of one page in each tier, in :class:`Tier` order (an absent tier: HBM's)."""
        return (self.hbm_page_bytes, self.dram.page_bytes,
                self.nvme.page_bytes if self.nvme is not None else self.hbm_page_bytes,
                self.store.page_bytes if self.store is not None else self.hbm_page_bytes)

    @property
    def reserved_bytes(self) -> tuple[int, int]:
        """Host bytes (DRAM, NVMe) this process reserves for its tiers."""
        return self.dram.reserved_bytes, self.nvme.reserved_bytes if self.nvme is not None else 0

    @classmethod
    def uniform(cls, page_bytes: int, dram_pages: int, nvme_slots: int = 0, store_key_prefix: Optional[str] = None,
                **policies) -> "TierPlan":
        """A plan whose tiers all hold exact pages of ``page_bytes`` (the simulator, tests);
        ``policies``: the other :class:`TierPlan` fields."""
        return cls(page_bytes, TierSpec(Tier.DRAM, dram_pages, page_bytes),
                   TierSpec(Tier.NVME, nvme_slots, page_bytes) if nvme_slots else None,
                   TierSpec(Tier.STORE, 0, page_bytes, key_prefix=store_key_prefix) if store_key_prefix else None,
                   **policies)
