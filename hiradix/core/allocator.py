"""Fixed-capacity page-id allocator shared by the DRAM pages and the NVMe slots (bookkeeping only).

Pure Python, no I/O: it hands out integer ids ``0..capacity-1`` and takes them back. The
ids index :class:`hiradix.tiers.dram.DramPool` pages or :class:`hiradix.tiers.nvme.NvmeStore`
slots; what a page holds is the tree's business. Role of nano-vllm's ``BlockManager`` free
list and SGLang's ``HostKVCache.alloc``/``free`` (``pool_host/base.py``), with the two
differences that matter here: allocation is all or nothing (``None`` instead of a partial
list or a ``-1`` sentinel), and a bad ``free`` raises before it changes anything.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable


class PageAllocator:
    """Free list over page ids ``0..num_pages-1``.

    The most recently freed ids are handed out first (LIFO), which keeps recently touched
    DRAM pages warm in the CPU caches. Not thread-safe: one owner (the scheduler's tree).

    Args:
        num_pages: capacity in pages (``>= 0``).

    Raises:
        ValueError: ``num_pages`` negative.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self._capacity = num_pages
        # Free ids, popped from the end; initially ascending order of hand-out (0, 1, 2, ...).
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        # _used[i] == 1 iff id i is allocated; mutated only by alloc/free.
        self._used = bytearray(num_pages)

    @property
    def capacity(self) -> int:
        """Total ids, in pages."""
        return self._capacity

    @property
    def num_free(self) -> int:
        """Ids available to :meth:`alloc`, in pages."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Ids handed out and not yet freed, in pages."""
        return self._capacity - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` free ids, all or nothing.

        Returns:
            ``n`` distinct ids, or ``None`` (and nothing changes) when fewer than ``n`` are free.

        Raises:
            ValueError: ``n`` negative.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        page_ids = self._free[-n:]
        del self._free[-n:]
        page_ids.reverse()
        for page_id in page_ids:
            self._used[page_id] = 1
        return page_ids

    def free(self, page_ids: Iterable[int]) -> None:
        """Return ids to the free list, all or nothing.

        Raises:
            ValueError: an id out of range, not allocated (double free), or repeated in
                ``page_ids``; nothing is freed then.
        """
        ids = [self._check_range(page_id) for page_id in page_ids]
        seen: set[int] = set()
        for page_id in ids:
            if not self._used[page_id] or page_id in seen:
                raise ValueError(f"double free of page {page_id}")
            seen.add(page_id)
        for page_id in ids:
            self._used[page_id] = 0
        self._free.extend(reversed(ids))

    def claim(self, page_ids: Iterable[int]) -> None:
        """Take these specific free ids (re-indexing persisted pages at start), all or nothing.

        O(capacity). Raises:
            ValueError: an id out of range, already used, or repeated; nothing changes then.
        """
        ids = [self._check_range(page_id) for page_id in page_ids]
        if len(set(ids)) != len(ids) or any(self._used[i] for i in ids):
            raise ValueError("claim of a used or repeated page id")
        taken = set(ids)
        for page_id in ids:
            self._used[page_id] = 1
        self._free = [i for i in self._free if i not in taken]

    def is_used(self, page_id: int) -> bool:
        """Whether ``page_id`` is allocated.

        Raises:
            ValueError: ``page_id`` out of range.
        """
        return bool(self._used[self._check_range(page_id)])

    def check_integrity(self) -> None:
        """Assert free + used == capacity, no id free twice, no id both free and used.

        O(capacity). Raises:
            AssertionError: the books are inconsistent.
        """
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "an id appears twice in the free list"
        num_used = sum(self._used)
        assert len(self._free) + num_used == self._capacity, (
            f"free {len(self._free)} + used {num_used} != capacity {self._capacity}"
        )
        for page_id in free_set:
            assert 0 <= page_id < self._capacity, f"free id {page_id} out of range"
            assert not self._used[page_id], f"page {page_id} is both free and used"

    def _check_range(self, page_id: int) -> int:
        """``page_id`` as a plain int; ValueError if it is not an integer in range."""
        try:
            index = operator.index(page_id)
        except TypeError:
            raise ValueError(f"page id {page_id!r} is not an integer") from None
        if not 0 <= index < self._capacity:
            raise ValueError(f"page id {page_id!r} out of range [0, {self._capacity})")
        return index

    def __repr__(self) -> str:
        return f"PageAllocator(capacity={self._capacity}, free={self.num_free})"
