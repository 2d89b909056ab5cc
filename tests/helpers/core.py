"""Helpers of the core tests: a deterministic clock, a device slot pool, a tree + ledger harness.

The harness drives the tree, the ledger (:class:`TierBooks`) and the placement as the controller
does, without movers: a test prepares a transfer, then completes it by id, as an ack would.
"""

from __future__ import annotations

import itertools
from typing import Optional

from hiradix.core.ledger import Kind, TierBooks, Transfer
from hiradix.core.placement import Placement
from hiradix.core.policy import EvictionPolicy
from hiradix.core.tree import TieredRadixTree

PS = 2  # tokens per page in the ledger scenarios


class FakeClock:
    """Deterministic monotonic clock: each call advances by one second."""

    def __init__(self):
        self._t = itertools.count(1)

    def __call__(self) -> float:
        return float(next(self._t))


class SlotPool:
    """Hands out unique device slot ids, like SGLang's allocator; tracks what is free."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.free = list(range(capacity, 0, -1))

    def alloc(self, n: int) -> list[int]:
        assert len(self.free) >= n, "pool exhausted"
        return [self.free.pop() for _ in range(n)]

    def release(self, slots) -> None:
        self.free.extend(int(s) for s in slots)


def evict_hbm(tree: TieredRadixTree, num_tokens: int, books: Optional[TierBooks] = None) -> list:
    """HBM eviction as the prefix cache runs it without write-back (placement's walk)."""
    return Placement(tree, books).evict_hbm(num_tokens)


def prepare(books: TierBooks, kind: Kind, nodes, **kwargs) -> Optional[Transfer]:
    """Make room (placement) and open a transfer (ledger), as the controller does."""
    return Placement(books.tree, books).prepare(kind, nodes, **kwargs)


def complete(books: TierBooks, op_id: int, ok=True, aborted: bool = False) -> Optional[Transfer]:
    """Complete ``op_id`` as an ack would; a landed store then moves the page down (placement)."""
    done = books.complete(op_id, ok, aborted=aborted)
    if done is not None and done.kind == Kind.DEMOTE:
        Placement(books.tree, books).after_demote(done)
    return done


class Harness:
    """A tree + ledger + placement + a device slot pool, driven like the cache drives them."""

    def __init__(self, dram_pages: int, nvme_slots: int, hbm_slots: int = 256, policy: Optional[EvictionPolicy] = None):
        self.tree = TieredRadixTree(PS, policy, clock=FakeClock())
        self.books = TierBooks(self.tree, dram_pages, nvme_slots)
        self.placement = Placement(self.tree, self.books)
        self.hbm = SlotPool(hbm_slots)

    def check(self) -> None:
        self.books.check_integrity()
        held = sum(len(s) for s in self.tree.all_hbm_slots())
        assert len(self.hbm.free) + held == self.hbm.capacity

    def insert(self, tokens):
        slots = self.hbm.alloc(len(tokens))
        dup, node, new = self.tree.insert(tokens, slots)
        self.hbm.release(slots[:dup])
        return node, new

    def backup(self, nodes):
        op = self.placement.prepare(Kind.BACKUP, nodes)
        assert op is not None
        return op

    def evict_hbm(self, num_tokens):
        for slots in self.placement.evict_hbm(num_tokens):
            self.hbm.release(slots)

    def demote(self, node):
        op = self.placement.prepare(Kind.DEMOTE, [node])
        assert op is not None
        return op

    def promote(self, nodes):
        n = sum(x.num_tokens for x in nodes)
        slots = self.hbm.alloc(n)
        return self.books.prepare(Kind.PROMOTE, nodes, hbm_slots=slots)

    def complete(self, op_id: int, ok=True, aborted: bool = False) -> Optional[Transfer]:
        return complete(self.books, op_id, ok, aborted)


def serve_request(cache, tokens: list[int]):
    """One request through a :class:`~hiradix.core.prefix_cache.TieredPrefixCache`, as SGLang runs
    it: match, lock the HBM hit, load the DRAM part back, compute the rest, insert, finish. Returns
    the request's last node (unlocked)."""
    m = cache.match(tokens)
    cache.lock(m.hbm_node)
    back = cache.load_back(m.hbm_node, m.dram_node, m.dram_len)
    if back.node is not m.hbm_node:
        cache.lock(back.node)
        cache.unlock(m.hbm_node)
    hit = m.hbm_len + back.loaded
    new = cache.alloc_device(len(tokens) - hit)
    _, last = cache.checkpoint(tokens, None, cache.path_slots(back.node) + new, hit)
    cache.lock(last)
    cache.unlock(back.node)
    cache.unlock(last)
    return last
