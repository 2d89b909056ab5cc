"""One host copy per node for MLA under tensor parallelism (issue 18, item 1).

Every TP rank of an MLA model holds the same latent rows (``kv_a_proj_with_mqa`` is replicated),
so one DRAM pool and one NVMe tier per node hold what every rank needs. Rank 0 of the TP group
(the *owner*) creates the DRAM pool in anonymous shared memory and does every write into it and
every transfer below it: HBM -> DRAM backups from its own device pool, DRAM <-> NVMe through its
I/O worker, the cluster store's PUT/GET/exists. The other ranks (*replicas*) map the owner's pool
(``/proc/<owner pid>/fd/<memfd>``, :meth:`hiradix.tiers.dram.DramPool.attach`) and only read it,
to promote pages DRAM -> HBM into their own device pools; they keep identical books
(:class:`hiradix.core.ledger.TierBooks`: same page ids, same NVMe slot ids) because every rank
takes the same decisions and applies only outcomes agreed by
:class:`hiradix.runtime.rank_sync.RankSync` (MIN over ranks), so a replica completes its share of a
transfer at once (:class:`ReplicaIOClient`, ``HostMover(writes_dram=False)``) and the owner's
outcome is the one applied. A page is read by a replica only once the owner's write landed (the
agreed completion), and freed only when no rank uses it (the same books).

Saved: (TP - 1) / TP of the host copy (1/2 at TP 2, 7/8 at TP 8) and of the NVMe bytes.
SGLang's HiCache keeps one host copy per rank (``mem_cache/pool_host/mla.py``) and one storage
writer (``mem_cache/hicache_storage.py``). Ranks on different hosts (multi-node TP) keep one copy
per rank, as do ranks that cannot map the owner's pool (then with one warning);
``--hiradix-mla-host-copy rank`` asks for per-rank copies (for measurements).
"""

from __future__ import annotations

import logging
import socket
from collections import deque
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from hiradix.core.node import TreeNode
from hiradix.dataplane.layout import KVLayout
from hiradix.io.protocol import JobDone
from hiradix.tiers.dram import DramPool

logger = logging.getLogger(__name__)

OWNER_RANK = 0  # rank in the TP group that owns the node's host copy


def _host_id() -> str:
    """This machine: host name and boot id (two containers may share a host name)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def wants_shared_copy(layout: KVLayout, tp_group: Optional[Any], mode: str = "node") -> bool:
    """Whether the ranks of ``tp_group`` share one host copy: an MLA layout, more than one rank,
    ``mode`` "node" (``--hiradix-mla-host-copy``, the same on every rank) and every rank on this host.

    A collective on ``tp_group`` (every rank must call it) when it may share.
    """
    if not layout.is_mla or tp_group is None or torch.distributed.get_world_size(tp_group) < 2:
        return False
    if mode != "node":
        logger.info("hiradix: --hiradix-mla-host-copy %s: one MLA host copy per TP rank", mode)
        return False
    hosts: list[Any] = [None] * torch.distributed.get_world_size(tp_group)
    torch.distributed.all_gather_object(hosts, _host_id(), group=tp_group)
    if len(set(hosts)) > 1:
        logger.info("hiradix: TP ranks on %d hosts: one MLA host copy per rank", len(set(hosts)))
        return False
    return True


def _all_ranks(flag: bool, tp_group: Any) -> bool:
    """True when ``flag`` holds on every rank of ``tp_group`` (a MIN all-reduce)."""
    value = torch.tensor([1 if flag else 0], dtype=torch.int64)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=tp_group)
    return bool(int(value[0]))


def shared_dram_pool(layout: KVLayout, num_pages: int, tp_rank: int, tp_group: Any,
                     page_bytes: int | None = None) -> tuple[DramPool, bool]:
    """The node's DRAM pool: created by the owner rank, mapped by the others (``page_bytes``: of
    encoded pages, DRAM as a cold tier; None: the layout's).

    A collective on ``tp_group``: every rank calls it, after :func:`wants_shared_copy` said yes.

    Returns:
        ``(pool, shared)``: ``shared`` False when a rank could not map the owner's pool; every
        rank then has a pool of its own (the owner keeps the one it made), and says so once.

    Raises:
        OSError: the owner cannot reserve the pool's memory (as ``DramPool.create_anonymous``).
    """
    owner = tp_rank == OWNER_RANK
    pool = DramPool.create_anonymous(layout, num_pages, page_bytes=page_bytes) if owner else None
    where: list[Any] = [str(pool.path) if pool is not None else None]
    torch.distributed.broadcast_object_list(where, group=tp_group, group_src=OWNER_RANK)
    error = ""
    if not owner:
        try:
            pool = DramPool.attach(Path(where[0]), layout, num_pages, page_bytes=page_bytes)
        except (OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
    if _all_ranks(not error, tp_group):
        if not owner:
            logger.info("hiradix: TP rank %d maps rank %d's DRAM pool %s (one MLA host copy per node)",
                        tp_rank, OWNER_RANK, where[0])
        return pool, True
    if error:
        logger.warning("hiradix: TP rank %d cannot map rank %d's DRAM pool %s (%s): one copy per rank",
                       tp_rank, OWNER_RANK, where[0], error)
    if pool is not None and not owner:
        pool.close()
    return (pool if owner else DramPool.create_anonymous(layout, num_pages, page_bytes=page_bytes)), False


def share_persisted_pages(pages: list, tp_rank: int, tp_group: Any) -> list:
    """The owner's re-indexed NVMe pages, for every rank (a broadcast on ``tp_group``): the
    replicas restore the same nodes into their trees, so the ranks' books start equal."""
    box: list[Any] = [pages if tp_rank == OWNER_RANK else None]
    torch.distributed.broadcast_object_list(box, group=tp_group, group_src=OWNER_RANK)
    return list(box[0] or [])


class ReplicaIOClient:
    """The :class:`hiradix.core.ports.IOClient` of a replica rank: the owner rank's I/O worker
    moves the node's pages, so every job here completes at once, with every page OK.

    The outcome applied is the owner's: :class:`hiradix.runtime.rank_sync.RankSync` takes the
    MIN over ranks (a failed or aborted job on the owner wins over this OK), and a store lookup
    answering "all found" here yields the owner's leading run of found keys.
    """

    disabled = False

    def __init__(self) -> None:
        self._done: deque[JobDone] = deque()

    def _complete(self, job_id: int, n: int) -> None:
        self._done.append(JobDone(job_id=job_id, ok=[True] * n))

    def submit_store(self, job_id: int, dram_pages: Sequence[int], nvme_slots: Sequence[int]) -> None:
        self._complete(job_id, len(dram_pages))

    def submit_load(self, job_id: int, nvme_slots: Sequence[int], dram_pages: Sequence[int], priority: int = 0) -> None:
        self._complete(job_id, len(dram_pages))

    def submit_put(self, job_id: int, dram_pages: Sequence[int], keys: Sequence[str]) -> None:
        self._complete(job_id, len(dram_pages))

    def submit_get(self, job_id: int, keys: Sequence[str], dram_pages: Sequence[int], priority: int = 0) -> None:
        self._complete(job_id, len(dram_pages))

    def submit_exists(self, job_id: int, keys: Sequence[str]) -> None:
        self._complete(job_id, len(keys))

    def poll(self) -> list[JobDone]:
        done, self._done = list(self._done), deque()
        return done

    def wait(self, timeout_s: float, wake: Sequence[Any] = ()) -> list[JobDone]:
        return self.poll()

    def check_alive(self) -> bool:
        return True

    def close(self) -> None:
        self._done.clear()


class ReplicaJournal:
    """The :class:`hiradix.core.ports.NvmeJournal` of a replica rank: the owner writes the durable
    NVMe index; this one only keeps ``landed`` as the owner's journal does, so the tier
    controller persists the same prefixes (takes the same decisions) on every rank."""

    def __init__(self) -> None:
        self.landed: list[TreeNode] = []

    def invalidate(self, slots: Sequence[int]) -> None:
        pass

    def stored(self, node: TreeNode, slots: Sequence[int]) -> None:
        self.landed.append(node)

    def sync(self) -> None:
        pass

    def durable_pages(self, slots: Optional[Sequence[int]] = None) -> Optional[int]:
        return None  # the owner's index says
