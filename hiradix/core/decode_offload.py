"""Decode-side offload, the bookkeeping: which pages of a finished request go to the cluster
store, under which keys, and which DRAM staging pages they occupy until the PUT is done.

In PD disaggregation the decode server computes the answer's KV, which the next turn's prefill
needs. When a request finishes there, its whole pages are copied into DRAM staging pages and
PUT into the cluster store (data movement: :mod:`hiradix.runtime.decode_offload`), under the
keys the prefill server's hiradix computes for the same tokens (:mod:`hiradix.core.keys`: the
page-hash chain from the root, in the request's namespace, behind the KV fingerprint's key
prefix), so the next turn's prefill finds them with its normal store lookup.

Which pages (:func:`offload_span`): the whole pages of the tokens whose KV exists (the prompt
and every generated token but the last, whose KV is never computed), minus the pages lying
wholly inside the prompt: the prefill server computed and shares those itself (HiCache's
decode-side offload does the same). The page that holds the prompt's tail and the answer's
start is the decode side's.

A PUT whose pages failed is tried again, for its failed pages only, with their staging pages
kept (:meth:`OffloadBooks.finish` returns the retry, :meth:`OffloadBooks.due_retries` hands it back
once its backoff passed): a transient store error (one master RPC that timed out on a loaded
machine, a holder busy for a moment) costs a retry, not the next turn's hit. At most
``PUT_ATTEMPTS`` tries within ``PUT_RETRY_BUDGET_S`` of the first; what fails then is counted
``failed`` and its staging freed.

Pure Python (no torch, no I/O): one owner, the decode scheduler; the staging pages are ids of
a :class:`hiradix.core.allocator.PageAllocator`; times are the caller's clock, in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from hiradix.core.allocator import PageAllocator
from hiradix.core.keys import ROOT_HASH, chain

OUTCOMES = ("stored", "staging_full", "failed")  # counted tokens, by what became of them
PUT_ATTEMPTS = 3  # tries of one page's PUT, the first included
PUT_RETRY_BUDGET_S = 10.0  # no retry starts later than this after the first try, in seconds
PUT_RETRY_BACKOFF_S = 0.5  # wait before the first retry, doubled before each later one, in seconds


def offload_span(prompt_tokens: int, kv_tokens: int, page_size: int) -> tuple[int, int]:
    """``(first page, number of pages)`` a finished request offloads, in pages of ``page_size``.

    Args:
        prompt_tokens: the prompt's length, in tokens (the prefill server shares its whole pages).
        kv_tokens: tokens whose KV the decode server holds (prompt + generated - 1), in tokens.
        page_size: tokens per page (the same on both servers).
    """
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    first = max(0, prompt_tokens) // page_size
    return first, max(0, kv_tokens // page_size - first)


def page_keys(key_prefix: str, tokens: Sequence[int], namespace: Optional[Sequence], page_size: int,
              first_page: int) -> list[str]:
    """Store keys of the whole pages of ``tokens`` from ``first_page`` on: the page-hash chain
    from the root (every page's hash covers the pages before it), as the prefill server's tree
    names them (``StoreTier.keys``)."""
    hashes = chain(ROOT_HASH, namespace, tokens, page_size)
    return [key_prefix + h.hex() for h in hashes[first_page:]]


@dataclass(frozen=True)
class Put:
    """One PUT in flight (or waiting to be tried again): its staging pages (freed at its end),
    their keys and its tokens."""

    staging: tuple[int, ...]  # DRAM page ids, one per page, in key order
    tokens: int  # len(staging) x page size
    keys: tuple[str, ...] = ()  # store key of each staging page; () when not tracked
    attempt: int = 1  # this try's number, the first is 1
    first_s: float = 0.0  # when the first try was reserved, in the caller's clock (seconds)


class OffloadBooks:
    """Staging pages and PUTs in flight of one decode scheduler (one TP rank), with counts.

    Args:
        staging_pages: the DRAM staging area, in pages.
        page_size: tokens per page.
    """

    def __init__(self, staging_pages: int, page_size: int):
        self.allocator = PageAllocator(staging_pages)
        self.page_size = page_size
        self.in_flight: dict[int, Put] = {}  # job id -> put (submitted, or a retry waiting in `retries`)
        self.retries: dict[int, float] = {}  # job id -> when a retry not yet handed out is due, in seconds
        self._next_job = 0
        self.tokens = dict.fromkeys(OUTCOMES, 0)  # cumulative, per outcome
        self.requests = 0  # finished requests that offloaded at least one page
        self.retried_pages = 0  # pages tried again after a failed try (cumulative)

    def reserve(self, num_pages: int, keys: Sequence[str] = (), now_s: float = 0.0) -> Optional[tuple[int, list[int]]]:
        """Staging pages for a PUT: ``(job id, page ids)``, or None when the staging area cannot
        hold them now (the PUT is dropped and counted as ``staging_full``).

        Args:
            num_pages: pages of the PUT.
            keys: their store keys (kept for a retry; empty: a failed page is not retried).
            now_s: the caller's clock, in seconds.
        """
        pages = self.allocator.alloc(num_pages)
        if pages is None:
            self.tokens["staging_full"] += num_pages * self.page_size
            return None
        self._next_job += 1
        self.in_flight[self._next_job] = Put(tuple(pages), num_pages * self.page_size, tuple(keys), 1, now_s)
        self.requests += 1
        return self._next_job, pages

    def cancel(self, job_id: int) -> None:
        """A reserved PUT (or a due retry) that was never submitted: free it, count it failed."""
        put = self.in_flight.pop(job_id)
        self.retries.pop(job_id, None)
        self.allocator.free(put.staging)
        self.tokens["failed"] += put.tokens

    def finish(self, job_id: int, ok: Sequence[bool], now_s: float = 0.0) -> Optional[Put]:
        """A PUT ended (``ok``: one flag per page): count its stored pages and free their staging;
        its failed pages are tried again (their staging kept, under a new job id due after the
        backoff) while tries and budget last, else counted ``failed`` and freed.
        Returns the put, or None for an unknown job id."""
        put = self.in_flight.pop(job_id, None)
        if put is None:
            return None
        flags = [bool(flag) for flag in ok[: len(put.staging)]] + [False] * max(0, len(put.staging) - len(ok))
        self.tokens["stored"] += sum(flags) * self.page_size
        failed = [k for k, flag in enumerate(flags) if not flag]
        retry = (failed and len(put.keys) == len(put.staging) and put.attempt < PUT_ATTEMPTS
                 and now_s - put.first_s < PUT_RETRY_BUDGET_S)  # fmt: skip
        self.allocator.free([page for page, flag in zip(put.staging, flags) if flag or not retry])
        if not retry:
            self.tokens["failed"] += len(failed) * self.page_size
            return put
        again = Put(tuple(put.staging[k] for k in failed), len(failed) * self.page_size,
                    tuple(put.keys[k] for k in failed), put.attempt + 1, put.first_s)  # fmt: skip
        self._next_job += 1
        self.in_flight[self._next_job] = again
        backoff_s = PUT_RETRY_BACKOFF_S * 2 ** (put.attempt - 1)
        self.retries[self._next_job] = now_s + backoff_s
        self.retried_pages += len(failed)
        return put

    def due_retries(self, now_s: float) -> list[tuple[int, Put]]:
        """``(job id, put)`` of the retries whose backoff passed, oldest first; each is handed out
        once (submit it under that job id, or :meth:`cancel` it)."""
        due = sorted(job_id for job_id, due_s in self.retries.items() if due_s <= now_s)
        for job_id in due:
            del self.retries[job_id]
        return [(job_id, self.in_flight[job_id]) for job_id in due]

    def check_integrity(self) -> None:
        """Staging pages in use are exactly those of the PUTs in flight or waiting to retry."""
        held = sum(len(p.staging) for p in self.in_flight.values())
        assert held == self.allocator.num_used, (held, self.allocator.num_used)
        assert set(self.retries) <= set(self.in_flight), (set(self.retries), set(self.in_flight))
