"""Which pages entered or left which tier: the per-step, bounded record behind KV events (pure).

With ``--kv-events-config`` set, SGLang's scheduler takes the cache's events once per batch and
when idle (``managers/scheduler_components/kv_events_publisher.py``) and publishes them through
its own ZMQ publisher. :class:`TierEvents` is what the tree feeds at its single points of tier
change (:meth:`~hiradix.core.tree.TieredRadixTree.attach`, ``detach``, ``reset``), and what
``hiradix.sglang_plugin.kv_events`` turns into SGLang's ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``. Off (the tree's ``events`` is None) nothing is recorded, hashed or built.

A page is named by its key: the page-hash chain state a :class:`PageKeys` computes from the
previous page's key, the namespace and the page's tokens (the server uses SGLang's own hash, so a
consumer built for SGLang matches). Keys are cached per node (``TreeNode.event_keys``; a split
shares them out like the tiers' ids) and computed once per node, from its nearest cached ancestor.

Per step (between two :meth:`TierEvents.take`), changes are netted per ``(tier, page)``: a page
stored and removed again in the same step, or removed and stored again, changes nothing and is
not sent; each page that changed is sent once. A batch lists ``TiersCleared`` first (after a
flush), then removals, then stores, a page's parent before it when both are in the batch, runs
of a chain in one event (as SGLang's ``KVCacheEventRecorder.enqueue`` coalesces).

Bounds and overflow: at most ``max_pending_pages`` page changes wait for a take. One more drops
them and switches recording off until the next take, which sends ``TiersCleared`` and then the
whole current state (every page of every tier, parents first): the consumer's view is exact
again, and the cost is the tree's size once, not the churn's. A new record starts the same way
(``TiersCleared`` first): a consumer that keeps its view across a server restart drops what the
previous process published, then gets the NVMe pages re-indexed at start as stored.

Consumer's view: per tier, the set of page keys; replaying the batches in order (clear, remove,
store) gives exactly the pages the tree holds in each tier (:func:`replay`). Two nodes whose
pages hash alike (SGLang's event hash leaves ``extra_key`` out unless it names a LoRA adapter)
count as one page, as in SGLang's own events.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Iterable, Optional, Protocol, Sequence

from hiradix.core.node import Tier, TreeNode

if TYPE_CHECKING:
    from hiradix.core.tree import TieredRadixTree

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_PAGES = 1 << 16  # page changes waiting for a take before the overflow re-sync


class PageKeys(Protocol):
    """Names pages by the hash chain of their prefix (the server: SGLang's page hash)."""

    def chain(self, prior: Optional[Hashable], namespace: Optional[tuple], tokens: Sequence[int]) -> list[Hashable]:
        """Key of each whole page of ``tokens`` after a page keyed ``prior`` (None: a prefix's
        first page in ``namespace``); pure, the same inputs give the same keys."""
        ...


@dataclass(frozen=True, slots=True)
class PagesStored:
    """``tier`` now holds these pages: a chain, ``keys[0]`` follows the page ``parent_key``."""

    tier: Tier
    keys: list  # one key per page, in prefix order
    parent_key: Optional[Hashable]  # key of the page before keys[0]; None: the prefix's first page
    tokens: list[int]  # the pages' token ids, len(keys) * page_size
    namespace: Optional[tuple]  # (extra_key, cache_salt) or None


@dataclass(frozen=True, slots=True)
class PagesRemoved:
    """``tier`` no longer holds these pages."""

    tier: Tier
    keys: list
    namespace: Optional[tuple]


@dataclass(frozen=True, slots=True)
class TiersCleared:
    """Every tier is empty (a flush, the first batch of a record, or the overflow re-sync)."""


TierEvent = PagesStored | PagesRemoved | TiersCleared


class TierEvents:
    """The record of one tree's tier changes since the last :meth:`take` (one scheduler, one DP rank).

    Args:
        tree: the tree whose nodes' tiers are recorded (read by the overflow re-sync).
        page_keys: names each page (see :class:`PageKeys`).
        max_pending_pages: page changes that may wait for a take; one more: the re-sync.
    """

    def __init__(self, tree: TieredRadixTree, page_keys: PageKeys, max_pending_pages: int = DEFAULT_MAX_PENDING_PAGES):
        if max_pending_pages < 1:
            raise ValueError(f"max_pending_pages must be >= 1, got {max_pending_pages}")
        self.tree, self.page_keys, self.max_pending_pages = tree, page_keys, max_pending_pages
        # (tier, key) -> (stored, parent key, tokens, namespace): stored or removed this step
        self._pending: dict[tuple[Tier, Hashable], tuple] = {}
        self._cleared = True  # send TiersCleared first (a new record: see the module docstring)
        self._resync = False  # overflowed: the next take sends the whole state
        self.overflows = 0  # times the bound was hit (each cost one re-sync)

    # ------------------------------------------------------------ fed by the tree
    def stored(self, node: TreeNode, tier: Tier) -> None:
        """``tier`` took a copy of ``node`` (called by the tree after the record changed)."""
        if self._resync:
            return
        prior, ps, pending = self.parent_key(node), self.tree.page_size, self._pending
        for i, key in enumerate(self.keys_of(node)):
            slot = (tier, key)
            change = pending.get(slot)
            if change is None:
                pending[slot] = (True, prior, node.tokens[i * ps : (i + 1) * ps], node.namespace)
            elif not change[0]:
                del pending[slot]  # removed earlier in this step: unchanged since the last take
            # else: stored twice (two nodes with one key); one store says it
            prior = key
        self._bound()

    def removed(self, node: TreeNode, tier: Tier) -> None:
        """``tier`` dropped ``node``'s copy (called by the tree while ``node`` is still linked)."""
        if self._resync:
            return
        pending, gone = self._pending, (False, None, None, node.namespace)
        for key in self.keys_of(node):
            slot = (tier, key)
            change = pending.get(slot)
            if change is None:
                pending[slot] = gone
            elif change[0]:
                del pending[slot]  # stored earlier in this step: unchanged since the last take
            # else: removed twice (two nodes with one key); one removal says it
        self._bound()

    def cleared(self) -> None:
        """Every tier was emptied (the tree's reset: SGLang's ``flush_cache``)."""
        self._pending.clear()
        self._cleared = True

    # ------------------------------------------------------------ read by the publisher
    def take(self) -> list[TierEvent]:
        """This step's changes, netted and ordered (see the module docstring); starts a new step.

        Returns:
            The events, oldest state first; empty when nothing changed.
        """
        if self._resync:
            self._resync, self._cleared = False, False
            self._pending = {}
            return [TiersCleared(), *coalesce(self._snapshot())]
        out: list[TierEvent] = [TiersCleared()] if self._cleared else []
        self._cleared = False
        pending, self._pending = self._pending, {}
        removed: dict[tuple[Tier, Optional[tuple]], list] = {}
        for (tier, key), (stored, _, _, namespace) in pending.items():
            if not stored:
                removed.setdefault((tier, namespace), []).append(key)
        out += [PagesRemoved(tier, keys, ns) for (tier, ns), keys in removed.items()]
        out += coalesce(_parents_first(pending))
        return out

    @property
    def pending_pages(self) -> int:
        """Page changes waiting for the next take."""
        return len(self._pending)

    # ------------------------------------------------------------ keys
    def keys_of(self, node: TreeNode) -> list:
        """Key of each page of ``node`` (cached on the node; missing ancestors computed first)."""
        if node.event_keys is not None:
            return node.event_keys
        missing, top = [], node
        while top is not self.tree.root and top.event_keys is None:
            missing.append(top)
            top = top.parent
        prior = None if top is self.tree.root else top.event_keys[-1]
        for n in reversed(missing):
            n.event_keys = list(self.page_keys.chain(prior, n.namespace, n.tokens))
            prior = n.event_keys[-1]
        return node.event_keys

    def parent_key(self, node: TreeNode) -> Optional[Hashable]:
        """Key of the page before ``node``'s first one; None below the root."""
        return None if node.parent is self.tree.root else self.keys_of(node.parent)[-1]

    # ------------------------------------------------------------ internals
    def _bound(self) -> None:
        if len(self._pending) > self.max_pending_pages:
            self._pending = {}
            self._resync = True
            self.overflows += 1
            logger.info("hiradix: KV events: over %d page changes in one step; the next batch clears the view "
                        "and sends every tier's pages again", self.max_pending_pages)

    def _snapshot(self) -> Iterable[PagesStored]:
        """Every page of every tier, parents before children (the re-sync)."""
        for node in self.tree.iter_nodes():
            tiers = node.tiers()
            if tiers:
                keys, parent = self.keys_of(node), self.parent_key(node)
                for tier in tiers:
                    yield PagesStored(tier, keys, parent, list(node.tokens), node.namespace)


def _parents_first(pending: dict[tuple[Tier, Hashable], tuple]) -> Iterable[PagesStored]:
    """One :class:`PagesStored` per stored page, a page after its parent when both were stored."""
    done: set = set()
    for slot, change in pending.items():
        if not change[0] or slot in done:
            continue
        chain = [slot]  # this page and its ancestors stored in this step and not yet sent
        while True:
            parent = (slot[0], pending[chain[-1]][1])
            up = pending.get(parent)
            if parent[1] is None or up is None or not up[0] or parent in done:
                break
            chain.append(parent)
        for tier_key in reversed(chain):
            done.add(tier_key)
            _, parent_key, tokens, namespace = pending[tier_key]
            yield PagesStored(tier_key[0], [tier_key[1]], parent_key, list(tokens), namespace)


def coalesce(events: Iterable[PagesStored]) -> list[PagesStored]:
    """Join consecutive stores of one chain (same tier and namespace, each following the last)."""
    runs: list[tuple[Tier, list, Optional[Hashable], list, Optional[tuple]]] = []
    for e in events:
        last = runs[-1] if runs else None
        if last is not None and last[0] == e.tier and last[4] == e.namespace and e.parent_key == last[1][-1]:
            last[1].extend(e.keys)
            last[3].extend(e.tokens)
        else:
            runs.append((e.tier, list(e.keys), e.parent_key, list(e.tokens), e.namespace))
    return [PagesStored(*run) for run in runs]


def replay(batches: Iterable[Sequence[TierEvent]], view: Optional[dict[Tier, set]] = None) -> dict[Tier, set]:
    """A consumer's view: per tier, the page keys the events say it holds (for tests and tools).

    Raises:
        AssertionError: an event stores a page the view holds or removes one it does not
            (a duplicated, lost or stale event).
    """
    view = {t: set() for t in Tier} if view is None else view
    for batch in batches:
        for e in batch:
            if isinstance(e, TiersCleared):
                for pages in view.values():
                    pages.clear()
            elif isinstance(e, PagesRemoved):
                assert set(e.keys) <= view[e.tier], f"{e.tier.name}: removes pages it does not hold"
                view[e.tier].difference_update(e.keys)
            else:
                assert not set(e.keys) & view[e.tier], f"{e.tier.name}: stores pages it holds"
                view[e.tier].update(e.keys)
    return view


def tree_view(events: TierEvents) -> dict[Tier, set]:
    """Per tier, the keys of the pages the tree holds now (what :func:`replay` must give)."""
    view: dict[Tier, set] = {t: set() for t in Tier}
    for node in events.tree.iter_nodes():
        for tier in node.tiers():
            view[tier].update(events.keys_of(node))
    return view


__all__ = ["DEFAULT_MAX_PENDING_PAGES", "PageKeys", "PagesRemoved", "PagesStored", "TierEvent", "TierEvents",
           "TiersCleared", "coalesce", "replay", "tree_view"]
