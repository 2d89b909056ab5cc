"""The simulator's cost model: what a request's prefill costs, and which cached tokens are worth reading.

With ``SimConfig.cost_model`` on, a simulated server serves each request in
``read time of the cached tokens it uses + prefill time of the rest`` (or the max of the two with
``load_overlap``: layer-wise loading overlaps the prefill, AttentionStore / CachedAttention, ATC '24,
section 3.3), its prefill batches one after another (a FIFO queue per server). Which cached tokens
it uses is :func:`hiradix.core.load_or_recompute.tokens_worth_loading`, the function the server
uses (issue 19, item 4): only the leading run whose read beats recomputing. Reads from NVMe and the
store are then not timed on the I/O channels too (they would be counted twice).

Rates (``SimConfig`` flags; defaults are the simulated server's, an H100-class Llama-3-8B server,
not this machine's): prefill ``prefill_tokens_per_s`` 50k tokens/s; DRAM -> HBM
``dram_read_bytes_per_s`` 25 GB/s (PCIe 4.0 x16 nominal; ``scripts/gpu_check`` has not measured it);
NVMe ``nvme_read_bytes_per_s`` 7 GB/s; store ``store_read_bytes_per_s`` 10 GB/s (RDMA class); KV
``kv_bytes_per_token`` 128 KiB. Measured on this development machine (bench/RESULTS.md): NVMe reads
1.40 GB/s ("I/O", virtio disk, llama3-8b raw median), Mooncake Store gets 0.74 GB/s loaded / 2.01
GB/s quiet on loopback ("Cluster store"): pass them with ``--nvme-read-bytes-per-s 1.4e9
--store-read-bytes-per-s 0.74e9``. The break-even link at the defaults is 128 KiB x 50k/s = 6.6 GB/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from bench.sim.cold_tier import nvme_source_read_bytes_per_s
from hiradix.core.load_or_recompute import request_time_s, tokens_worth_loading
from hiradix.core.node import Tier, TreeMatch, TreeNode
from hiradix.core.tree import TieredRadixTree

LOAD_POLICIES = ("worth", "always", "never")
_TIER_NAME = {Tier.NVME: "nvme", Tier.STORE: "store"}


def read_bytes_per_s(cfg) -> dict[str, float]:
    """Read bandwidth into HBM per tier name, in bytes/s of the model's dtype (HBM free; NVMe: a
    compressed page moves fewer bytes and is decoded, ``bench/sim/cold_tier.py``)."""
    return {"hbm": math.inf, "dram": cfg.dram_read_bytes_per_s, "nvme": nvme_source_read_bytes_per_s(cfg),
            "store": cfg.store_read_bytes_per_s}


@dataclass(frozen=True)
class LoadPlan:
    """How much of one match to load back, and the request's modelled time.

    Attributes:
        end: the last DRAM node to load back (``m.hbm_node``: none).
        tree_tokens: tree tokens from ``m.hbm_node`` down to ``end`` (``load_back``'s ``num_tokens``).
        runs: ``(tier, real tokens)`` of the cached prefix in prefix order; a DRAM node's tier is
            where its DRAM copy was read from (``nvme``, ``store``), else ``dram``.
        cached_tokens: real tokens of ``runs``.
        uncached_tokens: prompt tokens after them (prefilled in any case).
    """

    end: TreeNode
    tree_tokens: int
    runs: tuple
    cached_tokens: int
    uncached_tokens: int
    bandwidth: dict
    bytes_per_token: float
    prefill_tokens_per_s: float
    overlap: bool

    def service_s(self, hit_tokens: int) -> float:
        """Modelled prefill time with the first ``hit_tokens`` real tokens used from the cache, seconds."""
        return request_time_s(self.runs, min(hit_tokens, self.cached_tokens), self.bandwidth, self.bytes_per_token,
                              self.prefill_tokens_per_s, self.overlap, self.uncached_tokens)


def tier_runs(tree: TieredRadixTree, m: TreeMatch, unit_tokens: int) -> tuple[list[tuple[str, int]], list[TreeNode]]:
    """The match's cached prefix as ``(tier, real tokens)`` runs, and its DRAM nodes below HBM."""
    nodes = tree.path(m.dram_node)[len(tree.path(m.hbm_node)):] if m.dram_len and m.dram_node is not m.hbm_node else []
    runs: list[tuple[str, int]] = [("hbm", m.hbm_len * unit_tokens)] if m.hbm_len else []
    for n in nodes:
        tier = _TIER_NAME.get(n.dram_from, "dram") if n.dram_from is not None else "dram"
        if runs and runs[-1][0] == tier:
            runs[-1] = (tier, runs[-1][1] + n.num_tokens * unit_tokens)
        else:
            runs.append((tier, n.num_tokens * unit_tokens))
    return runs, nodes


def plan_load(cfg, tree: TieredRadixTree, m: TreeMatch, input_tokens: int) -> LoadPlan:
    """Choose the DRAM nodes to load back for one request under ``cfg.load_policy``.

    Args:
        cfg: the :class:`bench.sim.simulate.SimConfig`.
        tree: the server's tree; ``m`` its match at admission.
        input_tokens: the prompt's length, in real tokens.
    """
    u = cfg.unit_tokens
    runs, nodes = tier_runs(tree, m, u)
    cached = sum(n for _, n in runs)
    bw = read_bytes_per_s(cfg)
    hbm = m.hbm_len * u
    if cfg.load_policy == "always":
        want = cached
    elif cfg.load_policy == "never":
        want = hbm
    else:
        want = tokens_worth_loading(runs, bw, cfg.kv_bytes_per_token, cfg.prefill_tokens_per_s, cfg.load_overlap,
                                    input_tokens - cached, cfg.page_size)
    end, taken = m.hbm_node, 0
    for n in nodes:  # the deepest node whose whole path fits in ``want``
        if hbm + (taken + n.num_tokens) * u > want:
            break
        end, taken = n, taken + n.num_tokens
    return LoadPlan(end, taken, tuple(runs), cached, input_tokens - cached, bw, cfg.kv_bytes_per_token,
                    cfg.prefill_tokens_per_s, cfg.load_overlap)


def time_saved(counters) -> dict:
    """Prefill time saved against no cache, from a server's (or the sum of servers') counters."""
    saved = counters.no_cache_s - counters.service_s
    return {"service_s": counters.service_s, "no_cache_s": counters.no_cache_s, "time_saved_s": saved,
            "time_saved": saved / counters.no_cache_s if counters.no_cache_s else 0.0,
            "recomputed_hit_tokens": counters.recomputed_hit_tokens}


def check_load_policy(name: str) -> None:
    """Raises ValueError listing :data:`LOAD_POLICIES` for an unknown name."""
    if name not in LOAD_POLICIES:
        raise ValueError(f"load_policy must be one of {', '.join(LOAD_POLICIES)}; got {name!r}")


def sum_counters(counters: Sequence) -> object:
    """The fields :func:`time_saved` reads, summed over servers."""
    from types import SimpleNamespace

    return SimpleNamespace(service_s=sum(c.service_s for c in counters), no_cache_s=sum(c.no_cache_s for c in counters),
                           recomputed_hit_tokens=sum(c.recomputed_hit_tokens for c in counters))
