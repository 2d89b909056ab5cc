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

Pure Python (no torch, no I/O): one owner, the decode scheduler; the staging pages are ids of
a :class:`hiradix.core.allocator.PageAllocator`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from hiradix.core.allocator import PageAllocator
from hiradix.core.keys import ROOT_HASH, chain

OUTCOMES = ("stored", "staging_full", "failed")  # counted tokens, by what became of them


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
    """One PUT in flight: its staging pages (freed at its end) and its tokens."""

    staging: tuple[int, ...]  # DRAM page ids, one per page, in key order
    tokens: int  # len(staging) x page size


class OffloadBooks:
    """Staging pages and PUTs in flight of one decode scheduler (one TP rank), with counts.

    Args:
        staging_pages: the DRAM staging area, in pages.
        page_size: tokens per page.
    """

    def __init__(self, staging_pages: int, page_size: int):
        self.allocator = PageAllocator(staging_pages)
        self.page_size = page_size
        self.in_flight: dict[int, Put] = {}  # job id -> put
        self._next_job = 0
        self.tokens = dict.fromkeys(OUTCOMES, 0)  # cumulative, per outcome
        self.requests = 0  # finished requests that offloaded at least one page

    def reserve(self, num_pages: int) -> Optional[tuple[int, list[int]]]:
        """Staging pages for a PUT: ``(job id, page ids)``, or None when the staging area cannot
        hold them now (the PUT is dropped and counted as ``staging_full``)."""
        pages = self.allocator.alloc(num_pages)
        if pages is None:
            self.tokens["staging_full"] += num_pages * self.page_size
            return None
        self._next_job += 1
        self.in_flight[self._next_job] = Put(tuple(pages), num_pages * self.page_size)
        self.requests += 1
        return self._next_job, pages

    def cancel(self, job_id: int) -> None:
        """A reserved PUT that was never submitted (the copy failed): free it, count it failed."""
        self.finish(job_id, [False] * len(self.in_flight[job_id].staging))

    def finish(self, job_id: int, ok: Sequence[bool]) -> Optional[Put]:
        """A PUT ended (``ok``: one flag per page): free its staging pages, count its tokens.
        Returns the put, or None for an unknown job id."""
        put = self.in_flight.pop(job_id, None)
        if put is None:
            return None
        self.allocator.free(put.staging)
        stored = sum(1 for flag in ok[: len(put.staging)] if flag) * self.page_size
        self.tokens["stored"] += stored
        self.tokens["failed"] += put.tokens - stored
        return put

    def check_integrity(self) -> None:
        """Staging pages in use are exactly those of the PUTs in flight."""
        held = sum(len(p.staging) for p in self.in_flight.values())
        assert held == self.allocator.num_used, (held, self.allocator.num_used)
