"""Counters of the DRAM/NVMe tiers since start (pure data; exported by ``hiradix.runtime.metrics``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from hiradix.core.hold_times import CAUSES as HOLD_CAUSES
from hiradix.core.ledger import Kind, TierBooks
from hiradix.core.node import Tier

PREFETCH_OUTCOMES = ("started", "completed", "failed", "used", "wasted")
STORAGE_HIT_READS = ("ahead", "at_admission")
STORE_OUTCOMES = ("used",)  # the store tier's other counts live in StoreTier.counts
READ_AHEAD_OUTCOMES = ("started", "used", "wasted")


@dataclass
class TierStats:
    """Counters since start; units in names.

    Attributes:
        bytes_moved: per transfer kind, bytes of pages that landed.
        transfers_failed: per kind, transfers with at least one failed page.
        prefetch_tokens: NVMe -> DRAM reads, in tokens: started, completed (landed in DRAM),
            failed, used (promoted to HBM for a request, whether the look-ahead window or a
            waiting request started the read), wasted (dropped from DRAM before any use; the
            ledger counts those, ``TierBooks.wasted_prefetch_tokens``).
        storage_hit_tokens: NVMe hits (tokens promoted to HBM from a DRAM copy read up from NVMe
            for that use) by who started the read: ``ahead`` (the look-ahead window, while the
            request was still queued) or ``at_admission`` (the request's own match at admission).
        store_tokens: tokens fetched from the cluster store that were promoted to HBM (used).
        read_ahead_tokens: reads for predicted returns (``hiradix.core.returns``), in tokens:
            started, used (a request loaded them from DRAM), wasted (left DRAM unused).
        admission_skips: times admission skipped a request waiting for its NVMe or store reads.
        admission_wait_s: seconds requests were held at admission, by cause
            (:mod:`hiradix.core.hold_times`); ``held_requests``: requests held at least once.
        streamed_tokens: tokens promoted to HBM while their request still waited for the rest of a
            history larger than DRAM (:mod:`hiradix.core.dram_stream`).
        restored_pages: NVMe pages re-indexed from the durable index at start.
    """

    bytes_moved: dict[str, int] = field(default_factory=lambda: {k.name: 0 for k in Kind})
    transfers_failed: dict[str, int] = field(default_factory=lambda: {k.name: 0 for k in Kind})
    prefetch_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PREFETCH_OUTCOMES, 0))
    storage_hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STORAGE_HIT_READS, 0))
    store_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STORE_OUTCOMES, 0))
    read_ahead_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(READ_AHEAD_OUTCOMES, 0))
    admission_skips: int = 0
    admission_wait_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(HOLD_CAUSES, 0.0))
    held_requests: int = 0
    streamed_tokens: int = 0
    restored_pages: int = 0

    def note_transfer(self, kind: Kind, pages: int, ok_pages: int, page_bytes: int, page_size: int) -> None:
        """A transfer of ``pages`` completed, ``ok_pages`` of them landed."""
        self.bytes_moved[kind.name] += ok_pages * page_bytes
        if ok_pages < pages:
            self.transfers_failed[kind.name] += 1
        if kind == Kind.PREFETCH:
            self.prefetch_tokens["completed"] += ok_pages * page_size
            self.prefetch_tokens["failed"] += (pages - ok_pages) * page_size

    def note_promoted(self, read_from_nvme: int, waited_from_nvme: int, read_from_store: int) -> None:
        """Tokens promoted to HBM whose DRAM copy was read up for this use: from NVMe (of them,
        ``waited_from_nvme`` waited for at admission, the rest read ahead) and from the store."""
        self.prefetch_tokens["used"] += read_from_nvme
        self.store_tokens["used"] += read_from_store
        self.storage_hit_tokens["ahead"] += read_from_nvme - waited_from_nvme
        self.storage_hit_tokens["at_admission"] += waited_from_nvme


def occupancy_line(tier_tokens: Sequence[int], books: TierBooks, stats: TierStats, store: Optional[Any],
                   deferred: Any) -> str:
    """One log line of tier occupancy and counters (``store``: the store tier or None;
    ``deferred``: the deferred backups)."""
    nvme = f"{books.nvme.num_used}/{books.nvme.capacity}" if books.nvme is not None else "off"
    inflight = {k.name: len(books.in_flight(k)) for k in Kind}
    store_state = "off" if store is None else ("on" if store.enabled else f"off ({store.off_reason})")
    return (
        f"tokens per tier HBM/DRAM/NVMe={list(tier_tokens[:3])} DRAM pages={books.dram.num_used}/{books.dram.capacity} "
        f"NVMe slots={nvme} store={store_state} store tokens={tier_tokens[Tier.STORE]} in-flight={inflight} "
        f"dropped tokens={books.dropped_tokens[:3]} failed={stats.transfers_failed} "
        f"deferred backups={deferred.deferred_nodes} (opened later {deferred.opened_nodes})"
    )
