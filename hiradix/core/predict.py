"""The ``predictive`` policy: hit density per class of prefix, learned online, behind the queue.

Model: LHD, hit density (Beckmann, Chen and Cidon, "LHD: Improving Cache Hit Rate by Maximizing
Hit Density", NSDI '18, §3-4), over classes of KV prefixes as "KVCache Cache in the Wild" (Wang
et al., USENIX ATC '25, §4-5) finds them: reuse time and probability are hard to predict over all
requests but follow a pattern within a request category. Here:

* **Stamps.** Every insert of a request's KV stamps the nodes of its path with
  ``(class, turn, time, ended)``; ``ended`` marks the last node (where the turn ended).
* **Classes.** A node with two or more children is ``SHARED`` (a system prompt or a document
  many requests start with). The other nodes take the class of the request that stamped them:
  its *turn* (0 for a first turn; a request whose reused part ends in a node that ended an
  earlier turn continues that conversation: turn + 1; buckets 0, 1, 2+) and its prompt size,
  relative to the recent prompts (quartiles of a decaying histogram of log2 sizes, so no unit
  of pages or tokens is assumed).
* **Events**, weighted by tokens, counted per class in a histogram over the node's *age* (time
  since its stamp; buckets 0.25 s apart at first, then growing by sqrt(2) up to ~4.5 h): a *hit*
  when a later request's insert covers the node (it reused it), an *eviction* when the node
  leaves the last tier holding it. Counts decay with a half-life (``half_life_s``).
* **Hit density** of a class at age ``a`` = expected hits / expected remaining lifetime, both
  from the events at ages >= ``a`` (LHD's estimator, recomputed every ``update_s``): high while
  the reuses of that class are still to come (a conversation within its users' think time), low
  past the ages where they stop (a one-shot prefix, a conversation that did not come back). A
  class with fewer than ``MIN_CLASS_EVENTS`` events uses the pooled histogram of all classes.
* **Priority** (smallest evicted first, in every tier): nodes a request in the look-ahead window
  needs go last, in queue order (the ``lookahead`` policy, CachedAttention §3.3); the others by
  density, ties by stamp time (older first). ``reads_ahead``: the prefix cache also reads
  NVMe-only prefixes that rank above DRAM's copies into DRAM before their request arrives
  (:mod:`hiradix.core.returns`).

Adaptation: where returns are predictable the histograms concentrate and the density separates
ages and classes sharply; where arrivals are bursty or a class has few events the density
flattens (or pools), and the ties leave recency: the order tends to LRU. A queue, when there is
one, decides first. Nothing is trained offline and nothing is known of the future.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from hiradix.core.node import Tier, TreeNode
from hiradix.core.policy import LookaheadPolicy

# Age buckets: [0, 0.25 s), then [0.25 * 2^(k/2), 0.25 * 2^((k+1)/2)) for k = 0 .. 2 * 16 - 1,
# then everything older than 0.25 * 2^16 s (~4.5 h).
AGE_BASE_S = 0.25
AGE_OCTAVES = 16
NUM_AGE_BUCKETS = 2 + 2 * AGE_OCTAVES
MIN_CLASS_EVENTS = 32  # fewer events (decayed) than this: the class uses the pooled histogram
TURN_BUCKETS = 3  # turn 0, 1, 2+
SIZE_BUCKETS = 4  # quartiles of the recent prompt sizes
SHARED = TURN_BUCKETS * SIZE_BUCKETS  # class id of nodes with two or more children
NUM_CLASSES = SHARED + 1
SIZE_BINS = 64  # log2 size histogram for the quartiles (sizes up to 2^63 tree tokens)


def age_bucket(age_s: float) -> int:
    """The age bucket of ``age_s`` seconds (0 .. NUM_AGE_BUCKETS - 1)."""
    if age_s < AGE_BASE_S:
        return 0
    return min(NUM_AGE_BUCKETS - 1, 1 + int(2.0 * math.log2(age_s / AGE_BASE_S)))


def _bucket_start_s(k: int) -> float:
    return 0.0 if k == 0 else AGE_BASE_S * 2.0 ** ((k - 1) / 2.0)


def _bucket_mid_s(k: int) -> float:
    if k == 0:
        return AGE_BASE_S / 2
    if k == NUM_AGE_BUCKETS - 1:
        return 1.5 * _bucket_start_s(k)
    return _bucket_start_s(k) * 2.0 ** 0.25


_STARTS = [_bucket_start_s(k) for k in range(NUM_AGE_BUCKETS)]
_MIDS = [_bucket_mid_s(k) for k in range(NUM_AGE_BUCKETS)]


class ReuseModel:
    """Per class, decaying age histograms of hits and evictions, and the hit-density tables.

    Args:
        num_classes: class ids are ``0 .. num_classes - 1``.
        half_life_s: counts halve every this many seconds of the clock.
        update_s: the density tables are recomputed at most this often, in seconds.
    """

    def __init__(self, num_classes: int, half_life_s: float = 600.0, update_s: float = 10.0):
        if half_life_s <= 0 or update_s <= 0:
            raise ValueError("half_life_s and update_s must be > 0")
        self.num_classes = num_classes
        self.half_life_s = half_life_s
        self.update_s = update_s
        self.hits = [[0.0] * NUM_AGE_BUCKETS for _ in range(num_classes)]  # tokens, by age bucket
        self.evictions = [[0.0] * NUM_AGE_BUCKETS for _ in range(num_classes)]
        self.events = [0.0] * num_classes  # decayed event counts (hits + evictions)
        self.tables: list[list[float]] = [[0.0] * NUM_AGE_BUCKETS for _ in range(num_classes)]
        self.updated_s: Optional[float] = None  # clock of the last recompute

    def hit(self, cls: int, age_s: float, tokens: int) -> None:
        """A node of class ``cls`` was reused at ``age_s`` seconds after its stamp."""
        self.hits[cls][age_bucket(age_s)] += tokens
        self.events[cls] += 1

    def evict(self, cls: int, age_s: float, tokens: int) -> None:
        """A node of class ``cls`` left the cache ``age_s`` seconds after its stamp."""
        self.evictions[cls][age_bucket(age_s)] += tokens
        self.events[cls] += 1

    def density(self, cls: int, age_s: float) -> float:
        """Expected hits per token-second still to come for class ``cls`` at ``age_s`` (>= 0)."""
        return self.tables[cls][age_bucket(age_s)]

    def update(self, now_s: float) -> bool:
        """Decay the counts and recompute the tables if ``update_s`` has passed; True if it did."""
        if self.updated_s is not None and now_s - self.updated_s < self.update_s:
            return False
        if self.updated_s is not None:
            keep = 0.5 ** ((now_s - self.updated_s) / self.half_life_s)
            for rows in (self.hits, self.evictions):
                for row in rows:
                    row[:] = [x * keep for x in row]
            self.events = [x * keep for x in self.events]
        self.updated_s = now_s
        pooled_hits = [sum(col) for col in zip(*self.hits)]
        pooled_evictions = [sum(col) for col in zip(*self.evictions)]
        pooled = _densities(pooled_hits, pooled_evictions)
        for cls in range(self.num_classes):
            enough = self.events[cls] >= MIN_CLASS_EVENTS
            self.tables[cls] = _densities(self.hits[cls], self.evictions[cls]) if enough else pooled
        return True


def _densities(hits: Sequence[float], evictions: Sequence[float]) -> list[float]:
    """LHD's estimator per age bucket j: hits at ages >= j / sum over those events of the time
    still to live (event age - start of bucket j). 0 where no event was seen at those ages."""
    out = [0.0] * NUM_AGE_BUCKETS
    hits_above = events_above = weighted_above = 0.0
    for k in range(NUM_AGE_BUCKETS - 1, -1, -1):
        events = hits[k] + evictions[k]
        hits_above += hits[k]
        events_above += events
        weighted_above += events * _MIDS[k]
        life = weighted_above - _STARTS[k] * events_above
        out[k] = hits_above / life if life > 0 else 0.0
    return out


class SizeQuartiles:
    """Quartiles of recent prompt sizes from a decaying histogram of their log2 (unit-free)."""

    def __init__(self) -> None:
        self.counts = [0.0] * SIZE_BINS
        self.bounds = [1.0, 1.0, 1.0]  # sizes splitting the 4 buckets, in the caller's unit

    def add(self, size: int) -> None:
        self.counts[min(SIZE_BINS - 1, max(0, size).bit_length())] += 1.0

    def bucket(self, size: int) -> int:
        """0 .. SIZE_BUCKETS - 1: which quarter of the recent sizes ``size`` falls in."""
        return sum(size >= b for b in self.bounds)

    def update(self, keep: float) -> None:
        """Recompute the bounds, then decay the counts by ``keep``."""
        total = sum(self.counts)
        if total > 0:
            bounds, acc, q = [], 0.0, 1
            for i, c in enumerate(self.counts):
                acc += c
                while q < SIZE_BUCKETS and acc >= total * q / SIZE_BUCKETS:
                    bounds.append(float(2 ** i))  # sizes with bit_length > i
                    q += 1
            self.bounds = bounds
        self.counts = [c * keep for c in self.counts]


class PredictivePolicy(LookaheadPolicy):
    """Queue first, then hit density per class and age (module docstring).

    Args:
        half_life_s: memory of the reuse statistics, in seconds.
        update_s: how often the density tables are recomputed, in seconds.
        by_turn: tell conversations apart by turn (0, 1, 2+); else one turn bucket.
        by_size: tell prompts apart by size quartile; else one size bucket.
    """

    name = "predictive"
    uses_history = True
    reads_ahead = True
    clock_per_process = True  # ages in seconds of this process's clock (not agreed across TP ranks)
    keys_grow = False  # a density changes with age: every eviction ranks all candidates again

    def __init__(self, half_life_s: float = 600.0, update_s: float = 10.0, by_turn: bool = True,
                 by_size: bool = True):
        super().__init__()
        self.model = ReuseModel(NUM_CLASSES, half_life_s, update_s)
        self.sizes = SizeQuartiles()
        self.by_turn, self.by_size = by_turn, by_size
        self.now_s = 0.0  # the clock at the last hook: ages in priority() are taken at this time

    # ---------------------------------------------------------------- hooks
    def observe_step(self, now_s: float) -> None:
        """Move the policy's clock; recompute the densities when due."""
        self.now_s = max(self.now_s, now_s)
        last = self.model.updated_s
        if self.model.update(self.now_s) and last is not None:
            self.sizes.update(0.5 ** ((self.now_s - last) / self.model.half_life_s))

    def observe_insert(self, path: Sequence[TreeNode], reused_tokens: Optional[int], now_s: float) -> None:
        """Count the reuse of the nodes the request hit, then stamp its whole path."""
        self.observe_step(now_s)
        if not path:
            return
        own = None
        if reused_tokens is None:  # a later insert of the same request: keep its class and turn
            own = next((n.policy_stamp for n in reversed(path)
                        if n.policy_stamp is not None and n.policy_stamp[0] != SHARED), None)
        if own is not None:
            cls, turn = own[0], own[1]
        elif reused_tokens is None:
            cls, turn = self._new_class(path, 0)
        else:
            turn = self._count_hits(path, reused_tokens, now_s)
            cls, turn = self._new_class(path, turn)
        last = len(path) - 1
        for i, node in enumerate(path):
            node.policy_stamp = (SHARED if len(node.children) >= 2 else cls, turn, now_s, i == last)

    def observe_delete(self, node: TreeNode, now_s: float) -> None:
        """Count an eviction of ``node`` at its age."""
        cls, stamp_s = self._class_and_time(node)
        self.model.evict(cls, now_s - stamp_s, node.num_tokens)

    def _count_hits(self, path: Sequence[TreeNode], reused_tokens: int, now_s: float) -> int:
        """Hit events for the nodes within the reused prefix; returns this request's turn."""
        pos, turn = 0, 0
        for node in path:
            if pos >= reused_tokens:
                break
            pos += node.num_tokens
            cls, stamp_s = self._class_and_time(node)
            self.model.hit(cls, now_s - stamp_s, node.num_tokens)
            stamp = node.policy_stamp
            turn = stamp[1] + 1 if stamp is not None and stamp[3] else 0  # the deepest reused node decides
        return turn

    def _new_class(self, path: Sequence[TreeNode], turn: int) -> tuple[int, int]:
        size = sum(n.num_tokens for n in path)
        self.sizes.add(size)
        size_bucket = self.sizes.bucket(size) if self.by_size else 0
        turn_bucket = min(turn, TURN_BUCKETS - 1) if self.by_turn else 0
        return turn_bucket * SIZE_BUCKETS + size_bucket, turn

    @staticmethod
    def _class_and_time(node: TreeNode) -> tuple[int, float]:
        stamp = node.policy_stamp
        if stamp is None:  # never inserted by a request (re-indexed from NVMe, found in the store)
            return 0, node.last_access_s
        return stamp[0], stamp[2]

    # ---------------------------------------------------------------- ranking
    def priority(self, node: TreeNode, tier: Tier) -> tuple:
        pos = self.needed_at.get(node.id)
        if pos is not None:
            return (1, -pos, 0.0, node.last_access_s, node.id)
        stamp = node.policy_stamp  # inlined _class_and_time / density / age_bucket: the hot path
        cls, stamp_s = (0, node.last_access_s) if stamp is None else (stamp[0], stamp[2])
        age_s = self.now_s - stamp_s
        k = 0 if age_s < AGE_BASE_S else min(NUM_AGE_BUCKETS - 1, 1 + int(2.0 * math.log2(age_s / AGE_BASE_S)))
        return (0, 0, self.model.tables[cls][k], stamp_s, node.id)

    def worth_reading(self, node: TreeNode) -> bool:
        """A read ahead may pay only where the model expects a reuse still to come (density > 0)."""
        return self.priority(node, Tier.DRAM)[2] > 0.0

    def describe(self) -> dict:
        """The learned tables, for logs and the simulator's JSON: per class, events and densities."""
        return {"events": list(self.model.events), "size_bounds": list(self.sizes.bounds),
                "densities": [list(t) for t in self.model.tables]}
