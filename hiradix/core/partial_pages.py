"""Partial last pages: the k < page_size tokens a finished request left in its last page, kept in HBM.

With pages of 16 tokens, a radix tree keys whole pages only: the last, partly filled page of every
finished request is freed, and the next turn of the conversation computes those tokens again
(7.5 a turn on average). SGLang at page size 1 keeps them. :class:`PartialPages` keeps that page
(HBM only; the lower tiers hold whole pages) under the whole-page prefix it follows, and hands it
to the next request whose tokens continue that prefix with (some of) the same tokens:

* :meth:`PartialPages.keep` at a request's release: the page's first ``k`` rows hold ``tokens``;
  a kept page whose tokens begin the new ones (an older turn of the same prefix) is replaced. The
  prefix cache also keeps a copy of the leading rows of a page the tree holds, for a request
  whose tokens diverge inside that page (copy-on-write: the tree's page stays as it is).
* :meth:`PartialPages.match` at a match: the page sharing the longest run with the request's next
  tokens; it is *claimed* by that request until the scheduler's next step, so no other request of
  this step gets it (the page is about to be written into).
* :meth:`PartialPages.take` when the claiming request is admitted: the page leaves the books and
  becomes the request's own. The request's next tokens fill its remaining rows (SGLang's paged
  allocator continues the last page of a prefix), so the page is moved, never shared, and no copy
  is needed; at the request's release its whole pages go into the tree as usual.
* Under HBM pressure a page goes with the whole-page prefix it follows: once the tree evicted that
  prefix's last node from HBM, :meth:`PartialPages.evict_orphans` frees the page (the eviction
  policy's order, queue look-ahead included, holds for partial pages too); :meth:`PartialPages.evict`
  frees pages least recently used first when the tree has nothing left to evict. A claimed page
  is never freed (it is about to be taken).

Pure bookkeeping: slots are opaque handles (device slot ids); a page's prefix is an opaque key
(the caller's: the namespace and chain hash of the whole-page prefix, so a kept page costs no
copy of its prefix). One instance per tree, used on the scheduler thread only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Optional, Sequence

PrefixKey = Hashable  # the whole-page prefix a page follows (the caller's key)


@dataclass(eq=False)
class PartialPage:
    """One kept page: ``tokens`` (1 <= k < page_size) after the whole-page prefix ``prefix``.

    Attributes:
        slots: the device slots of the whole page (its first ``k`` rows hold ``tokens``).
        claimed_by: the request that matched it in this step, or None.
    """

    prefix: PrefixKey
    tokens: tuple
    slots: Any
    owner: Any = None  # the tree node ending the prefix (freed with its HBM copy), or None
    claimed_by: Optional[Hashable] = None


def shared_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PartialPages:
    """The kept partial pages of one tree (see the module docstring).

    Args:
        page_size: tokens per page (> 1).
    """

    def __init__(self, page_size: int):
        if page_size <= 1:
            raise ValueError(f"partial pages need page_size > 1, got {page_size}")
        self.page_size = page_size
        self._by_prefix: dict[PrefixKey, list[PartialPage]] = {}
        self._lru: OrderedDict[PartialPage, None] = OrderedDict()  # least recently used first
        self._claimed: list[PartialPage] = []
        self.kept = 0  # pages kept, ever
        self.taken = 0  # pages handed to a request, ever
        self.reused_tokens = 0  # their tokens, not computed again
        self.evicted = 0  # pages freed under HBM pressure, ever
        self.copied = 0  # pages copied for a request (:meth:`add_claimed`), ever

    @property
    def num_pages(self) -> int:
        """Pages held (each a whole HBM page)."""
        return len(self._lru)

    def keep(self, prefix: PrefixKey, tokens: Sequence[int], slots: Any, owner: Any = None) -> tuple[bool, list[Any]]:
        """Keep a released request's last page: ``tokens`` (1 <= k < page_size) in the first rows
        of the page whose slots are ``slots``.

        Returns:
            ``(kept, freed)``: whether the page is kept (else the caller frees it as before: the
            same tokens are kept already), and the slots of kept pages it replaces (their tokens
            begin the new ones: an older turn), which the caller frees.
        """
        tokens = tuple(tokens)
        if not 0 < len(tokens) < self.page_size:
            raise ValueError(f"a partial page holds 1..{self.page_size - 1} tokens, got {len(tokens)}")
        pages = self._by_prefix.setdefault(prefix, [])
        if any(p.tokens[: len(tokens)] == tokens for p in pages):
            return False, []  # as much is kept already
        freed = []
        for page in [p for p in pages if tokens[: len(p.tokens)] == p.tokens and p.claimed_by is None]:
            freed.append(self._drop(page))
        page = PartialPage(prefix, tokens, slots, owner)
        self._by_prefix.setdefault(prefix, []).append(page)
        self._lru[page] = None
        self.kept += 1
        return True, freed

    def match(self, prefix: PrefixKey, next_tokens: Sequence[int], claimer: Hashable) -> tuple[int, Optional[PartialPage]]:
        """The kept page after ``prefix`` sharing the most leading tokens with ``next_tokens``.

        A page another request claimed in this step is skipped; the one returned is claimed by
        ``claimer`` (until :meth:`new_step`) and becomes the most recently used.

        Returns:
            ``(tokens shared, page)``, or ``(0, None)``.
        """
        pages = self._by_prefix.get(prefix)
        if not pages or not next_tokens:
            return 0, None
        best, best_len = None, 0
        for page in pages:
            if page.claimed_by is not None and page.claimed_by != claimer:
                continue
            n = shared_len(page.tokens, next_tokens)
            if n > best_len:
                best, best_len = page, n
        if best is None:
            return 0, None
        self._release_claims(prefix, claimer, but=best)  # a request claims one page at most
        if best.claimed_by is None:
            best.claimed_by = claimer
            self._claimed.append(best)
        self._lru.move_to_end(best)
        return best_len, best

    def add_claimed(self, prefix: PrefixKey, tokens: Sequence[int], slots: Any, owner: Any,
                    claimer: Hashable) -> PartialPage:
        """Hold a page copied for ``claimer``, claimed by it (counted in :attr:`copied`); returns
        the page. Any claim of ``claimer`` on another page of ``prefix`` lapses."""
        self._release_claims(prefix, claimer)
        page = PartialPage(prefix, tuple(tokens), slots, owner, claimer)
        self._by_prefix.setdefault(prefix, []).append(page)
        self._lru[page] = None
        self._claimed.append(page)
        self.copied += 1
        return page

    def _release_claims(self, prefix: PrefixKey, claimer: Hashable, but: Optional[PartialPage] = None) -> None:
        for page in self._by_prefix.get(prefix, ()):
            if page is not but and page.claimed_by == claimer:
                page.claimed_by = None

    def take(self, page: PartialPage, claimer: Hashable, num_tokens: int) -> Any:
        """Hand ``page`` to the request that claimed it; returns the page's slots (now the request's own).

        Raises:
            ValueError: the page is not held or not claimed by ``claimer`` (a bookkeeping error).
        """
        if page not in self._lru or page.claimed_by != claimer:
            raise ValueError(f"partial page not claimed by {claimer!r}")
        slots = self._drop(page)
        self.taken += 1
        self.reused_tokens += num_tokens
        return slots

    def new_step(self) -> None:
        """A new scheduler step: claims of the last one lapse."""
        for page in self._claimed:
            page.claimed_by = None
        self._claimed.clear()

    def evict(self, num_pages: int) -> list[Any]:
        """Free up to ``num_pages`` pages, least recently used first, never a claimed one.

        Returns:
            Their slots, for the caller to free.
        """
        freed: list[Any] = []
        for page in list(self._lru):
            if len(freed) >= num_pages:
                break
            if page.claimed_by is None:
                freed.append(self._drop(page))
                self.evicted += 1
        return freed

    def evict_orphans(self, resident: Callable[[Any], bool]) -> list[Any]:
        """Free every unclaimed page whose owner is no longer ``resident`` (its prefix left HBM).

        Returns:
            Their slots, for the caller to free.
        """
        freed = [self._drop(p) for p in list(self._lru) if p.claimed_by is None and not resident(p.owner)]
        self.evicted += len(freed)
        return freed

    def all_slots(self) -> list[Any]:
        """Slots of every held page (SGLang's ``all_values_flatten``)."""
        return [p.slots for p in self._lru]

    def reset(self) -> None:
        """Forget every page (SGLang's ``flush_cache`` resets the device pool itself)."""
        self._by_prefix.clear()
        self._lru.clear()
        self._claimed.clear()

    def _drop(self, page: PartialPage) -> Any:
        del self._lru[page]
        pages = self._by_prefix[page.prefix]
        pages.remove(page)
        if not pages:
            del self._by_prefix[page.prefix]
        if page in self._claimed:
            self._claimed.remove(page)
        return page.slots
