"""Data-less implementations of the core's ports, so the real bookkeeping runs without KV bytes.

The trace simulator (``bench/sim/simulate.py``) and the tests drive the real
:class:`hiradix.core.prefix_cache.TieredPrefixCache` (tree, policies, ledger, placement,
controller) through these, the same object the server drives; they carry page ids and op ids
only (no tensors, no files, no processes):

* :class:`SimClock` -- a virtual monotonic clock in seconds, shared by the tree (recency),
  the controller (prefetch deadlines) and the I/O stand-in (completion times);
* :class:`SimDevicePool` -- the ``DevicePool`` port: SGLang's paged device allocator as a
  free list of HBM pages, handing out token slot ids page by page;
* :class:`SimHostMover` -- the ``HostMover`` port; a BACKUP or PROMOTE completes at the next
  ``finished()``/``flush()`` (HBM <-> DRAM copies are not timed);
* :class:`SimIOClient` -- the ``IOClient`` port; a job completes after a simulated service
  time per page on the virtual clock, reads and writes on two separate FIFO channels;
* :func:`simulated_controller` -- a real :class:`~hiradix.core.controller.TierController`
  over a ledger and these ports, sized as the server sizes it.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Any, Optional, Sequence

from hiradix.core.controller import TierController
from hiradix.core.plan import TierPlan
from hiradix.core.ledger import Kind, TierBooks, Transfer
from hiradix.core.tree import TieredRadixTree
from hiradix.io.protocol import GetStore, JobDone, LoadPages, PutStore, QueryStore, StorePages


class SimClock:
    """Virtual monotonic time in seconds; call it to read, :meth:`advance_to` to move on.

    Args:
        start_s: initial time, in seconds.
    """

    def __init__(self, start_s: float = 0.0):
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance_to(self, t_s: float) -> None:
        """Move to ``t_s`` seconds (never backwards)."""
        self.now_s = max(self.now_s, t_s)


class SimDevicePool:
    """Paged device slot allocator: slots of page ``p`` are ``p*page_size .. +page_size-1``.

    Same semantics as SGLang's paged ``TokenToKVPoolAllocator`` as the tree sees it: slot
    arrays handed out are whole pages; frees are whole pages; a double free raises.

    Args:
        num_tokens: capacity in tokens (rounded down to whole pages).
        page_size: tokens per page.
    """

    def __init__(self, num_tokens: int, page_size: int):
        self.page_size = page_size
        self.num_pages = num_tokens // page_size
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))
        self._used = bytearray(self.num_pages)

    @property
    def capacity_tokens(self) -> int:
        """Capacity, in tokens (whole pages)."""
        return self.num_pages * self.page_size

    def available_size(self) -> int:
        """Free slots, in tokens."""
        return len(self._free) * self.page_size

    def alloc(self, num_tokens: int) -> Optional[list[int]]:
        """Take ``num_tokens`` slots (a multiple of ``page_size``), all or nothing.

        Returns:
            Slot ids, shape ``(num_tokens,)``, or ``None`` when too few pages are free.
        """
        ps = self.page_size
        assert num_tokens % ps == 0, num_tokens
        n = num_tokens // ps
        if n > len(self._free):
            return None
        pages = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        slots: list[int] = []
        for p in reversed(pages):
            self._used[p] = 1
            slots.extend(range(p * ps, p * ps + ps))
        return slots

    def free(self, slots: Sequence[int]) -> None:
        """Return whole pages of slots (as handed out by :meth:`alloc` or split from it).

        Raises:
            ValueError: not whole pages, or a page that is not allocated.
        """
        ps = self.page_size
        if len(slots) % ps:
            raise ValueError(f"free of {len(slots)} slots: not whole pages of {ps}")
        pages = [s // ps for s in slots[::ps]]
        for k, p in enumerate(pages):
            if slots[k * ps] % ps or not self._used[p]:
                raise ValueError(f"bad free of page {p}")
        for p in pages:
            self._used[p] = 0
        self._free.extend(pages)

    def num_used_tokens(self) -> int:
        """Slots handed out and not freed, in tokens."""
        return (self.num_pages - len(self._free)) * self.page_size

    def concat(self, parts: Sequence[Sequence[int]]) -> list[int]:
        """One slot list made of ``parts`` in order."""
        out: list[int] = []
        for part in parts:
            out.extend(part)
        return out


class SimHostMover:
    """The ``HostMover`` port without bytes (real one: :class:`hiradix.dataplane.movers.HostMover`).

    A BACKUP (HBM -> DRAM) or PROMOTE (DRAM -> HBM) completes at the next :meth:`finished`
    or :meth:`flush`, i.e. within one scheduler step (these copies overlap the forward in
    the real system).
    """

    def __init__(self) -> None:
        self._pending: list[int] = []  # op ids of started copies
        self.pages_moved = {Kind.BACKUP: 0, Kind.PROMOTE: 0}  # in pages
        self._batches = 0

    def backup(self, op: Transfer) -> None:
        """Start an HBM -> DRAM copy (completes at the next :meth:`finished`)."""
        assert op.kind == Kind.BACKUP
        self._pending.append(op.op_id)
        self.pages_moved[Kind.BACKUP] += len(op.dst_ids)

    def promote(self, op: Transfer) -> None:
        """Start a DRAM -> HBM load (completes at the next :meth:`finished`)."""
        assert op.kind == Kind.PROMOTE
        self._pending.append(op.op_id)
        self.pages_moved[Kind.PROMOTE] += len(op.src_ids)

    def start_loading(self) -> int:
        """The consumer index a batch would carry (counts batches; no layers to wait on)."""
        self._batches += 1
        return self._batches

    def finished(self) -> list[int]:
        """Op ids of every copy started since the last call (all of them have landed)."""
        done, self._pending = self._pending, []
        return done

    def flush(self) -> list[int]:
        """Finish every pending copy now; returns their op ids."""
        return self.finished()

    def drop_pending(self) -> None:
        """Forget pending copies (on reset)."""
        self._pending.clear()


class SimStore:
    """A cluster store shared by simulated servers: which keys it holds (no bytes), LRU-bounded.

    Args:
        capacity_pages: objects it holds at most (the least recently used go first); None: all.
    """

    def __init__(self, capacity_pages: Optional[int] = None):
        self.capacity_pages = capacity_pages
        self._keys: OrderedDict[str, None] = OrderedDict()
        self.puts = self.gets = self.hits = 0

    def put(self, key: str) -> None:
        self.puts += 1
        self._keys[key] = None
        self._keys.move_to_end(key)
        if self.capacity_pages is not None:
            while len(self._keys) > self.capacity_pages:
                self._keys.popitem(last=False)

    def has(self, key: str, touch: bool = False) -> bool:
        found = key in self._keys
        if found and touch:
            self._keys.move_to_end(key)
        return found

    def __len__(self) -> int:
        return len(self._keys)


# Channels of SimIOClient: NVMe reads, NVMe writes, store reads (get, exists), store writes.
_CHANNELS = ("nvme_read", "nvme_write", "store_read", "store_write")


class SimIOClient:
    """The ``IOClient`` port on a virtual clock (real one: :class:`hiradix.io.client.IOWorkerClient`).

    A job's pages are served one after the other on its channel (NVMe reads, NVMe writes, store
    reads, store writes), one job at a time per channel: a job takes ``pages * s_per_page`` from
    its start, and when a job ends the channel starts the waiting job of the smallest priority
    (an NVMe read's ``priority``, as the I/O worker orders them; 0 for every other job), first
    come first served among equals. Nothing is preempted. NVMe pages always succeed; a store GET
    page succeeds if the shared :class:`SimStore` holds its key when the job completes, an exists
    query reports what it holds then, and a PUT lands its keys then.

    Args:
        clock: the shared virtual clock.
        read_s_per_page: NVMe -> DRAM service time of one page, in seconds.
        write_s_per_page: DRAM -> NVMe service time of one page, in seconds.
        store: the cluster store shared with other simulated servers, or None.
        store_read_s_per_page, store_write_s_per_page: store GET / PUT time per page, in seconds.
        store_query_s: time of one exists query, in seconds.
    """

    def __init__(self, clock: SimClock, read_s_per_page: float, write_s_per_page: float, store: Optional[SimStore] = None,
                 store_read_s_per_page: float = 0.0, store_write_s_per_page: float = 0.0, store_query_s: float = 0.0):
        self.clock = clock
        self.store = store
        self.s_per_page = dict(zip(_CHANNELS, (read_s_per_page, write_s_per_page, store_read_s_per_page, store_write_s_per_page)))
        self.store_query_s = store_query_s
        self._waiting: dict[str, list] = {ch: [] for ch in _CHANNELS}  # heaps of (priority, seq, job, service s)
        self._busy = dict.fromkeys(_CHANNELS, False)
        self._seq = itertools.count()
        self._jobs: list[tuple[float, int, Any, str]] = []  # running: heap of (done at s, job id, job, channel)
        self.disabled = False
        self.pages_done = dict.fromkeys(_CHANNELS, 0)

    def _queue(self, channel: str, job: Any, pages: int, fixed_s: float = 0.0, priority: int = 0) -> None:
        heapq.heappush(self._waiting[channel], (priority, next(self._seq), job, fixed_s + pages * self.s_per_page[channel]))
        self.pages_done[channel] += pages
        if not self._busy[channel]:
            self._start_next(channel, self.clock())

    def _start_next(self, channel: str, at_s: float) -> None:
        waiting = self._waiting[channel]
        self._busy[channel] = bool(waiting)
        if waiting:
            _, _, job, service_s = heapq.heappop(waiting)
            heapq.heappush(self._jobs, (at_s + service_s, job.job_id, job, channel))

    def submit(self, job: LoadPages | StorePages) -> None:
        """Queue an NVMe ``job`` on its channel; its ``JobDone`` comes from :meth:`poll` when due."""
        if isinstance(job, LoadPages):
            self._queue("nvme_read", job, len(job.dram_pages), priority=job.priority)
        else:
            self._queue("nvme_write", job, len(job.dram_pages))

    def submit_store(self, job_id: int, dram_pages: Sequence[int], nvme_slots: Sequence[int]) -> None:
        """Queue a DRAM -> NVMe store on the write channel."""
        self.submit(StorePages(job_id, list(dram_pages), list(nvme_slots)))

    def submit_load(self, job_id: int, nvme_slots: Sequence[int], dram_pages: Sequence[int], priority: int = 0) -> None:
        """Queue an NVMe -> DRAM load on the read channel (smaller ``priority`` first)."""
        self.submit(LoadPages(job_id, list(nvme_slots), list(dram_pages), priority=priority))

    def submit_put(self, job_id: int, dram_pages: Sequence[int], keys: Sequence[str]) -> None:
        """Queue a DRAM -> store PUT on the store's write channel."""
        self._queue("store_write", PutStore(job_id, list(dram_pages), list(keys)), len(keys))

    def submit_get(self, job_id: int, keys: Sequence[str], dram_pages: Sequence[int], priority: int = 0) -> None:
        """Queue a store -> DRAM GET on the store's read channel (in order: ``priority`` is not simulated)."""
        self._queue("store_read", GetStore(job_id, list(keys), list(dram_pages)), len(keys))

    def submit_exists(self, job_id: int, keys: Sequence[str]) -> None:
        """Queue an exists query (``store_query_s``) on the store's read channel."""
        self._queue("store_read", QueryStore(job_id, list(keys)), 0, fixed_s=self.store_query_s)

    def _finish(self, job: Any) -> JobDone:
        if isinstance(job, (LoadPages, StorePages)):
            return JobDone(job_id=job.job_id, ok=[True] * len(job.dram_pages))
        if isinstance(job, PutStore):
            for key in job.keys:
                self.store.put(key)
            return JobDone(job_id=job.job_id, ok=[True] * len(job.keys))
        found = [self.store.has(k, touch=isinstance(job, GetStore)) for k in job.keys]
        if isinstance(job, GetStore):
            self.store.gets += len(found)
            self.store.hits += sum(found)
        return JobDone(job_id=job.job_id, ok=found)

    def poll(self) -> list[JobDone]:
        """Jobs whose completion time has passed on the virtual clock (each channel then starts its next)."""
        now, done = self.clock(), []
        while self._jobs and self._jobs[0][0] <= now:
            done_s, _, job, channel = heapq.heappop(self._jobs)
            done.append(self._finish(job))
            self._start_next(channel, done_s)
        return done

    def wait(self, timeout_s: float, wake: Sequence[Any] = ()) -> list[JobDone]:
        """Block (advance the virtual clock) until a job completes or ``timeout_s`` passes
        (nothing else wakes a simulation: ``wake`` is ignored)."""
        target = self.clock() + max(timeout_s, 0.0)
        if self._jobs:
            target = min(target, self._jobs[0][0])
        self.clock.advance_to(target)
        return self.poll()

    def next_done_s(self) -> Optional[float]:
        """Completion time of the earliest job in flight, or None."""
        return self._jobs[0][0] if self._jobs else None

    def in_flight(self) -> set[int]:
        """Ids of submitted jobs not yet returned by :meth:`poll` (running or waiting)."""
        running = {job_id for _, job_id, _, _ in self._jobs}
        return running | {job.job_id for heap in self._waiting.values() for _, _, job, _ in heap}

    def check_alive(self) -> bool:
        """The stand-in never dies."""
        return True

    def close(self) -> None:
        """Drop the jobs in flight."""
        self._jobs.clear()
        for heap in self._waiting.values():
            heap.clear()
        self._busy = dict.fromkeys(_CHANNELS, False)


def simulated_controller(
    tree: TieredRadixTree,
    dram_pages: int,
    nvme_slots: int,
    page_bytes: int,
    write_through: bool,
    clock: SimClock,
    read_s_per_page: float = 0.0,
    write_s_per_page: float = 0.0,
    store: Optional[SimStore] = None,
    store_key_prefix: str = "sim/",
    store_write_policy: str = "write_through",
    store_read_s_per_page: float = 0.0,
    store_write_s_per_page: float = 0.0,
    store_query_s: float = 0.0,
    write_selective: bool = False,
    dram_staging: bool = False,
    client: Optional[SimIOClient] = None,
) -> TierController:
    """A real :class:`TierController` over data-less ports, sized like ``runtime.assembly.build_tiers``.

    Args:
        tree: the tree whose nodes move.
        dram_pages: DRAM tier capacity, in pages.
        nvme_slots: NVMe tier capacity, in pages (0 = no NVMe tier).
        page_bytes: bytes of one page (all layers), for the controller's counters.
        write_through: back up to DRAM at insert (else at HBM eviction).
        clock: the shared virtual clock.
        read_s_per_page: simulated NVMe read time per page, in seconds.
        write_s_per_page: simulated NVMe write time per page, in seconds.
        store: a cluster store shared with other simulated servers, or None (no store tier).
        store_key_prefix: the KV fingerprint part of the store's keys (servers that may share
            KV use the same prefix).
        store_write_policy, store_read_s_per_page, store_write_s_per_page, store_query_s: the
            store tier's write policy and simulated timings.
        write_selective: back up only nodes hit again (``TierPlan.write_selective``).
        dram_staging: DRAM only carries pages in flight (``--hiradix-dram-mode staging``).
        client: the I/O port to use instead of a :class:`SimIOClient` made from the rates above.
    """
    books = TierBooks(tree, dram_pages, nvme_slots)
    if client is None and (nvme_slots > 0 or store is not None):
        client = SimIOClient(clock, read_s_per_page, write_s_per_page, store, store_read_s_per_page,
                             store_write_s_per_page, store_query_s)
    plan = TierPlan.uniform(page_bytes, dram_pages, nvme_slots,
                            store_key_prefix=store_key_prefix if store is not None else None, write_through=write_through,
                            store_write_policy=store_write_policy, write_selective=write_selective,
                            dram_staging=dram_staging)
    return TierController(tree, books, SimHostMover(), client, plan, clock=clock)


def next_event_s(tiers: Optional[TierController]) -> Optional[float]:
    """When the controller next has something to reap (an I/O completion), or None."""
    if tiers is None or tiers.client is None:
        return None
    return tiers.client.next_done_s()


__all__ = [
    "SimClock",
    "SimDevicePool",
    "SimHostMover",
    "SimIOClient",
    "SimStore",
    "simulated_controller",
    "next_event_s",
]
