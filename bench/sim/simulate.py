"""Trace simulator: replay a Mooncake-format trace through the real hiradix bookkeeping.

Each request (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``: one id per
512-token block; equal ids = equal content; an id encodes its whole prefix) arrives at its
timestamp at a queueing model of one SGLang engine. The cache is the server's own
:class:`hiradix.core.prefix_cache.TieredPrefixCache` (tree, policy, ledger, placement,
controller), called as the SGLang seam (``hiradix.sglang_plugin.cache``) calls it, over the
data-less ports of :mod:`hiradix.testing.sim_ports` (no KV bytes). HBM only, + DRAM and + NVMe,
each with ``lru`` and ``lookahead``, are compared with the trace's infinite-cache hit rate.

What is counted:

* Keys: page ``j`` of block ``h`` gets ids derived from ``(h, j)``, so equal blocks are
  equal pages and a shared prefix of ids is a shared prefix in the tree. The prompt is cut
  to whole pages (``input_length`` rounded down to ``page_size``; SGLang's paged cache never
  caches the partial last page). By default one tree token stands for one page (tree page
  size 1, sizes in pages: the same decisions, ~500x fewer ids); ``--token-level`` keeps
  ``page_size`` ids per page.
* Hit rate = hit tokens / prompt tokens (all of ``input_length``); also per 512-token block
  (a hit when all its whole pages hit), comparable with the trace's infinite-cache figure
  (36.6% of 288,500 block references). The infinite token figure uses the whole-page rule.
* Tier of a hit, as hiradix reports it (SGLang's ``cached_tokens_details``): HBM; DRAM; NVMe
  (pages read up from NVMe for that request, whether the look-ahead window read them before
  admission or the request waited; issue 14). Pages read from the cluster store count in the
  DRAM column and apart (``store_tokens``). ``DRAM@1st``: share already in DRAM at the first
  admission attempt; ``NVMe wait ms`` tells read-ahead from waiting.

Service model (all configurable): one engine runs one FCFS prefill batch at a time (at most
``--max-prefill-tokens`` uncached tokens, at least one request) for ``batch_overhead_s +
uncached tokens / prefill_tokens_per_s``; prompts are inserted at the batch's end; then each
request decodes for ``output_length / decode_tokens_per_s`` (overlapping later prefills for
free) holding its HBM slots (prompt + output) and lock; at most ``--max-running`` run. NVMe
reads and writes take ``page_bytes / bandwidth`` per page, one FIFO channel each; HBM <->
DRAM copies land within a step (layer-wise loading overlaps the forward). A request whose
NVMe reads are in flight is skipped, not blocking the others, up to ``--load-timeout-s``.

Default sizes (128 KiB of KV per token, Llama-3-8B fp16): HBM 0.5 M tokens (64 GiB), DRAM
4 M (512 GiB), NVMe 128 M (16 TiB; the trace has 93.6 M distinct tokens). HBM small, DRAM
moderate, NVMe holding everything, as in CachedAttention, whose LRU shape (HBM only ~0%,
+ DRAM 3-20%, + SSD all) these sizes reproduce on this trace.

    .venv/bin/python bench/sim/simulate.py                          # all nine + infinite
    .venv/bin/python bench/sim/simulate.py --sweep                  # hit rate vs capacity, Belady (bench/sim/sweep.py)
    .venv/bin/python bench/sim/simulate.py --trace my.jsonl --page-size 16 --hbm-tokens 1e6
    .venv/bin/python bench/sim/simulate.py --context-tokens 8192 --context-overflow shift  # bench/sim/overflow.py

Outputs under ``--out-dir`` (default ``runs/simulate-<time>/``): ``simulate.json`` and
``simulate.png`` (hit rate per scenario, split by tier).
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import sys
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

if __package__ in (None, ""):  # run as a script: make `hiradix` and `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.sim.offline import infinite_hit_rates  # noqa: E402,F401 - re-exported (tests, sweep)
from bench.sim.cold_tier import check_cold_format, nvme_read_s, nvme_read_s_per_page, nvme_slots, nvme_write_s_per_page  # noqa: E402
from bench.sim.cost import check_load_policy, plan_load, time_saved  # noqa: E402
from bench.sim.overflow import ConversationCuts, alloc_for_shift, apply_shift, check_overflow_config  # noqa: E402
from bench.sim.parallel import run_all  # noqa: E402
from bench.sim.report import format_table, plot  # noqa: E402
from bench.sim.sweep import DEFAULT_FRACTIONS, sweep_main  # noqa: E402
from hiradix.core.policy import make_policy  # noqa: E402
from hiradix.core.lookahead import QueuedKey  # noqa: E402
from hiradix.core.prefix_cache import TieredPrefixCache  # noqa: E402
from hiradix.core.read_landing import LAND_HEAD_REQUESTS, LAND_WAIT_S  # noqa: E402
from hiradix.core.node import Tier  # noqa: E402
from hiradix.core.tree import TieredRadixTree, TreeNode  # noqa: E402
from hiradix.testing.sim_ports import (  # noqa: E402
    SimClock,
    SimDevicePool,
    SimStore,
    next_event_s,
    simulated_controller,
)

BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake trace
DEFAULT_TRACE = Path(__file__).resolve().parents[3] / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
TIERS = ("hbm", "dram", "nvme")  # scenario = the lowest tier present


@dataclass(frozen=True)
class SimConfig:
    """One simulated server; sizes in tokens, times in seconds, rates per second."""

    page_size: int = 512  # tokens per page (divides 512)
    hbm_tokens: int = 1 << 19  # device KV pool (running requests + cache)
    dram_tokens: int = 1 << 22  # DRAM tier (+dram, +nvme scenarios)
    nvme_tokens: int = 1 << 27  # NVMe tier (+nvme scenario)
    kv_bytes_per_token: int = 131072  # all layers, K and V (Llama-3-8B fp16: 32 x 8 x 128 x 2 x 2)
    nvme_read_bytes_per_s: float = 7e9  # NVMe -> DRAM bandwidth
    nvme_write_bytes_per_s: float = 5e9  # DRAM -> NVMe bandwidth
    prefill_tokens_per_s: float = 50_000.0  # uncached prompt tokens per second
    decode_tokens_per_s: float = 50.0  # output tokens per second per request
    max_running: int = 64  # requests decoding or in prefill at once
    max_prefill_tokens: int = 16384  # uncached tokens per prefill batch (SGLang default)
    batch_overhead_s: float = 0.0  # fixed cost per prefill batch
    lookahead_window: int = 64  # W
    load_timeout_s: float = 2.0  # wait for NVMe reads at most this long
    write_through: bool = True  # back up to DRAM at insert
    write_selective: bool = False  # ...only nodes hit again (HiCache's write_through_selective)
    dram_staging: bool = False  # DRAM only carries pages in flight (--hiradix-dram-mode staging)
    token_level: bool = False  # page_size ids per page in the tree (else one per page)
    time_scale: float = 1.0  # arrival times are multiplied by this
    check_every_step: bool = False  # books.check_integrity() after every step (slow)
    # The cluster store (bench/sim/cluster.py): transfer rates and the latency of one lookup.
    store_read_bytes_per_s: float = 10e9  # store -> DRAM (RDMA-class network)
    store_write_bytes_per_s: float = 10e9  # DRAM -> store
    store_query_s: float = 0.0005  # one batched exists
    # Cost model (bench/sim/cost.py over hiradix.core.load_or_recompute; issue 19 item 4). Off: the
    # figures of bench/RESULTS.md before it (reads timed on the I/O channels, prefill = uncached / rate).
    cost_model: bool = False  # service time per request = reads + prefill; NVMe/store reads untimed on the channels
    dram_read_bytes_per_s: float = 25e9  # DRAM -> HBM: PCIe 4.0 x16 nominal (no GPU measurement in RESULTS.md)
    load_overlap: bool = False  # reads overlap the prefill of the rest (AttentionStore 3.3); off: store and NVMe
    # pages land in DRAM before admission, as hiradix reads them today
    load_policy: str = "worth"  # worth (load or recompute), always (read every hit), never (recompute below HBM)
    # Context overflow (bench/sim/overflow.py, AttentionStore 3.4; issue 20): None = unlimited (nothing is cut).
    context_tokens: Optional[int] = None  # the model's context length, tokens (prompt + output must fit)
    context_overflow: str = "recompute"  # recompute (the kept tail is prefilled again) or shift (its KV re-used)
    context_drop_ratio: float = 0.5  # share of the tokens after the kept head dropped per cut
    # Compressed NVMe tier (bench/sim/cold_tier.py, hiradix --hiradix-cold-format; issue 21): nvme_tokens stays its
    # bytes / kv_bytes_per_token, and holds 1/ratio times the tokens; reads and writes move ratio times the bytes.
    cold_format: str = "exact"  # exact, fp8, int4
    cold_bytes_ratio: float = 0.0  # encoded / source bytes of a page; 0 = the codec's (Llama-3-8B, 16-bit)
    cold_decode_bytes_per_s: float = float("inf")  # source bytes decoded per second (one I/O worker); inf = free
    cold_encode_bytes_per_s: float = float("inf")  # source bytes encoded per second; inf = free

    def __post_init__(self) -> None:
        if not 1 <= self.page_size <= BLOCK_TOKENS or BLOCK_TOKENS % self.page_size:
            raise ValueError(f"--page-size must divide {BLOCK_TOKENS}, got {self.page_size}")
        check_load_policy(self.load_policy)
        check_overflow_config(self.context_tokens, self.context_overflow, self.context_drop_ratio)
        check_cold_format(self.cold_format, self.cold_bytes_ratio, self.cold_decode_bytes_per_s, self.cold_encode_bytes_per_s)
        for name in ("hbm_tokens", "prefill_tokens_per_s", "decode_tokens_per_s", "max_running", "time_scale"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def unit_tokens(self) -> int:
        """Real tokens per tree token."""
        return 1 if self.token_level else self.page_size

    @property
    def page_bytes(self) -> int:
        """KV bytes of one page (all layers)."""
        return self.page_size * self.kv_bytes_per_token


@dataclass(frozen=True)
class TraceRequest:
    """One line of the trace."""

    arrival_s: float
    input_len: int  # tokens
    output_len: int  # tokens
    hash_ids: tuple[int, ...]


def load_trace(path: Path, limit: Optional[int] = None) -> list[TraceRequest]:
    """Read a Mooncake-format JSONL trace (``timestamp`` in ms), sorted by arrival.

    Raises:
        ValueError: a line misses a field or its hash ids do not cover ``input_length``.
    """
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            d = json.loads(line)
            try:
                req = TraceRequest(d["timestamp"] / 1000.0, int(d["input_length"]), int(d["output_length"]), tuple(d["hash_ids"]))
            except KeyError as exc:
                raise ValueError(f"{path}:{lineno}: missing field {exc}") from None
            if len(req.hash_ids) * BLOCK_TOKENS < req.input_len:
                raise ValueError(f"{path}:{lineno}: {len(req.hash_ids)} blocks cannot hold {req.input_len} tokens")
            out.append(req)
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.arrival_s)
    return out


def cached_len(req: TraceRequest, page_size: int) -> int:
    """Tokens of the prompt a paged cache can hold: whole pages only."""
    return req.input_len - req.input_len % page_size


def block_ends(req: TraceRequest, page_size: int) -> list[int]:
    """Per block, the end (in tokens) of its whole pages; 0-page blocks are left out."""
    key_len = cached_len(req, page_size)
    ends = [min((i + 1) * BLOCK_TOKENS, key_len) for i in range(len(req.hash_ids))]
    return [e for i, e in enumerate(ends) if e > i * BLOCK_TOKENS]


def make_key(req: TraceRequest, cfg: SimConfig) -> array:
    """Tree key of the prompt's whole pages: ``(hash id, position)``-derived ids.

    One id per tree token: a token (``--token-level``, id ``h * 512 + t``) or a page
    (id ``h * (512 / page_size) + j``).
    """
    per_block = BLOCK_TOKENS // cfg.unit_tokens
    n = cached_len(req, cfg.page_size) // cfg.unit_tokens
    ids = np.asarray(req.hash_ids, dtype=np.int64)[:, None] * per_block + np.arange(per_block, dtype=np.int64)
    key = array("q")
    key.frombytes(ids.ravel()[:n].tobytes())
    return key


@dataclass(eq=False)
class SimRequest:
    """A trace request while the simulated server holds it; lengths in tree tokens."""

    idx: int
    trace: TraceRequest
    key: array
    scratch_len: int  # tree tokens of HBM for the uncached tail page and the output
    first_try_s: Optional[float] = None
    skips: int = 0  # admission attempts skipped while its NVMe reads were in flight
    fast_len: int = 0  # HBM + DRAM tokens of the match at the first admission attempt
    lock: Optional[TreeNode] = None
    row: list = field(default_factory=list)  # slots of the cached part, in key order
    scratch: list = field(default_factory=list)  # slots freed at finish
    protected_len: int = 0  # tokens of the key that hit (the tree's slots in ``row``)
    served: tuple = (0, 0, 0)  # hit tree tokens from HBM, DRAM, NVMe (as hiradix reports them)
    admitted_s: float = 0.0
    service_s: float = 0.0  # modelled prefill time (reads + prefill of the rest), seconds
    queued: Optional[QueuedKey] = None  # the look-ahead's key and last peek (built at arrival)
    overflow: Optional[object] = None  # its bench.sim.overflow.OverflowView (a context limit is set)
    shifted_len: int = 0  # tree tokens after the hit re-used by a context shift (new slots, not prefilled)

    def __post_init__(self) -> None:
        self.queued = QueuedKey(self.key)


@dataclass
class Counters:
    """Totals of one scenario; tokens are real tokens."""

    prompt_tokens: int = 0
    hit_tokens: list = field(default_factory=lambda: [0, 0, 0])  # from HBM, DRAM, NVMe
    store_tokens: int = 0  # of the DRAM hits, tokens read from the cluster store (another server's KV)
    service_s: float = 0.0  # modelled prefill time of all requests: reads + prefill of the rest, seconds
    no_cache_s: float = 0.0  # the same with no cache: every prompt token prefilled, seconds
    recomputed_hit_tokens: int = 0  # cached below HBM, recomputed because reading was slower (cost model)
    strict_dram_tokens: int = 0  # hits already in DRAM at the first admission attempt
    ready_tokens: int = 0  # hits already in HBM or DRAM at the first admission attempt (no wait)
    block_refs: int = 0
    block_hits: int = 0
    requests: int = 0
    rejected: int = 0  # could never fit in HBM
    skipped_for_nvme: int = 0  # admission attempts skipped: NVMe reads in flight
    nvme_unready_tokens: int = 0  # matched on NVMe at admission, not waited for: recomputed
    # ... by cause: its read alone takes longer than the timeout / it waited its timeout behind
    # other reads / no read could start (no DRAM room) before the timeout
    unready_by_cause: dict = field(default_factory=lambda: dict.fromkeys(("read_longer_than_timeout", "queued", "no_read"), 0))
    load_back_failed_tokens: int = 0  # matched in DRAM at admission, could not be promoted
    queue_wait_s: list = field(default_factory=list)  # arrival -> admission
    nvme_wait_s: float = 0.0  # total first attempt -> admission of requests skipped for NVMe
    steps: int = 0


class Engine:
    """The queueing model of one SGLang engine around the server's :class:`TieredPrefixCache`.

    Args:
        trace: requests sorted by arrival.
        cfg: the server.
        lowest_tier: "hbm", "dram" or "nvme": which tiers exist.
        policy: "lru" or "lookahead".
    """

    def __init__(self, trace: Sequence[TraceRequest], cfg: SimConfig, lowest_tier: str, policy: str,
                 clock: Optional[SimClock] = None, store: Optional[SimStore] = None):
        self.trace, self.cfg = trace, cfg
        u = cfg.unit_tokens
        self.clock = clock or SimClock()  # shared by the servers of a simulated cluster
        tree_ps = cfg.page_size // u
        self.tree = TieredRadixTree(tree_ps, make_policy(policy), clock=self.clock)
        tiers = None
        if lowest_tier != "hbm":
            nvme_pages = nvme_slots(cfg) if lowest_tier == "nvme" else 0
            tiers = simulated_controller(
                self.tree, cfg.dram_tokens // cfg.page_size, nvme_pages, cfg.page_bytes, cfg.write_through, self.clock,
                read_s_per_page=0.0 if cfg.cost_model else nvme_read_s_per_page(cfg),
                write_s_per_page=nvme_write_s_per_page(cfg),
                store=store, store_read_s_per_page=0.0 if cfg.cost_model else cfg.page_bytes / cfg.store_read_bytes_per_s,
                store_write_s_per_page=cfg.page_bytes / cfg.store_write_bytes_per_s, store_query_s=cfg.store_query_s,
                write_selective=cfg.write_selective, dram_staging=cfg.dram_staging,
            )  # fmt: skip
        device = SimDevicePool(cfg.hbm_tokens // u, tree_ps)
        self.device = device
        self.cache = TieredPrefixCache(self.tree, device, tiers, cfg.lookahead_window, cfg.load_timeout_s)
        self.counters = Counters()
        self.waiting: deque[SimRequest] = deque()
        self.batch: list[SimRequest] = []
        self.batch_done_s = 0.0
        self.decoding: list[tuple[float, int, SimRequest]] = []  # heap of (finish s, idx, req)
        self.next_arrival = 0
        self.retry_s: Optional[float] = None  # a skipped request's reads may land by then
        self.finished = 0
        self.overflow = ConversationCuts(trace, cfg) if cfg.context_tokens else None

    # ------------------------------------------------------------ loop
    def run(self, on_finished: Optional[Callable[[int], None]] = None) -> Counters:
        """Replay the whole trace; ``on_finished(n)`` hears of finished requests (progress)."""
        while self.finished < len(self.trace) and (t := self._next_event_s()) is not None:
            self.clock.advance_to(t)
            before = self.finished
            self.step()
            if on_finished is not None and self.finished > before:
                on_finished(self.finished - before)
        return self.counters

    def _next_event_s(self) -> Optional[float]:
        times = []
        if self.next_arrival < len(self.trace):
            times.append(self.trace[self.next_arrival].arrival_s * self.cfg.time_scale)
        if self.batch:
            times.append(self.batch_done_s)
        if self.decoding:
            times.append(self.decoding[0][0])
        io_s = next_event_s(self.cache.tiers)
        if io_s is not None:
            times.append(io_s)
        if self.retry_s is not None and not self.batch:
            times.append(self.retry_s)
        if not times:
            return None
        return max(min(times), self.clock())

    def step(self) -> None:
        """One scheduler step at the current virtual time."""
        now = self.clock()
        self.counters.steps += 1
        if self.batch and self.batch_done_s <= now:
            self._end_prefill()
        while self.decoding and self.decoding[0][0] <= now:
            self._finish(heapq.heappop(self.decoding)[2])
        while self.next_arrival < len(self.trace) and self.trace[self.next_arrival].arrival_s * self.cfg.time_scale <= now:
            self._arrive(self.next_arrival)
            self.next_arrival += 1
        self.cache.step()
        if self.waiting:
            window = itertools.islice(self.waiting, self.cfg.lookahead_window)
            self.cache.observe_queue([r.queued for r in window])
        self.retry_s = None
        if not self.batch and self.waiting:
            # before admission, as the server's hook: the head's reads about to land join the batch (the
            # server also waits while decoding, which this model of decode as a delay does not charge)
            self.cache.land_queued_reads([r.queued for r in itertools.islice(self.waiting, LAND_HEAD_REQUESTS)],
                                         LAND_WAIT_S)
            self._admit()
        if self.cfg.check_every_step:
            self.check()

    # ------------------------------------------------------------ requests
    def _arrive(self, idx: int) -> None:
        tr, cfg = self.trace[idx], self.cfg
        view = self.overflow.view(idx, lambda t: make_key(t, cfg)) if self.overflow else None
        tr, key = (view.trace, view.key) if view else (tr, make_key(tr, cfg))
        too_long = self.overflow is not None and view is None  # no cut fits the context: refused
        scratch_tokens = tr.input_len - cached_len(tr, cfg.page_size) + tr.output_len
        scratch_pages = -(-scratch_tokens // cfg.page_size)
        req = SimRequest(idx, tr, key, scratch_pages * cfg.page_size // cfg.unit_tokens, overflow=view)
        self.counters.requests += 1
        self.counters.prompt_tokens += tr.input_len
        if too_long or len(key) + req.scratch_len > self.device.capacity_tokens:
            self.counters.rejected += 1
            self.counters.block_refs += len(tr.hash_ids)
            self.finished += 1
            return
        self.waiting.append(req)

    def _admit(self) -> None:
        """FCFS admission into one prefill batch (SGLang's ``get_new_batch_prefill``)."""
        cfg, now = self.cfg, self.clock()
        batch_tokens, running = 0, len(self.decoding)
        for req in list(self.waiting):
            if running + len(self.batch) >= cfg.max_running or batch_tokens >= cfg.max_prefill_tokens:
                break
            m = self.cache.match(req.key)
            if req.first_try_s is None:
                req.first_try_s, req.fast_len = now, m.hbm_len + m.dram_len
            if self.cache.should_wait(req.key):
                self.counters.skipped_for_nvme += 1
                req.skips += 1
                nxt = next_event_s(self.cache.tiers)
                self.retry_s = min(nxt if nxt is not None else now + cfg.load_timeout_s, now + cfg.load_timeout_s)
                continue
            if not self._try_admit(req, m):
                break
            self.waiting.remove(req)
            self.batch.append(req)
            batch_tokens += (len(req.key) - req.protected_len - req.shifted_len) * cfg.unit_tokens + req.trace.input_len % cfg.page_size
        if self.batch:
            self.cache.start_loading()
            work_s = sum(r.service_s for r in self.batch) if cfg.cost_model else batch_tokens / cfg.prefill_tokens_per_s
            self.batch_done_s = now + cfg.batch_overhead_s + work_s

    def _try_admit(self, req: SimRequest, m) -> bool:
        """Lock the hit, load the DRAM part back, allocate the rest (``add_one_req``)."""
        tree, cache = self.tree, self.cache
        tree.inc_lock(m.hbm_node)
        need = len(req.key) - m.hbm_len + req.scratch_len
        if need > self.device.available_size() + tree.hbm_evictable_tokens:
            tree.dec_lock(m.hbm_node)
            return False
        plan = plan_load(self.cfg, tree, m, req.trace.input_len) if self.cfg.cost_model else None
        back = cache.load_back(m.hbm_node, *((plan.end, plan.tree_tokens) if plan else (m.dram_node, m.dram_len)))
        loaded, last = back.loaded, back.node
        storage = back.read_from[Tier.NVME]  # read up from NVMe for this use, ahead or waited for (as the server reports)
        self.counters.store_tokens += back.read_from[Tier.STORE] * self.cfg.unit_tokens
        if last is not m.hbm_node:
            tree.inc_lock(last)
            tree.dec_lock(m.hbm_node)
        hit = m.hbm_len + loaded
        new, source = alloc_for_shift(cache, req.overflow, hit, len(req.key) - hit + req.scratch_len)
        if new is None:
            tree.dec_lock(last)
            return False
        req.lock, req.protected_len, req.admitted_s = last, hit, self.clock()
        req.row = cache.path_slots(last) + new[: len(req.key) - hit]
        req.scratch = new[len(req.key) - hit :]
        req.served = (m.hbm_len, loaded - storage, storage)
        u, rate = self.cfg.unit_tokens, self.cfg.prefill_tokens_per_s
        req.service_s = plan.service_s(hit * u) if plan else (req.trace.input_len - hit * u) / rate
        if source is not None:  # context shift: the kept tail's cached KV is copied, not prefilled
            apply_shift(self.cfg, tree, req, plan, hit, self.overflow.counts, source)
        self.counters.recomputed_hit_tokens += (plan.cached_tokens - hit * u) if plan else 0
        self._count_hits(req, m)
        return True

    def _count_hits(self, req: SimRequest, m) -> None:
        c, u = self.counters, self.cfg.unit_tokens
        for tier, n in enumerate(req.served):
            c.hit_tokens[tier] += n * u
        hit_tokens = (req.protected_len + req.shifted_len) * u
        c.strict_dram_tokens += max(0, min(req.protected_len, req.fast_len) - m.hbm_len) * u
        c.ready_tokens += (min(req.protected_len, req.fast_len) + req.shifted_len) * u
        c.nvme_unready_tokens += m.nvme_len * u
        if m.nvme_len:
            read_s = nvme_read_s(self.cfg, m.nvme_len // self.tree.page_size)
            read = any(n.ops for n in m.stage(Tier.NVME))
            cause = "read_longer_than_timeout" if read_s > self.cfg.load_timeout_s else "queued" if read else "no_read"
            c.unready_by_cause[cause] += m.nvme_len * u
        c.load_back_failed_tokens += (m.dram_len - req.served[1] - req.served[2]) * u
        c.block_refs += len(req.trace.hash_ids)
        c.block_hits += sum(1 for end in block_ends(req.trace, self.cfg.page_size) if end <= hit_tokens)
        c.queue_wait_s.append(req.admitted_s - req.trace.arrival_s * self.cfg.time_scale)
        c.service_s += req.service_s
        c.no_cache_s += req.trace.input_len / self.cfg.prefill_tokens_per_s
        if req.skips:
            c.nvme_wait_s += req.admitted_s - req.first_try_s

    def _end_prefill(self) -> None:
        """Insert each prompt of the batch (``checkpoint``); the requests start decoding."""
        now = self.clock()
        for req in self.batch:
            _, last = self.cache.checkpoint(req.key, None, req.row, req.protected_len)
            self.cache.lock(last)
            self.cache.unlock(req.lock)
            req.lock = last
            req.row = []  # the tree owns the prompt's slots now
            done_s = now + req.trace.output_len / self.cfg.decode_tokens_per_s
            heapq.heappush(self.decoding, (done_s, req.idx, req))
        self.batch = []

    def _finish(self, req: SimRequest) -> None:
        self.tree.dec_lock(req.lock)
        self.device.free(req.scratch)
        req.scratch, req.lock, req.key, req.queued = [], None, array("q"), None
        self.finished += 1

    # ------------------------------------------------------------ checks
    def held_by_requests(self) -> int:
        """HBM tokens (tree units) owned by requests rather than the tree."""
        held = sum(len(r.scratch) for _, _, r in self.decoding)
        held += sum(len(r.scratch) + len(r.key) - r.protected_len for r in self.batch)
        return held

    def check(self) -> None:
        """Every invariant: tree and books, plus HBM slots used == tree + requests."""
        self.cache.check_integrity(self.held_by_requests(), used_tokens=self.device.num_used_tokens())


# ---------------------------------------------------------------- scenarios
def run_scenario(
    trace: Sequence[TraceRequest], cfg: SimConfig, lowest_tier: str, policy: str, on_finished: Optional[Callable[[int], None]] = None
) -> dict:
    """Replay ``trace`` on one configuration; returns its summary (JSON-ready)."""
    start = time.perf_counter()
    engine = Engine(trace, cfg, lowest_tier, policy)
    c = engine.run(on_finished)
    hit = sum(c.hit_tokens)
    waits = np.asarray(c.queue_wait_s) if c.queue_wait_s else np.zeros(1)
    tiers = engine.cache.tiers
    out = {
        "scenario": f"{lowest_tier}/{policy}",
        "tiers": lowest_tier,
        "policy": policy,
        "hit_rate": hit / max(c.prompt_tokens, 1),
        "block_hit_rate": c.block_hits / max(c.block_refs, 1),
        "hit_share": {t: (n / hit if hit else 0.0) for t, n in zip(TIERS, c.hit_tokens)},
        "hit_tokens": dict(zip(TIERS, c.hit_tokens)),
        "prompt_tokens": c.prompt_tokens,
        "requests": c.requests,
        "rejected": c.rejected,
        "skipped_for_nvme": c.skipped_for_nvme,
        "nvme_unready_tokens": c.nvme_unready_tokens,
        "load_back_failed_tokens": c.load_back_failed_tokens,
        "strict_dram_share": c.strict_dram_tokens / hit if hit else 0.0,
        "ready_share": c.ready_tokens / hit if hit else 0.0,
        "nvme_unready_share": c.nvme_unready_tokens / max(c.prompt_tokens, 1),
        "nvme_unready_by_cause": dict(c.unready_by_cause),
        "nvme_wait_s": {"total": c.nvme_wait_s, "per_request_ms": 1000 * c.nvme_wait_s / max(c.requests, 1)},
        "queue_wait_s": {"mean": float(waits.mean()), "p50": float(np.percentile(waits, 50)), "p99": float(np.percentile(waits, 99))},
        **time_saved(c),
        "steps": c.steps,
        "wall_s": time.perf_counter() - start,
    }
    if tiers is not None:
        out["dropped_tokens"] = dict(zip(TIERS, (n * cfg.unit_tokens for n in tiers.books.dropped_tokens)))
        out["bytes_moved"] = dict(tiers.stats.bytes_moved)
        out["prefetch_tokens"] = {k: v * cfg.unit_tokens for k, v in tiers.stats.prefetch_tokens.items()}
        out["wasted_prefetch_tokens"] = tiers.books.wasted_prefetch_tokens * cfg.unit_tokens
        out["read_ahead_tokens"] = {k: v * cfg.unit_tokens for k, v in tiers.stats.read_ahead_tokens.items()}
        out["read_ahead_tokens"]["trust"] = tiers.reads_ahead.trust
    if engine.overflow is not None:
        out["overflow"] = dict(engine.overflow.counts, context_tokens=cfg.context_tokens, mode=cfg.context_overflow)
    model = engine.tree.policy.describe()
    if model:
        out["policy_model"] = model
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Command line: the trace, scenarios, outputs, and one flag per :class:`SimConfig` field."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--scenarios", default="hbm,dram,nvme", help="lowest tiers to simulate (comma list of hbm, dram, nvme)")
    p.add_argument("--policies", default="lru,lookahead,predictive", help="comma list of policies")
    p.add_argument("--sweep", action="store_true",
                   help="hit rate vs capacity instead (bench/sim/sweep.py): the nvme scenario at --fractions of the "
                        "trace's unique tokens, with Belady, LRU and the infinite cache")
    p.add_argument("--fractions", default=",".join(str(f) for f in DEFAULT_FRACTIONS),
                   help="--sweep: capacity points (DRAM + NVMe) as fractions of the trace's unique tokens")
    p.add_argument("--cold-formats", default="",
                   help="--sweep: compare these NVMe page formats (e.g. exact,fp8,int4) at the same bytes instead "
                        "(bench/sim/format_sweep.py)")
    p.add_argument("--dram-share", type=float, default=1 / 9, help="--sweep: DRAM's share of each capacity point")
    p.add_argument("--worth-policy", default="predictive",
                   help="--sweep: policy whose NVMe worth (DRAM d + NVMe n vs DRAM d+n alone) is measured; '' = none")
    p.add_argument("--out-dir", type=Path, default=None, help="where JSON and PNG go (default runs/simulate-<time>)")
    p.add_argument("--jobs", type=int, default=2, help="scenarios simulated in parallel (processes)")
    add_sim_config_args(p)
    return p.parse_args(argv)


def add_sim_config_args(p: argparse.ArgumentParser) -> None:
    """One flag per :class:`SimConfig` field (``--hbm-tokens``, ...; numbers accept ``1e6``)."""
    d = SimConfig()
    for f in dataclasses.fields(SimConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=getattr(d, f.name))
        elif f.type == "str":
            p.add_argument(flag, default=getattr(d, f.name))
        elif f.type == "Optional[int]":  # "none" = unset
            p.add_argument(flag, type=lambda s: None if s.lower() == "none" else int(float(s)), default=getattr(d, f.name))
        else:
            kind = int if f.type == "int" else float
            p.add_argument(flag, type=lambda s, k=kind: k(float(s)), default=getattr(d, f.name))


def sim_config_from_args(args: argparse.Namespace) -> SimConfig:
    """The :class:`SimConfig` of the flags :func:`add_sim_config_args` added."""
    return SimConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)})


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Replay the trace on every scenario; print the table, write JSON + PNG; returns 0."""
    args = parse_args(argv)
    cfg = sim_config_from_args(args)
    trace = load_trace(args.trace, args.limit)
    for policy in args.policies.split(","):
        make_policy(policy)  # raises ValueError listing the supported names
    if args.sweep and args.cold_formats:
        from bench.sim.format_sweep import format_sweep_main

        return format_sweep_main(args, cfg, trace)
    if args.sweep:
        return sweep_main(args, cfg, trace)
    infinite = infinite_hit_rates(trace, cfg.page_size)
    scenarios = [(t, p) for t in args.scenarios.split(",") for p in args.policies.split(",")]
    for tier, policy in scenarios:
        if tier not in TIERS:
            raise SystemExit(f"unknown scenario {tier!r}; choose from {', '.join(TIERS)}")
    start = time.perf_counter()
    results = run_all(trace, cfg, scenarios, max(1, min(args.jobs, len(scenarios))))
    out_dir = args.out_dir or Path("runs") / time.strftime("simulate-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"trace": str(args.trace), "config": dataclasses.asdict(cfg), "infinite": infinite, "results": results}
    summary["wall_s"] = time.perf_counter() - start
    (out_dir / "simulate.json").write_text(json.dumps(summary, indent=2))
    plot(results, infinite, out_dir / "simulate.png")
    print(format_table(results, infinite))
    print(f"{len(trace)} requests, {len(results)} scenarios on {args.jobs} processes: {summary['wall_s']:.1f} s; "
          f"wrote {out_dir / 'simulate.json'} and {out_dir / 'simulate.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
