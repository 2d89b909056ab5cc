"""The typed ports through which the pure core talks to data movement and to the other ranks.

The core (tree, ledger, placement, controller, prefix cache) never touches bytes, files,
sockets or collectives; it calls these interfaces with page ids and job ids only. Real
implementations live outside the core, data-less ones for the simulator in
:mod:`hiradix.testing.sim_ports`:

============== ======================================================== ==============================================
port           real implementation                                      data-less implementation
============== ======================================================== ==============================================
DevicePool     ``hiradix.sglang_plugin.cache`` (SGLang's KV allocator)  ``hiradix.testing.sim_ports.SimDevicePool``
HostMover      ``hiradix.dataplane.movers.HostMover``                   ``hiradix.testing.sim_ports.SimHostMover``
IOClient       ``hiradix.io.client.IOWorkerClient``                     ``hiradix.testing.sim_ports.SimIOClient``
NvmeJournal    ``hiradix.persistence.journal.IndexJournal``             none (nothing persisted)
RankAgreement  ``hiradix.runtime.rank_sync.RankSync``                   :class:`SingleRank`
============== ======================================================== ==============================================

The model is vLLM's ``v1/kv_offload`` split (``OffloadingManager`` keeps books,
``OffloadingWorker`` moves bytes, a ``LoadStoreSpec`` of ids crosses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

if TYPE_CHECKING:
    from hiradix.core.ledger import Transfer
    from hiradix.core.node import TreeNode

# Device slot ids: an int64 torch tensor in the server, a list of int in the simulator.
Slots = Any

# Outcome of an asynchronous transfer, as the ranks exchange it (MIN over ranks gives the
# outcome every rank agrees on): FAILED < ABORTED < OK; NOT_DONE if any rank has not finished.
NOT_DONE, FAILED, ABORTED, OK = 0, 1, 2, 3

# Priorities of NVMe reads (``IOClient.submit_load``), most urgent first: a request at admission
# waits for it; a queued request will (the look-ahead window); a predicted return (no request yet).
# Writes run behind all reads of the first two kinds.
READ_AT_ADMISSION, READ_QUEUED, READ_BACKGROUND = 0, 1, 2


class DevicePool(Protocol):
    """SGLang's paged device KV allocator, as the prefix cache uses it (units: tokens)."""

    def available_size(self) -> int:
        """Free device slots, in tokens."""
        ...

    def alloc(self, num_tokens: int) -> Optional[Slots]:
        """``num_tokens`` slots (whole pages), shape ``(num_tokens,)``, or None when too few are free."""
        ...

    def free(self, slots: Slots) -> None:
        """Return whole pages of slots."""
        ...

    def concat(self, parts: Sequence[Slots]) -> Slots:
        """One slot array made of ``parts`` in order (empty parts allowed)."""
        ...


class HostMover(Protocol):
    """Carries out BACKUP (HBM -> DRAM) and PROMOTE (DRAM -> HBM) transfers in this process."""

    def backup(self, op: Transfer) -> None:
        """Start copying ``op.hbm_parts`` into DRAM pages ``op.dst_ids``."""
        ...

    def promote(self, op: Transfer) -> None:
        """Queue the copy of DRAM pages ``op.src_ids`` into ``op.hbm_parts`` (layer by layer)."""
        ...

    def start_loading(self) -> int:
        """Start the promotions queued for the batch being built; returns its consumer index."""
        ...

    def finished(self) -> list[int]:
        """Op ids of copies that have fully landed since the last call."""
        ...

    def flush(self) -> list[int]:
        """Finish every pending copy now; returns the op ids that completed."""
        ...

    def drop_pending(self) -> None:
        """Forget pending copies (after :meth:`flush`, on reset)."""
        ...


class JobResult(Protocol):
    """A finished I/O job: one flag per page in the job's order; ``error`` set when it failed whole."""

    job_id: int
    ok: Sequence[bool]
    error: str


class IOClient(Protocol):
    """Carries out DEMOTE (DRAM -> NVMe) and PREFETCH (NVMe -> DRAM) jobs, and the cluster
    store's PUT (DRAM -> store), GET (store -> DRAM) and exists queries.

    Every submitted job yields exactly one :class:`JobResult` from :meth:`poll` or :meth:`wait`.
    """

    disabled: bool  # True once the I/O side gave up (its jobs then fail at once)

    def submit_store(self, job_id: int, dram_pages: Sequence[int], nvme_slots: Sequence[int]) -> None:
        """Queue a copy of DRAM pages into NVMe slots (pairwise, in order)."""
        ...

    def submit_load(self, job_id: int, nvme_slots: Sequence[int], dram_pages: Sequence[int],
                    priority: int = READ_AT_ADMISSION) -> None:
        """Queue a read of NVMe slots into DRAM pages (pairwise, in order; checksums verified).
        Reads of a smaller ``priority`` run first; writes after reads of ``READ_QUEUED`` or less."""
        ...

    def submit_put(self, job_id: int, dram_pages: Sequence[int], keys: Sequence[str]) -> None:
        """Queue a copy of DRAM pages into the cluster store under ``keys`` (pairwise, in order)."""
        ...

    def submit_get(self, job_id: int, keys: Sequence[str], dram_pages: Sequence[int],
                   priority: int = READ_AT_ADMISSION) -> None:
        """Queue a read of store objects into DRAM pages (pairwise; checksums verified). Lookups
        run first, then GETs of a smaller ``priority``, then PUTs."""
        ...

    def submit_exists(self, job_id: int, keys: Sequence[str]) -> None:
        """Queue a query: which of ``keys`` the store holds (one flag per key; a hint)."""
        ...

    def poll(self) -> list[JobResult]:
        """Results that have arrived; never blocks."""
        ...

    def wait(self, timeout_s: float, wake: Sequence[Any] = ()) -> list[JobResult]:
        """Block until a result arrives, one of the ``wake`` sockets (zmq sockets or file
        descriptors the caller also serves) is readable, or ``timeout_s`` seconds pass."""
        ...

    def check_alive(self) -> bool:
        """Whether the I/O side is alive (it may be restarted here; its jobs then fail)."""
        ...

    def close(self) -> None:
        """Stop the I/O side."""
        ...


class NvmeJournal(Protocol):
    """The durable NVMe index, as the ledger and the controller report to it.

    Attributes:
        landed: nodes whose NVMe copy landed since the controller last went through them.
    """

    landed: list[TreeNode]

    def invalidate(self, slots: Sequence[int]) -> None:
        """These slots hold nothing valid any more (before they are rewritten or when freed)."""
        ...

    def stored(self, node: TreeNode, slots: Sequence[int]) -> None:
        """``node``'s pages landed in ``slots`` (verified)."""
        ...

    def sync(self) -> None:
        """Make the records so far durable (may be rate-limited)."""
        ...

    def durable_pages(self, slots: Optional[Sequence[int]] = None) -> Optional[int]:
        """How many of ``slots`` (None: of all) the durable index lists now (a landed page waits
        until its parent page is listed); None where this rank keeps no index of its own."""
        ...


@dataclass(frozen=True)
class StepVotes:
    """This rank's view of the two switches a rank-local signal flips, which every TP rank must
    flip in the same step (else their books split and the next agreement refuses).

    Attributes:
        io_gave_up: this rank's I/O client gave up (its worker kept dying). Agreed if *any* rank's
            did: every rank then switches NVMe (and the store) off, the rank whose worker lives too.
        store_retry_due: the store is off and this rank's wait before trying it again is over
            (:meth:`hiradix.core.store_tier.StoreTier.retry_due`, on this rank's clock). Agreed
            only if *every* rank's is: the wait is a lower bound, so no rank retries early.
    """

    io_gave_up: bool = False
    store_retry_due: bool = False


class RankAgreement(Protocol):
    """Makes every TP rank apply the same asynchronous outcomes, and flip the same switches, in
    the same step."""

    size: int  # number of ranks

    def agree(self, in_flight: list[int], local: dict[int, int], expired: set[int],
              votes: StepVotes = StepVotes()) -> tuple[dict[int, int], set[int], StepVotes]:
        """``(finished, expired, votes)``: ops finished on every rank with their worst outcome, ops
        whose deadline passed on any rank, and the agreed :class:`StepVotes`. ``in_flight`` is
        ascending and equal on all ranks."""
        ...


class SingleRank:
    """:class:`RankAgreement` for one rank: what this rank saw is what every rank saw."""

    size = 1

    def agree(self, in_flight: list[int], local: dict[int, int], expired: set[int],
              votes: StepVotes = StepVotes()) -> tuple[dict[int, int], set[int], StepVotes]:
        return dict(local), set(expired), votes
