"""Router policies of SGLang's router (the Shepherd Model Gateway, PyPI ``smg`` 1.13.0) for the cluster simulator.

Each policy picks a server for one request at its arrival, from the servers' current loads
(``loads[i]`` = requests routed to server ``i`` and not finished: the SMG's ``Worker::load()``,
incremented at routing and decremented when the response ends). Policies:

* ``round_robin``: servers in turn.
* ``random``: a uniformly random server (seeded).
* ``power_of_two``: two distinct random servers, the one with the lower load (ties: the first drawn).
* ``sticky``: every turn of a conversation to one server, by a hash of the conversation
  (``--sticky-sessions`` / a routing-key header; here the conversation is ``hash_ids[1]``).
* ``cache_aware``: the SMG's policy (``model_gateway/src/policies/cache_aware.rs``). If the loads are
  imbalanced, ``max - min > balance_abs_threshold`` (64) and ``max > balance_rel_threshold`` (1.5)
  ``* min``, the least-loaded server. Else the server with the longest prefix match in an
  approximate tree of what the router sent where (not of what servers hold), if
  ``matched / prompt > cache_threshold`` (0.3); else the least-loaded server (ties by requests
  routed so far, then index: smg's code; its docs and the older sglang-router pick the smallest
  tree instead, ``miss="smallest_tree"``). The chosen server's tree gets the prompt. Every
  ``eviction_interval_s`` (60) each server's tree is cut to ``max_tree_tokens`` (2**26) by LRU.
  The SMG's HTTP tree holds request text (characters); here it holds the trace's 512-token
  block ids, each weighing its tokens, so match ratios are in tokens.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

ROUTER_POLICIES = ("round_robin", "random", "power_of_two", "cache_aware", "sticky")
BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake trace


def conversation_of(req) -> int:
    """The conversation a request belongs to: its first block after the shared system prompt."""
    return req.hash_ids[1] if len(req.hash_ids) > 1 else req.hash_ids[0]


def _spread(x: int) -> int:
    """A fixed, well-mixed hash of a conversation id (Fibonacci hashing), for sticky routing."""
    return ((x * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) >> 32


def block_tokens(req) -> list[int]:
    """Tokens of each of the request's blocks (the last may be partial)."""
    return [max(0, min(BLOCK_TOKENS, req.input_len - i * BLOCK_TOKENS)) for i in range(len(req.hash_ids))]


@dataclass(frozen=True)
class CacheAwareConfig:
    """The SMG's cache_aware knobs (``smg launch`` flags; defaults of smg's ``RouterArgs``)."""

    cache_threshold: float = 0.3  # --cache-threshold: min matched / prompt share to follow the match
    balance_abs_threshold: int = 64  # --balance-abs-threshold, in requests
    balance_rel_threshold: float = 1.5  # --balance-rel-threshold
    eviction_interval_s: float = 60.0  # --eviction-interval-secs
    max_tree_tokens: int = 1 << 26  # --max-tree-size (characters there, tokens here), per server
    miss: str = "min_load"  # below the threshold: min_load (smg's code) or smallest_tree (its docs)


class ApproxTree:
    """What the router sent where: per server, an LRU map of block id -> [tokens, last use]. A block
    id names its whole prefix (the trace's ids do), so a prefix match is a walk while the server
    holds each id."""

    def __init__(self, servers: int):
        self.held: list[OrderedDict[int, list]] = [OrderedDict() for _ in range(servers)]
        self.size_tokens = [0] * servers
        self.uses = 0  # a counter standing for time: the last use of a block

    def longest_match(self, req) -> tuple[int, int]:
        """``(server, matched tokens)`` of the longest prefix match (ties: the most recently sent)."""
        best, best_len, best_use = 0, 0, -1
        sizes = block_tokens(req)
        for s, held in enumerate(self.held):
            n, last = 0, None
            for h, t in zip(req.hash_ids, sizes):
                entry = held.get(h)
                if entry is None:
                    break
                n, last = n + t, entry
            if n and (n > best_len or (n == best_len and last[1] > best_use)):
                best, best_len, best_use = s, n, last[1]
        return best, best_len

    def insert(self, server: int, req) -> None:
        held = self.held[server]
        self.uses += 1
        for h, t in zip(req.hash_ids, block_tokens(req)):
            entry = held.get(h)
            if entry is not None:
                entry[1] = self.uses
                held.move_to_end(h)
            else:
                held[h] = [t, self.uses]
                self.size_tokens[server] += t

    def evict(self, max_tokens: int) -> None:
        """Cut every server's tree to ``max_tokens``, least recently sent blocks first."""
        for s, held in enumerate(self.held):
            while self.size_tokens[s] > max_tokens and held:
                _, (t, _) = held.popitem(last=False)
                self.size_tokens[s] -= t


class Router:
    """One router policy over ``servers`` servers.

    Args:
        policy: one of :data:`ROUTER_POLICIES`.
        servers: how many servers.
        seed: for ``random`` and ``power_of_two``.
        cache_aware: the ``cache_aware`` knobs.

    Raises:
        ValueError: unknown policy or ``miss`` (the message lists the names).
    """

    def __init__(self, policy: str, servers: int, seed: int = 0, cache_aware: CacheAwareConfig = CacheAwareConfig()):
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(ROUTER_POLICIES)}; got {policy!r}")
        if cache_aware.miss not in ("min_load", "smallest_tree"):
            raise ValueError(f"cache_aware miss must be min_load or smallest_tree; got {cache_aware.miss!r}")
        self.policy, self.servers, self.cfg = policy, servers, cache_aware
        self.rng = random.Random(seed)
        self.next_rr = 0
        self.routed = [0] * servers  # requests sent to each server so far (smg's processed count)
        self.tree = ApproxTree(servers) if policy == "cache_aware" else None
        self.next_eviction_s = cache_aware.eviction_interval_s
        self.decisions = {"imbalanced": 0, "match": 0, "miss": 0}  # cache_aware: why each request went where

    def route(self, req, loads: Sequence[int], now_s: float = 0.0) -> int:
        """The server for ``req`` given the servers' current ``loads`` (requests outstanding)."""
        if self.policy == "round_robin":
            server, self.next_rr = self.next_rr, (self.next_rr + 1) % self.servers
        elif self.policy == "random":
            server = self.rng.randrange(self.servers)
        elif self.policy == "power_of_two":
            server = self._power_of_two(loads)
        elif self.policy == "sticky":
            server = _spread(conversation_of(req)) % self.servers
        else:
            server = self._cache_aware(req, loads, now_s)
        self.routed[server] += 1
        return server

    def _power_of_two(self, loads: Sequence[int]) -> int:
        if self.servers == 1:
            return 0
        a, b = self.rng.sample(range(self.servers), 2)
        return b if loads[b] < loads[a] else a

    def _least_loaded(self, loads: Sequence[int]) -> int:
        return min(range(self.servers), key=lambda i: (loads[i], self.routed[i], i))

    def _cache_aware(self, req, loads: Sequence[int], now_s: float) -> int:
        cfg, tree = self.cfg, self.tree
        while now_s >= self.next_eviction_s:
            tree.evict(cfg.max_tree_tokens)
            self.next_eviction_s += cfg.eviction_interval_s
        lo, hi = min(loads), max(loads)
        if hi - lo > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo:
            server, why = self._least_loaded(loads), "imbalanced"
        else:
            best, matched = tree.longest_match(req)
            if req.input_len and matched / req.input_len > cfg.cache_threshold:
                server, why = best, "match"
            elif cfg.miss == "smallest_tree":
                server, why = min(range(self.servers), key=lambda i: (tree.size_tokens[i], i)), "miss"
            else:
                server, why = self._least_loaded(loads), "miss"
        tree.insert(server, req)
        self.decisions[why] += 1
        return server
