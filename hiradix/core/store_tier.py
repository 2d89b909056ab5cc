"""The cluster-store tier's decisions: what to share, what to look up, when the store is off.

The store (Mooncake Store) is shared by every server, so it is the tier that lets a turn routed
to another server still hit (CachedAttention's AttentionStore, shared by the GPU servers). It is
recorded per node like the other tiers (``TreeNode.store_keys``), but it is a hint: the store
may drop an object at any time, so a store copy is confirmed only by a GET that verifies.

* Shares (PUT, DRAM -> store): ``write_through`` puts a node once its KV is in DRAM (a backup or
  an NVMe read landed), so another server can hit while the first still holds it in HBM;
  ``write_back`` puts it once it has left HBM (DRAM holds the last fast copy). Bounded in flight
  (jobs, and half of DRAM's pages: a wedged store call must not pin DRAM whole), and paused
  while a request waits at admission for a store lookup or GET (``MAX_PUT_PAUSE_STEPS`` at most).
  A write-through backup that found DRAM full is opened once room is made
  (:mod:`hiradix.core.deferred_backups`), and a DRAM copy queued for a PUT stays when its
  demotion to NVMe lands (:meth:`wants_put`), so every page is shared, not only those DRAM had
  room for at insert.
* Lookups: when the local match of a prompt ends, the pages that follow are asked for by key
  (one batched ``exists`` in the I/O worker); the leading run found becomes a store-only child of
  the last matched node and is fetched into DRAM (GET) before admission. A lookup started at
  admission makes the request wait, up to the load timeout; the look-ahead window starts them
  earlier for queued requests.
* Load or recompute (:mod:`hiradix.core.store_reads`, ``--hiradix-store-read``): of the run a
  lookup found, only the leading pages worth reading (faster than prefilling them, by this
  server's measured store bandwidth and prefill rate) become the child; the rest is recomputed
  as a miss (counted as ``skipped_slow``). ``never`` makes no lookups at all.
* Failures: a PUT job aborted on every rank (its I/O worker died or was restarted under it: a
  wedged store client is cut off that way) is queued again while its DRAM copy lasts, up to
  ``PUT_ATTEMPTS`` tries per node; a PUT the store refused (full, timed out) is dropped (counted):
  trying it again would only add load to a store that is refusing. A failed GET is a miss (the
  ledger forgets that store copy). ``STORE_FAILURES_IN_ROW`` steps in a row in which the store
  jobs of one direction that finished all failed (PUTs; GETs and lookups that failed as a whole)
  switch the tier off (per step, so the jobs one I/O worker death fails at once count once), with
  one warning: its records are forgotten and nothing is sent to the store until it is tried
  again ``STORE_RETRY_S`` later (doubling up to ``STORE_RETRY_MAX_S`` while it keeps failing;
  those retries are logged at info level, and one warning says when it works again). Under TP
  the retry happens in the step in which every rank's wait is over (each rank reads its own
  clock; :class:`~hiradix.core.ports.StepVotes`), so the ranks' books never split on it.

Keys are :mod:`hiradix.core.keys` content addresses: ``key_prefix`` (the KV fingerprint) + the
page hash, so a different model, page size or TP shard never reuses a key and requests with
different salts never share one.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from hiradix.core.keys import chain, node_hashes, prefix_hash
from hiradix.core.ledger import Kind, TierBooks
from hiradix.core.node import Tier, TreeMatch, TreeNode
from hiradix.core.placement import Placement
from hiradix.core.ports import IOClient
from hiradix.core.store_reads import StoreReadChoice
from hiradix.core.tree import TieredRadixTree

logger = logging.getLogger(__name__)

STORE_FAILURES_IN_ROW = 5  # steps in a row whose finished store jobs (one direction) all failed: switch-off
STORE_RETRY_S = 30.0  # first wait before a switched-off store is tried again
STORE_RETRY_MAX_S = 600.0  # longest wait between tries
MAX_PUTS_IN_FLIGHT = 32  # PUT jobs in flight, each one node
PUT_ATTEMPTS = 3  # tries of one node's PUT (an aborted job is queued again, behind the others)
# PUTs in flight pin their DRAM pages (the source) until the store answers; they stop starting
# once they hold this fraction of DRAM, so a slow or wedged store (the I/O worker restarts only
# after its call limit) leaves DRAM room for backups and NVMe reads instead of taking it whole.
MAX_PUT_DRAM_FRACTION = 0.5
# New PUTs wait while a request waits at admission for a store read (a lookup, or a GET it waits
# on): the store's bandwidth and the I/O worker's threads go to the read first. At most this many
# steps in a row (steps are counted alike on every TP rank), so steady reads never starve shares.
MAX_PUT_PAUSE_STEPS = 64
MAX_LOOKUP_PAGES = 4096  # pages asked for in one lookup
# A key where a lookup's run ended, or whose GET missed, is not looked up again until this many
# more ops were opened: admission retries a skipped request every step, and each retry would
# ask again and wait again (the store's ``exists`` may even keep saying "present" after a holder
# died, Mooncake: ~10 s, so lookup -> GET -> miss could loop). Op ids advance the same on every
# TP rank, so the ranks skip the same lookups.
MISS_HOLD_OPS = 1024
MAX_MISSED_KEYS = 4096
WRITE_POLICIES = ("write_through", "write_back")


@dataclass(eq=False)
class Lookup:
    """One ``exists`` query in flight: the pages after ``parent`` that another server may hold."""

    op_id: int
    parent: TreeNode  # the last node of the local match
    tokens: list[int]  # whole pages after it, at most MAX_LOOKUP_PAGES
    namespace: Optional[tuple]
    keys: list[str]  # one per page
    first_hash: bytes  # page hash of the first page: identifies the lookup
    started_s: float = 0.0  # when it was asked (its round trip is measured at its agreed answer)
    tail_tokens: int = 0  # the whole tail after the local match (``tokens`` stops at MAX_LOOKUP_PAGES)


class StoreTier:
    """Decides the cluster store's PUTs, lookups and on/off state for one tree (one TP rank).

    Args:
        tree: the tree.
        books: its ledger (PUT/GET transfers, op ids).
        placement: makes DRAM room for GETs.
        client: the I/O client that runs store jobs in the worker.
        key_prefix: prepended to each page hash (names the KV fingerprint).
        write_policy: ``write_through`` or ``write_back`` (see the module docstring).
        clock: monotonic seconds.
        retry_s: first wait before a switched-off store is tried again (``STORE_RETRY_S``).
        reads: how much of a store hit to read (default: always read, nothing measured).
        waited: whether a request waits at admission for an op id (``ReadWaits.waited``; new PUTs
            wait meanwhile). Default: never.

    Raises:
        ValueError: unknown ``write_policy``.
    """

    def __init__(self, tree: TieredRadixTree, books: TierBooks, placement: Placement, client: IOClient,
                 key_prefix: str, write_policy: str, clock: Callable[[], float], retry_s: float = STORE_RETRY_S,
                 reads: Optional[StoreReadChoice] = None, waited: Optional[Callable[[int], bool]] = None):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"store write policy must be one of {list(WRITE_POLICIES)}, got {write_policy!r}")
        self.tree, self.books, self.placement, self.client = tree, books, placement, client
        self.key_prefix = key_prefix
        self.write_back = write_policy == "write_back"
        self.clock = clock
        self.reads = reads if reads is not None else StoreReadChoice("always", 1.0, tree.page_size)
        self.waited = waited if waited is not None else (lambda op_id: False)
        self._paused_steps = 0  # steps in a row in which new PUTs waited for an admission read
        self.lookups: dict[int, Lookup] = {}  # op id -> lookup in flight
        self._by_hash: dict[bytes, Lookup] = {}  # first page hash -> lookup in flight
        self._to_put: dict[int, TreeNode] = {}  # node id -> node to share (insertion order)
        self._put_failures: dict[int, int] = {}  # node id -> its PUT jobs that failed (it is queued again)
        self._missed: OrderedDict[str, int] = OrderedDict()  # key whose GET missed -> op id then
        self._failures_in_row = {"writes": 0, "reads": 0}  # steps in a row whose PUT / GET + lookup jobs all failed
        self._went_through: dict[str, Optional[bool]] = {"writes": None, "reads": None}  # this step (None: no job)
        self.off_reason: Optional[str] = None
        self._retry_at_s: Optional[float] = None
        self.retry_s = retry_s
        self._retry_wait_s = retry_s
        self._warned = False  # a switch-off was warned about, and the store has not worked since
        self.counts = dict.fromkeys(("lookup_pages", "lookup_found_pages", "put_pages", "put_failed_pages",
                                     "get_pages", "get_failed_pages", "switch_offs", "put_retried_pages",
                                     "put_paused_steps"), 0)

    @property
    def enabled(self) -> bool:
        return self.off_reason is None

    def keys(self, hashes: Sequence[bytes]) -> list[str]:
        return [self.key_prefix + h.hex() for h in hashes]

    def keys_of(self, node: TreeNode) -> list[str]:
        """Store key of each page of ``node``."""
        return self.keys(node_hashes(self.tree.root, node, self.tree.page_size))

    # ------------------------------------------------------------ shares
    def note_in_dram(self, nodes: Sequence[TreeNode]) -> None:
        """Nodes whose KV just landed in DRAM (write-through shares them)."""
        if not self.write_back:
            self._queue(nodes)

    def note_left_hbm(self, nodes: Sequence[TreeNode]) -> None:
        """Nodes whose HBM copy was just dropped (write-back shares those still in DRAM)."""
        if self.write_back:
            self._queue(nodes)

    def wants_put(self, node: TreeNode) -> bool:
        """Whether ``node`` is queued for a PUT not yet started (its DRAM copy is the source)."""
        return node.id in self._to_put

    def _queue(self, nodes: Sequence[TreeNode]) -> None:
        if self.enabled:
            for node in nodes:
                self._to_put[node.id] = node

    def submit_puts(self) -> None:
        """Start PUTs of the queued nodes still in DRAM and not in the store, bounded in flight:
        at most ``MAX_PUTS_IN_FLIGHT`` jobs, and none started once those in flight hold
        ``MAX_PUT_DRAM_FRACTION`` of DRAM's pages (the rest wait in the queue)."""
        if not self.enabled:
            self._to_put.clear()
            return
        if self._paused():
            return
        ops = self.books.in_flight(Kind.PUT)
        in_flight, pages = len(ops), sum(len(op.src_ids) for op in ops)
        max_pages = max(1, int(self.books.dram.capacity * MAX_PUT_DRAM_FRACTION))
        for node_id in list(self._to_put):
            if in_flight >= MAX_PUTS_IN_FLIGHT or pages >= max_pages:
                return
            node = self._to_put.pop(node_id)
            if not node.alive or not node.in_tier(Tier.DRAM) or node.in_tier(Tier.STORE) or node.pinned[Tier.STORE]:
                self._put_failures.pop(node_id, None)
                continue
            op = self.books.prepare(Kind.PUT, [node], store_keys=self.keys_of(node))
            self.client.submit_put(op.op_id, op.src_ids, op.dst_ids)
            in_flight, pages = in_flight + 1, pages + len(op.src_ids)

    def _paused(self) -> bool:
        """Whether new PUTs wait this step: a request waits at admission for a lookup or a GET,
        and they have not waited ``MAX_PUT_PAUSE_STEPS`` steps in a row yet."""
        if self._to_put and self._paused_steps < MAX_PUT_PAUSE_STEPS and self._read_waited_on():
            self._paused_steps += 1
            self.counts["put_paused_steps"] += 1
            return True
        self._paused_steps = 0
        return False

    def _read_waited_on(self) -> bool:
        return (any(self.waited(op_id) for op_id in self.lookups)
                or any(self.waited(op.op_id) for op in self.books.in_flight(Kind.GET)))

    def note_put_done(self, nodes: Sequence[TreeNode], aborted: bool) -> None:
        """A PUT job of ``nodes`` finished with the same outcome on every rank: an aborted one
        (its worker died under it) is queued again (its DRAM copy is the source;
        :meth:`submit_puts` checks it is still there) unless its nodes were aborted
        ``PUT_ATTEMPTS`` times; any other outcome ends its tries."""
        for node in nodes:
            failures = self._put_failures.pop(node.id, 0) + 1
            if aborted and failures < PUT_ATTEMPTS:
                self._put_failures[node.id] = failures
                self.counts["put_retried_pages"] += node.num_tokens // self.tree.page_size
                self._queue([node])

    # ------------------------------------------------------------ lookups
    def tail_hash(self, m: TreeMatch, tokens: Sequence[int], namespace: Optional[tuple]) -> Optional[bytes]:
        """Page hash of the first whole page after the match, if the match ends on a node boundary."""
        ps, end = self.tree.page_size, m.matched_len
        if len(tokens) - end < ps:
            return None
        last = m.nodes[-1] if m.nodes else self.tree.root
        if sum(n.num_tokens for n in m.nodes) != end:
            return None  # a peek that ends inside a node: the tree knows what follows
        return chain(prefix_hash(self.tree.root, last, ps), namespace, tokens[end : end + ps], ps)[0]

    def lookup(self, m: TreeMatch, tokens: Sequence[int], namespace: Optional[tuple]) -> Optional[Lookup]:
        """Ask the store for the pages after a local match (split at its end); returns the lookup
        in flight for them (new or already running), or None (nothing to ask, store off)."""
        if not self.enabled or not self.reads.reads_store:
            return None
        first = self.tail_hash(m, tokens, namespace)
        if first is None:
            return None
        if first in self._by_hash:
            return self._by_hash[first]
        if self._recently_missed(self.key_prefix + first.hex()):
            return None
        ps, end = self.tree.page_size, m.matched_len
        whole = end + (len(tokens) - end) // ps * ps
        if not self.reads.lookup_worth(whole - end):  # recomputing the tail is faster than asking
            return None
        tail = list(tokens[end : min(whole, end + MAX_LOOKUP_PAGES * ps)])
        parent = m.nodes[-1] if m.nodes else self.tree.root
        keys = self.keys(chain(prefix_hash(self.tree.root, parent, ps), namespace, tail, ps))
        lookup = Lookup(self.books.new_op_id(), parent, tail, namespace, keys, first, self.clock(), whole - end)
        self.lookups[lookup.op_id] = lookup
        self._by_hash[first] = lookup
        self.client.submit_exists(lookup.op_id, keys)
        self.counts["lookup_pages"] += len(keys)
        return lookup

    def _hold(self, keys: Sequence[str]) -> None:
        """Do not look ``keys`` up again for ``MISS_HOLD_OPS`` ops: each ends a run the store
        does not hold (a lookup said so, or a GET missed), and the admission retrying the same
        request would otherwise ask again and wait again, forever."""
        now = self.books.new_op_id()
        for key in keys:
            self._missed[key] = now
            self._missed.move_to_end(key)
        while len(self._missed) > MAX_MISSED_KEYS:
            self._missed.popitem(last=False)

    def _recently_missed(self, key: str) -> bool:
        at = self._missed.get(key)
        if at is None:
            return False
        if self.books.new_op_id() - at < MISS_HOLD_OPS:  # op ids are cheap; skipping one is harmless
            return True
        del self._missed[key]
        return False

    def pending(self, first_hash: Optional[bytes]) -> Optional[Lookup]:
        return self._by_hash.get(first_hash) if first_hash is not None else None

    def finish_lookup(self, op_id: int, found_pages: int, read_pages: Optional[int] = None) -> Optional[TreeNode]:
        """Apply an agreed lookup result: the leading ``read_pages`` (default: all ``found_pages``;
        fewer when the rest is not worth reading) become a store-only child of its parent (if the
        tree has not grown there meanwhile). Returns the new node, or None."""
        lookup = self.lookups.pop(op_id, None)
        if lookup is None:
            return None
        self.reads.note_lookup(self.clock() - lookup.started_s, lookup.tail_tokens, len(lookup.keys), found_pages)
        self._by_hash.pop(lookup.first_hash, None)
        self.counts["lookup_found_pages"] += found_pages
        read_pages = found_pages if read_pages is None else min(read_pages, found_pages)
        if read_pages < len(lookup.keys):
            self._hold([lookup.keys[max(0, read_pages)]])  # where the run ends: not asked again for a while
        parent, ps = lookup.parent, self.tree.page_size
        if read_pages <= 0 or not self.enabled or (parent is not self.tree.root and not parent.alive):
            return None
        tokens = lookup.tokens[: read_pages * ps]
        try:
            return self.tree.add_child(parent, tokens, lookup.namespace, Tier.STORE, lookup.keys[:read_pages])
        except ValueError:
            return None  # a child for this page appeared meanwhile (inserted or found): keep it

    # ------------------------------------------------------------ outcomes, on/off
    def note_job(self, kind: Optional[Kind], pages: int, ok_pages: int, aborted: bool,
                 missed_keys: Sequence[str] = ()) -> None:
        """Count one finished store job (``kind`` None: a lookup; it fails only when aborted) for
        this step's verdict (:meth:`_end_step`). ``missed_keys``: keys a GET did not find (not
        looked up again for a while)."""
        if kind == Kind.PUT:
            self.counts["put_pages"] += ok_pages
            self.counts["put_failed_pages"] += pages - ok_pages
        elif kind == Kind.GET:
            self.counts["get_pages"] += ok_pages
            self.counts["get_failed_pages"] += pages - ok_pages
        if missed_keys:
            self._hold(missed_keys)
        failed = aborted or (kind == Kind.PUT and ok_pages < pages)
        direction = "writes" if kind == Kind.PUT else "reads"
        self._went_through[direction] = bool(self._went_through[direction]) or not failed
        if kind is not None and ok_pages > 0:  # data moved: the store works (a lookup tells nothing)
            if self._warned:
                logger.warning("hiradix: the cluster store works again")
            self._retry_wait_s, self._warned = self.retry_s, False

    def _end_step(self) -> None:
        """A direction whose jobs all failed this step extends its streak (one job went through:
        the streak ends); ``STORE_FAILURES_IN_ROW`` such steps switch the tier off."""
        for direction, went_through in self._went_through.items():
            if went_through is None:
                continue
            streak = 0 if went_through else self._failures_in_row[direction] + 1
            self._failures_in_row[direction] = streak
            if streak >= STORE_FAILURES_IN_ROW:
                self.switch_off(f"store {direction} failed in {streak} steps in a row (see the I/O worker's warnings)")
        self._went_through = dict.fromkeys(self._went_through)

    def switch_off(self, reason: str) -> None:
        """Stop using the store (one warning) and forget its records; try again later."""
        if not self.enabled:
            return
        self.off_reason = reason
        self.counts["switch_offs"] += 1
        self._retry_at_s = self.clock() + self._retry_wait_s
        self._to_put.clear()
        self._put_failures.clear()
        forgotten = self.placement.forget(Tier.STORE)
        if self._warned:  # one warning until it works again; the failed retries go to the info log
            logger.info("hiradix: cluster store still unusable: %s; next try in %.0f s", reason, self._retry_wait_s)
        else:
            logger.warning("hiradix: cluster store switched off: %s; %d store records forgotten; "
                           "serving from the local tiers, trying the store again in %.0f s",
                           reason, forgotten, self._retry_wait_s)
            self._warned = True

    def retry_due(self) -> bool:
        """Whether the store is off and the wait before trying it again is over on this rank's
        clock (under TP the ranks agree on it before :meth:`step` acts on it)."""
        return not self.enabled and self._retry_at_s is not None and self.clock() >= self._retry_at_s

    def step(self, retry: bool) -> None:
        """Per step: try a switched-off store again if ``retry`` (:meth:`retry_due`, as every TP
        rank agreed: the same step on every rank); share what is queued."""
        self._end_step()
        if retry and not self.enabled:
            logger.info("hiradix: trying the cluster store again (off since: %s)", self.off_reason)
            self.off_reason, self._retry_at_s = None, None
            self._failures_in_row = dict.fromkeys(self._failures_in_row, 0)
            self._retry_wait_s = min(STORE_RETRY_MAX_S, self._retry_wait_s * 2)
        if not self.enabled and self.tree.tier_tokens[Tier.STORE]:
            self.placement.forget(Tier.STORE)  # records pinned at switch-off time, released since
        self.submit_puts()

    def reset(self) -> None:
        """The tree is being reset: forget queued shares. Lookups in flight stay until their
        results (the ranks agree on them; their old parents are dead, so nothing is attached)."""
        self._by_hash.clear()
        self._to_put.clear()
