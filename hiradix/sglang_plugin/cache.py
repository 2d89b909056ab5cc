"""SGLang's prefix-cache contract over the core's tiered prefix cache: a translation, no logic.

:class:`TieredRadixCache` implements ``BasePrefixCache`` of SGLang 0.5.23
(``sglang/srt/mem_cache/base_prefix_cache.py``; the legacy ``radix_cache.py`` shows the
contract) by translating SGLang's objects (``RadixKey``, ``Req``, ``MatchResult``, lock
receipts, the device allocator) into calls on :class:`hiradix.core.prefix_cache.TieredPrefixCache`,
which sees token ids, a namespace and slot tensors only; the trace simulator drives that same
object. SGLang's names (``match_prefix``, ``inc_lock_ref``, ...) stay at this seam.

It is selected with ``--enable-hiradix`` through SGLang's radix-cache backend registry
(``register_radix_cache_backend("hiradix", ...)``, :mod:`hiradix.sglang_plugin.plugin`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InitLoadBackParams,
    MatchPrefixParams,
    MatchResult,
)
from sglang.srt.mem_cache.radix_cache import RadixKey

from hiradix.core.lookahead import QueuedKey, QueueView
from hiradix.dataplane.device_copy import copy_token_rows
from hiradix.sglang_plugin.device_pool import SGLangDevicePool
from hiradix.sglang_plugin.kv_events import attach_events
from hiradix.sglang_plugin.sessions import StreamingSessions
from hiradix.sglang_plugin.storage_hits import note_storage_hits
from hiradix.core.policy import make_policy
from hiradix.core.prefix_cache import TieredPrefixCache
from hiradix.core.store_tier import STORE_RETRY_S
from hiradix.core.tree import TieredRadixTree, TreeNode

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    from hiradix.config import HiRadixConfig

logger = logging.getLogger(__name__)

CHECK_INTEGRITY_ENV = "HIRADIX_CHECK_INTEGRITY"  # "1": prove the invariants after every step (slow)
STORE_RETRY_ENV = "HIRADIX_STORE_RETRY_S"  # seconds before a switched-off cluster store is tried again


def namespace_of(key: RadixKey) -> Optional[tuple]:
    """Tree namespace of a key: LoRA adapter (``extra_key``) and ``cache_salt``."""
    if key.extra_key is None and key.cache_salt is None:
        return None
    return (key.extra_key, key.cache_salt)


def namespace_of_req(req: Req) -> Optional[tuple]:
    """Tree namespace of a request (see :func:`namespace_of`)."""
    if req.extra_key is None and req.cache_salt is None:
        return None
    return (req.extra_key, req.cache_salt)


def request_key(req: Req, page_size: int) -> tuple[Sequence[int], Optional[tuple]]:
    """``(token ids, namespace)`` of a request's whole pages (prompt + output so far)."""
    key = RadixKey(req.origin_input_ids + req.output_ids, req.extra_key, cache_salt=req.cache_salt)
    key = key.page_aligned(page_size)
    return key.raw_token_ids(), namespace_of(key)


class TieredRadixCache(StreamingSessions, BasePrefixCache):
    """Prefix cache whose radix-tree nodes record their tier (HBM, DRAM, NVMe).
    Streaming sessions: :class:`~hiradix.sglang_plugin.sessions.StreamingSessions`.

    Args:
        params: SGLang's ``CacheInitParams`` (pools, allocator, ``page_size`` in tokens).
        config: validated hiradix settings (tier sizes in bytes, policy, write policy).
        kv_pool: SGLang's device KV pool; None builds the tree without lower tiers (tests).
        tp_rank: this scheduler's tensor-parallel rank.
        identity: model identity for the NVMe index fingerprint (see
            :func:`hiradix.runtime.assembly.build_tiers`); None: the NVMe tier is not persisted.
        counter_factory: SGLang's ``LayerDoneCounter`` for CUDA layer-wise loads.

    Raises:
        ValueError: unknown policy name in ``config``.
    """

    def __init__(self, params: CacheInitParams, config: HiRadixConfig, kv_pool: Any = None, tp_rank: int = 0,
                 identity: Optional[dict] = None, counter_factory: Any = None, partial_pages: bool = False):
        self.disable = False
        self.config = config
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        dev = getattr(self.token_to_kv_pool_allocator, "device", "cpu")
        self.device = torch.device(dev) if isinstance(dev, (str, torch.device)) else torch.device("cpu")
        self.tree = TieredRadixTree(self.page_size, make_policy(config.policy))
        # --kv-events-config: SGLang's KV events for every tier (before the NVMe index is restored)
        self.kv_events_out = attach_events(self.tree, params)
        self.tiers, self.loader = None, None
        if kv_pool is not None:
            from hiradix.runtime.assembly import build_tiers

            # TP ranks agree on asynchronous completions over SGLang's CPU group (runtime.rank_sync).
            self.tiers, self.loader = build_tiers(
                self.tree, config, kv_pool, self.page_size, tp_rank, tp_group=params.tp_cache_group,
                identity=identity, counter_factory=counter_factory,
                store_retry_s=float(os.environ.get(STORE_RETRY_ENV, STORE_RETRY_S)),
            )
        self.core = TieredPrefixCache(
            self.tree, SGLangDevicePool(self.token_to_kv_pool_allocator, self.device), self.tiers,
            lookahead_window=config.lookahead_window, load_timeout_s=config.load_timeout_s,
            check_every_step=os.environ.get(CHECK_INTEGRITY_ENV, "0") == "1",
            on_evict=self.update_eviction_metrics, partial_pages=partial_pages,
            copy_rows=(lambda src, dst: copy_token_rows(kv_pool, src, dst)) if kv_pool is not None else None,
        )
        self.init_sessions()
        self.overflow = None  # hiradix.sglang_plugin.overflow.ContextOverflow (--hiradix-context-overflow)
        self.stop_signal = None  # hiradix.sglang_plugin.stop.SchedulerStop (SIGTERM drains the tier writes)
        self.tier_metrics = None
        if params.enable_metrics:
            self.init_metrics_collector()
            if self.tiers is not None:
                self.tier_metrics = self._tier_metrics()
        logger.info("hiradix: TieredRadixCache in use (page_size=%d tokens, policy=%s, write_policy=%s)",
                    self.page_size, config.policy, config.write_policy)

    def _tier_metrics(self) -> Any:
        """hiradix's series (``hiradix.runtime.metrics``) with SGLang's radix-cache labels."""
        from sglang.srt.layers.dp_attention import is_dp_attention_enabled
        from sglang.srt.observability.metrics_collector import radix_cache_metric_labels
        from sglang.srt.runtime_context import get_observability, get_parallel

        from hiradix.runtime.metrics import TierMetrics

        labels = radix_cache_metric_labels(type(self).__name__, get_parallel(), is_dp_attention_enabled())
        labels.update(get_observability().extra_metric_labels or {})
        plan = self.tiers.plan
        pages = (self.token_to_kv_pool_allocator.size // self.page_size, plan.dram.capacity_pages, plan.nvme_slots,
                 0)  # the store's size is not ours
        return TierMetrics(labels, self.page_size, plan.hbm_page_bytes, pages, reserved_bytes=plan.reserved_bytes,
                           tier_page_bytes=plan.page_bytes_by_tier)

    @property
    def last_view(self) -> Optional[QueueView]:
        return self.core.last_view

    # ------------------------------------------------------------ contract
    @property
    def root_node(self) -> TreeNode:
        return self.tree.root

    def is_root(self, node: Any) -> bool:
        return node is self.tree.root

    def reset(self) -> None:
        """Forget every node and session record (SGLang's ``flush_cache`` resets the pools itself)."""
        self.core.reset()
        self.init_sessions()

    def release_host_resources(self) -> None:
        """Graceful shutdown: let the NVMe and store writes in flight land (at most
        ``--hiradix-stop-timeout-s``; every TP rank is here in the same step), then stop the I/O
        worker and remove the shared-memory files."""
        if self.tiers is not None:
            self.tiers.drain()
            self.tiers.close()
            self.tiers = None
            self.core.tiers = None

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest cached prefix of ``params.key``, in tokens (whole pages), across tiers.

        Splits the node the match ends in and refreshes recency (modifies the tree).
        ``device_prefix_len`` counts tokens in HBM (their slots lie on the path to
        ``last_device_node``, valid while it is locked); ``host_hit_length`` counts the
        following tokens in DRAM, loadable by :meth:`init_load_back` up to
        ``best_match_node``. Tokens only on NVMe start a read into DRAM (prefetch); the
        request waits for it at admission (:meth:`should_wait`) up to the load timeout. A turn of
        a streaming session borrows its session's row instead (:meth:`session_match`).
        """
        session_turn = self.session_match(params)
        if session_turn is not None:
            return session_turn
        key = params.key.page_aligned(self.page_size)
        if len(key) == 0:  # less than a page: only a partial page can hit
            root = self.tree.root
            partial = self._match_partial(params, key, 0, root)
            return MatchResult(partial, root, root, root, cache_protected_len=0 if partial else None,
                               full_kv_hit_length=partial)
        if self.overflow is not None and params.req is not None:
            self.overflow.reuse(params.req, key.raw_token_ids(), namespace_of(key))  # a cut prompt's kept tail
        m = self.core.match(key.raw_token_ids(), namespace_of(key))
        if self.core.streamed is not None and params.req is not None:
            start, back = self.core.streamed
            note_storage_hits(params.req, back, self.config.store_backend, start)
        partial = self._match_partial(params, key, m.hbm_len, m.hbm_node, all_in_hbm=m.hbm_len == m.matched_len)
        return MatchResult(
            device_prefix_len=m.hbm_len + partial,
            last_device_node=m.hbm_node,
            last_host_node=m.hbm_node,
            best_match_node=m.dram_node,
            host_hit_length=m.dram_len,
            cache_protected_len=m.hbm_len if partial else None,  # the partial page becomes the request's own
            full_kv_hit_length=m.hbm_len + m.dram_len + partial,
        )

    def _match_partial(self, params: MatchPrefixParams, key: RadixKey, hbm_len: int, node: TreeNode,
                       all_in_hbm: bool = True) -> int:
        """Tokens of a partial page that continue a match wholly in HBM (``hbm_len`` tokens up to
        ``node``), claimed for the request until the next step; :meth:`prefix_device_indices`
        hands the page over."""
        req = params.req
        if req is None:
            return 0
        req.hiradix_partial = None
        if self.core.partial is None or not all_in_hbm:
            return 0
        raw = params.key.raw_token_ids()  # honours SGLang's limit: the last token is computed
        next_tokens = raw[hbm_len: hbm_len + self.page_size - 1]
        num, page = self.core.match_partial(node, namespace_of(params.key), next_tokens, req.rid)
        if num:
            req.hiradix_partial = page
        return num

    def prefix_device_indices(self, req: Req) -> torch.Tensor:
        """Device slots of ``req``'s matched prefix: the path to its locked match node, then the
        rows of the kept partial page it matched, which becomes the request's own here (its next
        tokens fill the page: SGLang's paged allocator continues a prefix's last page)."""
        path = self.path_device_indices(req.last_node)
        page, req.hiradix_partial = getattr(req, "hiradix_partial", None), None
        extra = req.prefix_len - len(path)
        if extra <= 0:
            return path[: req.prefix_len]
        assert page is not None and extra < self.page_size, (req.rid, len(path), req.prefix_len)
        slots = self.core.take_partial(page, req.rid, extra)
        return torch.cat([path, slots.to(device=path.device, dtype=path.dtype)])

    def should_wait(self, req: Req) -> bool:
        """Whether admission should skip ``req`` for now (its NVMe reads are in flight); reuses the
        request's key and last peek (the look-ahead's, ``_queued_key``); never a streaming
        session's turn, which runs on its session's row."""
        return not self.lends_record(req) and self.core.should_wait(self._queued_key(req))

    def init_load_back(self, params: InitLoadBackParams) -> Optional[tuple[int, Any]]:
        """Promote the DRAM part of a match into new HBM slots (layer by layer, all or none).

        Returns:
            ``(loaded_tokens, new_last_node)``; ``(0, req.last_node)`` when the path changed
            since the match or device memory cannot be found (the request recomputes).
        """
        req = params.req
        back = self.core.load_back(req.last_node, params.best_match_node, params.host_hit_length)
        if back.loaded:
            note_storage_hits(req, back, self.config.store_backend)
        return back.loaded, back.node

    def ready_to_load_host_cache(self) -> int:
        """Start the promotions queued while building this batch; returns its consumer index."""
        return self.core.start_loading()

    def check_hicache_events(self) -> None:
        """Per scheduler step: reap finished copies and worker acks, keep DRAM headroom."""
        self.core.step()
        if self.tier_metrics is not None and self.tiers is not None:
            self.tier_metrics.update(self.tiers.stats, self.tiers.books, self.tree.tier_tokens, self.core.last_view,
                                     store=self.tiers.store,
                                     overflow=self.overflow.counts if self.overflow is not None else None,
                                     partial_tokens=self.core.partial.reused_tokens if self.core.partial is not None else 0)

    def take_events(self) -> list:
        """SGLang's KV events of every tier since the last call (its publisher calls this after
        each batch and when idle; :mod:`hiradix.sglang_plugin.kv_events`); [] when off."""
        if self.kv_events_out is None:
            return []
        return self.kv_events_out.convert(self.tree.events.take())

    def wait_for_reads(self, timeout_s: float, wake: list) -> bool:
        """Block (bounded) on the I/O results when admission held a request for its reads."""
        return self.core.wait_for_reads(timeout_s, wake)

    def land_queued_reads(self, head: list, timeout_s: float) -> bool:
        """Before a prefill batch forms: wait (bounded) for the reads of the requests at the
        queue's ``head``; True if the tiers took one more step."""
        return self.core.land_queued_reads([self._queued_key(req) for req in head], timeout_s)

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """An extend batch prefilled ``tokens`` in ``seconds`` (load or recompute's prefill rate)."""
        if self.tiers is not None:
            self.tiers.note_prefill(tokens, seconds)

    def observe_queue(self, waiting_queue: list) -> Optional[QueueView]:
        """Look-ahead over the first W waiting requests (policies that use the queue).

        Each request's key is built once and kept on the request (``hiradix_queued_key``, rebuilt
        only when its length changes, e.g. after a retraction), with its last peek: a step costs
        O(nodes on the queued paths), not O(queued tokens).
        """
        if not self.tree.policy.uses_queue:
            return None
        window = waiting_queue[: self.config.lookahead_window]
        return self.core.observe_queue([self._queued_key(req) for req in window])

    def _queued_key(self, req: Req) -> QueuedKey:
        length = len(req.origin_input_ids) + len(req.output_ids)
        cached = getattr(req, "hiradix_queued_key", None)
        if cached is None or cached[0] != length:
            cached = (length, QueuedKey(*request_key(req, self.page_size)))
            req.hiradix_queued_key = cached
        return cached[1]

    def touch_prefix(self, key: RadixKey) -> None:
        key = key.page_aligned(self.page_size)
        if len(key):
            self.tree.touch(key.raw_token_ids(), namespace_of(key))

    def checkpoint_into_tree(self, req: Req, *, up_to: int, **kwargs) -> None:
        """Insert ``req``'s KV up to row position ``up_to`` (whole pages) into the tree
        (SGLang's ``checkpoint``, less a streaming session's turns: :class:`StreamingSessions`).

        Frees the request's duplicate slots of tokens the tree already held in HBM, repoints
        the request's row onto the tree's slots, moves the request's lock to the new last
        node and advances ``req.kv.cache_protected_len``.
        """
        token_ids = req.full_untruncated_fill_ids[:up_to]
        key = RadixKey(token_ids, req.extra_key, cache_salt=req.cache_salt).page_aligned(self.page_size)
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(token_ids)]
        slots = row[: len(key)].to(dtype=torch.int64, copy=True)
        protected = req.kv.cache_protected_len
        key_len, last = self.core.checkpoint(key.raw_token_ids(), namespace_of(key), slots, protected,
                                             inserted_len=req.kv.cache_inserted_len)
        req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, key_len)
        tree_slots = self.path_device_indices(last)
        assert len(tree_slots) == key_len, (len(tree_slots), key_len)
        if key_len > protected:
            self.req_to_token_pool.write((req.kv.req_pool_idx, slice(protected, key_len)), tree_slots[protected:])
        req.kv.cache_protected_len = key_len
        if self.core.partial is not None and key_len < len(token_ids) and req.finished():
            # the partly filled last page stays in HBM for the next request of this prefix
            first = int(row[key_len])  # the page's row 0: its slots are first .. first + page_size - 1
            page_slots = torch.arange(first, first + self.page_size, dtype=torch.int64, device=row.device)
            if self.core.keep_partial(last, namespace_of(key), token_ids[key_len:], page_slots):
                req.kv.cache_protected_len = len(token_ids)
        new_lock = self.lock(last)
        self.unlock(req.lock)
        req.lock = new_lock
        req.last_node = last

    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``params.num_tokens`` device slots (if evictable), in policy order."""
        return EvictResult(num_tokens_evicted=self.core.evict(params.num_tokens))

    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        return IncLockRefResult(delta=self.core.lock(node))

    def dec_lock_ref(self, node: TreeNode, params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        return DecLockRefResult(delta=self.core.unlock(node))

    def path_device_indices(self, node: TreeNode) -> torch.Tensor:
        """Device slot ids on the path root..``node``. Shape ``(tokens,)``, int64."""
        return self.core.path_slots(node)

    # ---------------------------------------------------------- accounting
    def evictable_size(self) -> int:
        return self.core.evictable_tokens

    def full_evictable_size(self) -> int:
        return self.core.evictable_tokens

    def protected_size(self) -> int:
        return self.core.protected_tokens

    def full_protected_size(self) -> int:
        return self.core.protected_tokens

    def total_size(self) -> int:
        return self.core.evictable_tokens + self.core.protected_tokens

    def all_values_flatten(self) -> torch.Tensor:
        partial = self.core.partial.all_slots() if self.core.partial is not None else []
        return self.core.device.concat(list(self.tree.all_hbm_slots()) + partial)

    def supports_prefix_sharing(self) -> bool:
        return True

    def pretty_print(self) -> None:
        for node in self.tree.iter_nodes():
            depth = len(self.tree.path(node))
            print("  " * depth, node, list(node.tokens[:8]))
        print(f"#tokens in HBM: {self.total_size()}")

    def check_integrity(self) -> None:
        """Tree invariants, plus DRAM/NVMe page ownership when the lower tiers are on.

        Raises:
            hiradix.core.node.IntegrityError: naming the broken invariant.
        """
        self.core.check_integrity()
