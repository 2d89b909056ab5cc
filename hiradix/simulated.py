"""Data-less stand-ins for the data plane, so the real bookkeeping runs without KV bytes.

The trace simulator (``bench/simulate.py``) and the tests drive the real
:class:`hiradix.tree.TieredRadixTree`, policies, :class:`hiradix.transfers.TierBooks` and
:class:`hiradix.tiering.TierController` through these stand-ins, which carry page ids and op
ids only (no tensors, no files, no processes):

* :class:`SimClock` -- a virtual monotonic clock in seconds, shared by the tree (recency),
  the controller (prefetch deadlines) and the I/O stand-in (completion times);
* :class:`SimDevicePool` -- SGLang's paged device allocator: a free list of HBM pages,
  handing out token slot ids page by page;
* :class:`SimHostMover` -- :class:`hiradix.movers.HostMover`'s methods; a BACKUP or PROMOTE
  completes at the next ``finished()``/``flush()`` (HBM <-> DRAM copies are not timed);
* :class:`SimIOClient` -- :class:`hiradix.io.client.IOWorkerClient`'s methods; a job
  completes after a simulated service time per page on the virtual clock, reads and writes
  on two separate FIFO channels;
* :func:`simulated_controller` -- builds books + these stand-ins into a real
  :class:`~hiradix.tiering.TierController`;
* :class:`SimPrefixCache` -- the calls :class:`hiradix.cache.HiRadixCache` makes on the tree
  and the controller (match -> prefetch, should_wait, load back, checkpoint, evict, the
  look-ahead window), with SGLang's objects replaced by token arrays and slot lists.
"""

from __future__ import annotations

import heapq
from typing import Optional, Sequence

from hiradix.io.protocol import JobDone, LoadPages, StorePages
from hiradix.lookahead import QueueView, plan
from hiradix.policy import LookaheadPolicy
from hiradix.tiering import DRAM_FREE_LOW, TierController
from hiradix.transfers import Kind, TierBooks, Transfer
from hiradix.tree import IntegrityError, TieredRadixTree, Tier, TreeMatch, TreeNode


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


class SimHostMover:
    """Stand-in for :class:`hiradix.movers.HostMover`: moves no bytes.

    A BACKUP (HBM -> DRAM) or PROMOTE (DRAM -> HBM) completes at the next :meth:`finished`
    or :meth:`flush`, i.e. within one scheduler step (these copies overlap the forward in
    the real system). ``loader`` is None: there is no layer-wise counter to register.
    """

    def __init__(self) -> None:
        self.loader = None
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


class SimIOClient:
    """Stand-in for :class:`hiradix.io.client.IOWorkerClient` on a virtual clock.

    A job's pages are served one after the other on its channel (``LoadPages`` on the read
    channel, ``StorePages`` on the write channel), each channel FIFO: a job submitted at
    ``t`` completes at ``max(t, channel free) + pages * s_per_page``. Every page succeeds.

    Args:
        clock: the shared virtual clock.
        read_s_per_page: NVMe -> DRAM service time of one page, in seconds.
        write_s_per_page: DRAM -> NVMe service time of one page, in seconds.
    """

    def __init__(self, clock: SimClock, read_s_per_page: float, write_s_per_page: float):
        self.clock = clock
        self.s_per_page = {LoadPages: read_s_per_page, StorePages: write_s_per_page}
        self._busy_until_s = {LoadPages: 0.0, StorePages: 0.0}
        self._jobs: list[tuple[float, int, int]] = []  # heap of (done at s, job id, pages)
        self.disabled = False
        self.pages_done = {LoadPages: 0, StorePages: 0}

    def submit(self, job: LoadPages | StorePages) -> None:
        """Queue ``job`` on its channel; its ``JobDone`` comes from :meth:`poll` when due."""
        kind = type(job)
        pages = len(job.dram_pages)
        start_s = max(self.clock(), self._busy_until_s[kind])
        done_s = start_s + pages * self.s_per_page[kind]
        self._busy_until_s[kind] = done_s
        heapq.heappush(self._jobs, (done_s, job.job_id, pages))
        self.pages_done[kind] += pages

    def poll(self) -> list[JobDone]:
        """Jobs whose completion time has passed on the virtual clock."""
        now, done = self.clock(), []
        while self._jobs and self._jobs[0][0] <= now:
            _, job_id, pages = heapq.heappop(self._jobs)
            done.append(JobDone(job_id=job_id, ok=[True] * pages))
        return done

    def wait(self, timeout_s: float) -> list[JobDone]:
        """Block (advance the virtual clock) until a job completes or ``timeout_s`` passes."""
        target = self.clock() + max(timeout_s, 0.0)
        if self._jobs:
            target = min(target, self._jobs[0][0])
        self.clock.advance_to(target)
        return self.poll()

    def next_done_s(self) -> Optional[float]:
        """Completion time of the earliest job in flight, or None."""
        return self._jobs[0][0] if self._jobs else None

    def in_flight(self) -> set[int]:
        """Ids of submitted jobs not yet returned by :meth:`poll`."""
        return {job_id for _, job_id, _ in self._jobs}

    def check_alive(self) -> bool:
        """The stand-in never dies."""
        return True

    def close(self) -> None:
        """Drop the jobs in flight."""
        self._jobs.clear()


def simulated_controller(
    tree: TieredRadixTree,
    dram_pages: int,
    nvme_slots: int,
    page_bytes: int,
    write_through: bool,
    clock: SimClock,
    read_s_per_page: float = 0.0,
    write_s_per_page: float = 0.0,
) -> TierController:
    """A real :class:`TierController` over data-less movers, sized like ``for_device_pool``.

    Args:
        tree: the tree whose nodes move.
        dram_pages: DRAM tier capacity, in pages.
        nvme_slots: NVMe tier capacity, in pages (0 = no NVMe tier, no I/O client).
        page_bytes: bytes of one page (all layers), for the controller's counters.
        write_through: back up to DRAM at insert (else at HBM eviction).
        clock: the shared virtual clock.
        read_s_per_page: simulated NVMe read time per page, in seconds.
        write_s_per_page: simulated NVMe write time per page, in seconds.
    """
    books = TierBooks(tree, dram_pages, nvme_slots, dram_free_low_pages=int(DRAM_FREE_LOW * dram_pages))
    client = SimIOClient(clock, read_s_per_page, write_s_per_page) if nvme_slots > 0 else None
    return TierController(tree, books, SimHostMover(), client, page_bytes, write_through, clock=clock)


class SimPrefixCache:
    """What :class:`hiradix.cache.HiRadixCache` does with the tree and the controller.

    Keys are token id sequences already truncated to whole pages; slot arrays are lists.
    ``tiers`` None is the HBM-only cache (stock RadixAttention, as ``HiRadixCache`` without a
    KV pool).

    Args:
        tree: the tree (its policy decides eviction order).
        device: the HBM slot pool.
        tiers: the DRAM/NVMe controller, or None.
        lookahead_window: ``W``, queued requests inspected per step.
        load_timeout_s: how long a request waits for its NVMe reads, in seconds.
    """

    def __init__(
        self,
        tree: TieredRadixTree,
        device: SimDevicePool,
        tiers: Optional[TierController],
        lookahead_window: int = 64,
        load_timeout_s: float = 2.0,
    ):
        assert device.page_size == tree.page_size
        self.tree = tree
        self.device = device
        self.tiers = tiers
        self.lookahead_window = lookahead_window
        self.load_timeout_s = load_timeout_s
        self.last_view: Optional[QueueView] = None

    # ------------------------------------------------------------ match
    def match_prefix(self, key: Sequence[int]) -> TreeMatch:
        """``HiRadixCache.match_prefix``: split + touch, and start reads of the NVMe part."""
        m = self.tree.match(key)
        if m.nvme_len and self.tiers is not None:
            self.tiers.prefetch(m.stage(Tier.NVME), self.load_timeout_s)
        return m

    def should_wait(self, key: Sequence[int]) -> bool:
        """``HiRadixCache.should_wait``: NVMe reads of the key's prefix are in flight."""
        if self.tiers is None or not self.tiers.books.in_flight():
            return False
        m = self.tree.match(key, split=False, touch=False)
        wait = m.nvme_len > 0 and self.tiers.prefetch_pending(m.stage(Tier.NVME), self.load_timeout_s)
        self.tiers.stats.admission_skips += wait
        return wait

    def load_back(self, start: TreeNode, end: TreeNode, num_tokens: int) -> tuple[int, int, TreeNode]:
        """``HiRadixCache.init_load_back``: promote the DRAM nodes ``start``..``end``.

        Returns:
            ``(loaded_tokens, from_nvme_tokens, new_last_node)``; ``from_nvme_tokens`` were
            read from NVMe on demand (SGLang's ``storage_hit_length``); ``(0, 0, start)``
            when it cannot be done.
        """
        if self.tiers is None or num_tokens <= 0 or end is start or not end.alive:
            return 0, 0, start
        nodes = self.tree.path(end)[len(self.tree.path(start)) :]
        ok = bool(nodes) and nodes[0].parent is start
        ok = ok and all(n.in_tier(Tier.DRAM) and not n.in_tier(Tier.HBM) for n in nodes)
        if not ok or sum(n.num_tokens for n in nodes) != num_tokens:
            return 0, 0, start
        self.tiers.books.hold(nodes, Tier.DRAM)
        try:
            slots = self.alloc_device(num_tokens)
        finally:
            self.tiers.books.release(nodes, Tier.DRAM)
        if slots is None:
            return 0, 0, start
        from_nvme = self.tiers.load_back(nodes, slots)
        return num_tokens, from_nvme, end

    # ------------------------------------------------------------ memory
    def alloc_device(self, num_tokens: int) -> Optional[list[int]]:
        """Allocate HBM slots, evicting in policy order when short (``_alloc_device``)."""
        short = num_tokens - self.device.available_size()
        if short > 0:
            self.evict(short)
        return self.device.alloc(num_tokens)

    def evict(self, num_tokens: int) -> int:
        """``HiRadixCache.evict``; returns tokens freed."""
        freed = self.tiers.evict_hbm(num_tokens) if self.tiers is not None else self.tree.evict_hbm(num_tokens)
        for slots in freed:
            self.device.free(slots)
        return sum(len(s) for s in freed)

    def evictable_tokens(self) -> int:
        """Unlocked HBM tokens the tree holds (SGLang's ``evictable_size``)."""
        return self.tree.hbm_evictable_tokens

    # ------------------------------------------------------------ insert / locks
    def checkpoint(self, key: Sequence[int], row: list[int], protected_len: int, lock: TreeNode) -> TreeNode:
        """``HiRadixCache.checkpoint``: insert ``key`` with the request's slots ``row``.

        Frees the request's duplicates of tokens the tree already held, moves the lock from
        ``lock`` to the new last node and starts write-through backups.

        Returns:
            The new locked node.
        """
        dup_len, last, new_nodes = self.tree.insert(key, row)
        if dup_len > protected_len:
            self.device.free(row[protected_len:dup_len])
        if self.tiers is not None:
            self.tiers.after_insert(new_nodes)
        self.tree.inc_lock(last)
        self.tree.dec_lock(lock)
        return last

    def path_slots(self, node: TreeNode) -> list[int]:
        """HBM slot ids on the path to ``node`` (``path_device_indices``)."""
        out: list[int] = []
        for part in self.tree.path_hbm_slots(node):
            out.extend(part)
        return out

    # ------------------------------------------------------------ per step
    def step(self) -> None:
        """``check_hicache_events``: reap copies and acks, keep DRAM headroom."""
        if self.tiers is not None:
            self.tiers.step()

    def observe_queue(self, keys: Sequence[Sequence[int]]) -> Optional[QueueView]:
        """``HiRadixCache.observe_queue`` over the waiting requests' keys, in queue order."""
        if not isinstance(self.tree.policy, LookaheadPolicy):
            return None
        window = [(k, None) for k in keys[: self.lookahead_window]]
        free_pages = self.tiers.books.dram.num_free if self.tiers is not None else 0
        view = plan(self.tree, window, self.lookahead_window, free_pages)
        self.tree.policy.update(view.needed_at)
        if self.tiers is not None:
            for nodes in view.prefetch:
                self.tiers.prefetch(nodes, self.load_timeout_s, ahead=True)
        self.last_view = view
        return view

    def check_integrity(self, request_tokens: int = 0) -> None:
        """Tree + DRAM/NVMe books, and HBM: slots used == tree-held + ``request_tokens``.

        Args:
            request_tokens: HBM slots owned by requests (not yet, or never, in the tree).

        Raises:
            hiradix.tree.IntegrityError: naming the broken invariant.
        """
        (self.tree if self.tiers is None else self.tiers.books).check_integrity()  # books check the tree too
        held = self.tree.hbm_evictable_tokens + self.tree.hbm_protected_tokens
        used = self.device.num_used_tokens()
        if used != held + request_tokens:
            raise IntegrityError(f"HBM: {used} slots used != tree {held} + requests {request_tokens}")


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
    "SimPrefixCache",
    "simulated_controller",
    "next_event_s",
]
