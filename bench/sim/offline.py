"""Offline references for the trace simulator: Belady's optimum and plain LRU over the trace's blocks.

Both replay the trace's ``hash_ids`` (one id per 512-token block; equal ids = equal content; an
id encodes its whole prefix) through **one pool of** ``capacity_blocks`` **blocks**, with prefix
semantics: a request hits the leading run of its blocks the pool holds (a block after a miss is
recomputed, as in a prefix cache); afterwards all its blocks are in the pool, and blocks are
evicted until ``capacity_blocks`` remain. Hit rate = block hits / block references (the
simulator's ``block %``). No timing, no queue, no tiers: what the pool's bytes can give.

* **Belady** (Belady 1966; Mattson et al. 1970): evict the block whose next use (the next request
  containing it) is farthest, never-used-again first, ties deeper block first. A block's next
  use is never before its parent's (a request holds a block's whole prefix), so the pool stays
  prefix-closed and its hits are prefix hits; with blocks of one size and optional insertion
  this is the offline optimum, an upper bound for every online policy at that capacity.
  Next uses are precomputed from the trace (one backward pass); the pool is a heap keyed by
  next use with lazy deletion: O(references x log capacity).
* **infinite**: never evicts (what the trace's reuse allows at all).
* **LRU**: evict the least recently used block; a request touches its blocks last to first, so
  a prefix is never older than what follows it (a radix tree's leaf-first LRU).

``bench/sim/simulate.py --sweep`` sizes the pool as the scenario's DRAM + NVMe bytes (the cache
tiers; HBM is left out: it mostly holds the running requests' KV, and under write-through its
cached pages are copies of DRAM's).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Sequence

NEVER = 1 << 62  # next use of a block no later request contains
BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake trace


def _block_lists(trace: Sequence) -> list[Sequence[int]]:
    return [r.hash_ids for r in trace]


def next_uses(blocks: Sequence[Sequence[int]]) -> list[list[int]]:
    """Per request, per block: index of the next request containing that block (``NEVER``)."""
    out: list[list[int]] = [[]] * len(blocks)
    last: dict[int, int] = {}
    for i in range(len(blocks) - 1, -1, -1):
        ids = blocks[i]
        out[i] = [last.get(b, NEVER) for b in ids]
        for b in ids:
            last[b] = i
    return out


def _prefix_hits(ids: Sequence[int], pool) -> int:
    k = 0
    while k < len(ids) and ids[k] in pool:
        k += 1
    return k


def belady_hit_rate(trace: Sequence, capacity_blocks: int) -> float:
    """Block hit rate of Belady's optimum over one pool of ``capacity_blocks`` blocks."""
    blocks = _block_lists(trace)
    nxt = next_uses(blocks)
    pool: dict[int, tuple[int, int]] = {}  # block -> (next use, depth) as pushed last
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block); stale entries skipped
    hits = refs = 0
    for i, ids in enumerate(blocks):
        hits += _prefix_hits(ids, pool)
        refs += len(ids)
        for depth, (b, use) in enumerate(zip(ids, nxt[i])):
            pool[b] = (use, depth)
            heapq.heappush(heap, (-use, -depth, b))
        while len(pool) > capacity_blocks:
            use, depth, b = heapq.heappop(heap)
            if pool.get(b) == (-use, -depth):
                del pool[b]
    return hits / max(refs, 1)


def lru_hit_rate(trace: Sequence, capacity_blocks: int) -> float:
    """Block hit rate of leaf-first LRU over one pool of ``capacity_blocks`` blocks."""
    pool: OrderedDict[int, None] = OrderedDict()
    hits = refs = 0
    for ids in _block_lists(trace):
        hits += _prefix_hits(ids, pool)
        refs += len(ids)
        for b in reversed(ids):
            pool[b] = None
            pool.move_to_end(b)
        while len(pool) > capacity_blocks:
            pool.popitem(last=False)
    return hits / max(refs, 1)


def infinite_hit_rates(trace: Sequence, page_size: int) -> dict:
    """Hit rates of a cache that never evicts and sees every earlier request at once.

    Returns:
        ``block_hit_rate`` (hits / block references, every block counted) and
        ``token_hit_rate`` (whole-page tokens of seen blocks / prompt tokens).
    """
    seen: set[int] = set()
    refs = block_hits = hit_tokens = prompt_tokens = 0
    for req in trace:
        key_len = req.input_len - req.input_len % page_size
        for i, h in enumerate(req.hash_ids):
            if h in seen:
                block_hits += 1
                hit_tokens += max(0, min((i + 1) * BLOCK_TOKENS, key_len) - i * BLOCK_TOKENS)
        refs += len(req.hash_ids)
        prompt_tokens += req.input_len
        seen.update(req.hash_ids)
    return {
        "block_refs": refs,
        "distinct_blocks": len(seen),
        "block_hit_rate": block_hits / max(refs, 1),
        "token_hit_rate": hit_tokens / max(prompt_tokens, 1),
    }


def distinct_blocks(trace: Sequence) -> int:
    """Distinct block ids of the trace (x 512 = its unique tokens)."""
    return len({b for r in trace for b in r.hash_ids})
