"""SGLang's prefix-cache contract on top of the tiered radix tree (the ``patches/`` seam).

:class:`HiRadixCache` implements ``BasePrefixCache`` of SGLang 0.5.23
(``sglang/srt/mem_cache/base_prefix_cache.py``; the legacy ``radix_cache.py`` shows the
contract) by translating SGLang's objects (``RadixKey``, ``Req``, the device allocator) into
calls on :class:`hiradix.tree.TieredRadixTree`, which only sees token ids and slot ids.
SGLang's names (``match_prefix``, ``inc_lock_ref``, ...) stay at this seam.

It is selected with ``--enable-hiradix`` through SGLang's radix-cache backend registry
(``register_radix_cache_backend("hiradix", create_hiradix_cache)``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any, Optional

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

from hiradix.lookahead import QueueView, plan
from hiradix.policy import LookaheadPolicy, make_policy
from hiradix.tree import TieredRadixTree, Tier, TreeNode

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    from hiradix.config import HiRadixConfig

logger = logging.getLogger(__name__)


def _namespace(key: RadixKey) -> Optional[tuple]:
    """Tree namespace of a key: LoRA adapter (``extra_key``) and ``cache_salt``."""
    if key.extra_key is None and key.cache_salt is None:
        return None
    return (key.extra_key, key.cache_salt)


class HiRadixCache(BasePrefixCache):
    """Prefix cache whose radix-tree nodes record their tier (HBM, DRAM, NVMe).

    Args:
        params: SGLang's ``CacheInitParams`` (pools, allocator, ``page_size`` in tokens).
        config: validated hiradix settings (tier sizes in bytes, policy, write policy).
        kv_pool: SGLang's device KV pool; None builds the tree without lower tiers (tests).
        tp_rank: this scheduler's tensor-parallel rank.
        identity: model identity for the NVMe index fingerprint (see
            ``TierController.for_device_pool``); None: the NVMe tier is not persisted.

    Raises:
        ValueError: unknown policy name in ``config``.
    """

    def __init__(self, params: CacheInitParams, config: HiRadixConfig, kv_pool: Any = None, tp_rank: int = 0,
                 identity: Optional[dict] = None):
        # TP ranks agree on asynchronous completions over SGLang's CPU group (hiradix.rank_sync).
        self.disable = False
        self.config = config
        self.req_to_token_pool = params.req_to_token_pool
        self.token_to_kv_pool_allocator = params.token_to_kv_pool_allocator
        self.page_size = params.page_size
        dev = getattr(self.token_to_kv_pool_allocator, "device", "cpu")
        self.device = torch.device(dev) if isinstance(dev, (str, torch.device)) else torch.device("cpu")
        self.tree = TieredRadixTree(self.page_size, make_policy(config.policy))
        self._empty_slots = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.tiers = None
        self.last_view: Optional[QueueView] = None
        # Test/debug switch: prove the invariants after every step and eviction (slow).
        self.check_every_step = os.environ.get("HIRADIX_CHECK_INTEGRITY", "0") == "1"
        if kv_pool is not None:
            from hiradix.tiering import TierController

            self.tiers = TierController.for_device_pool(
                self.tree, config, kv_pool, self.page_size, tp_rank, tp_group=params.tp_cache_group,
                identity=identity,
            )
        self.tier_metrics = None
        if params.enable_metrics:
            self.init_metrics_collector()
            if self.tiers is not None:
                from hiradix.metrics import TierMetrics

                self.tier_metrics = TierMetrics({"tp_rank": str(tp_rank)})
        logger.info(
            "hiradix: HiRadixCache in use (page_size=%d tokens, policy=%s, write_policy=%s)",
            self.page_size,
            config.policy,
            config.write_policy,
        )

    # ------------------------------------------------------------ contract
    @property
    def root_node(self) -> TreeNode:
        return self.tree.root

    def is_root(self, node: Any) -> bool:
        return node is self.tree.root

    def reset(self) -> None:
        """Forget every node (SGLang's ``flush_cache`` resets the device allocator itself)."""
        if self.tiers is not None:
            self.tiers.reset()
        self.tree.reset()

    def release_host_resources(self) -> None:
        """Stop the I/O worker and remove the shared-memory files (graceful shutdown)."""
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest cached prefix of ``params.key``, in tokens (whole pages), across tiers.

        Splits the node the match ends in and refreshes recency (modifies the tree).
        ``device_prefix_len`` counts tokens in HBM (their slots lie on the path to
        ``last_device_node``, valid while it is locked); ``host_hit_length`` counts the
        following tokens in DRAM, loadable by :meth:`init_load_back` up to
        ``best_match_node``. Tokens only on NVMe start a read into DRAM (prefetch); the
        request waits for it at admission (:meth:`should_wait`) up to the load timeout.
        """
        key = params.key.page_aligned(self.page_size)
        if len(key) == 0:
            root = self.tree.root
            return MatchResult(0, root, root, root)
        m = self.tree.match(key.raw_token_ids(), _namespace(key))
        if m.nvme_len and self.tiers is not None:
            self.tiers.prefetch(m.stage(Tier.NVME), self.config.load_timeout_s)
        return MatchResult(
            device_prefix_len=m.hbm_len,
            last_device_node=m.hbm_node,
            last_host_node=m.hbm_node,
            best_match_node=m.dram_node,
            host_hit_length=m.dram_len,
            full_kv_hit_length=m.hbm_len + m.dram_len,
        )

    def should_wait(self, req: Req) -> bool:
        """Whether admission should skip ``req`` for now: NVMe reads for its prefix are in
        flight and within ``load_timeout_s`` (afterwards it runs with what is ready)."""
        if self.tiers is None or not self.tiers.books.in_flight():
            return False
        tokens = (req.origin_input_ids + req.output_ids)
        key = RadixKey(tokens, req.extra_key, cache_salt=req.cache_salt).page_aligned(self.page_size)
        m = self.tree.match(key.raw_token_ids(), _namespace(key), split=False, touch=False)
        wait = m.nvme_len > 0 and self.tiers.prefetch_pending(m.stage(Tier.NVME), self.config.load_timeout_s)
        self.tiers.stats.admission_skips += wait
        return wait

    def init_load_back(self, params: InitLoadBackParams) -> Optional[tuple[int, Any]]:
        """Promote the DRAM part of a match into new HBM slots (layer by layer, all or none).

        Returns:
            ``(loaded_tokens, new_last_node)``; ``(0, req.last_node)`` when the path changed
            since the match or device memory cannot be found (the request recomputes).
        """
        req = params.req
        start, end = req.last_node, params.best_match_node
        if self.tiers is None or params.host_hit_length <= 0 or end is start:
            return 0, start
        path = self.tree.path(end)
        nodes = path[len(self.tree.path(start)) :] if end.alive else []
        ok = bool(nodes) and nodes[0].parent is start and all(n.in_tier(Tier.DRAM) and not n.in_tier(Tier.HBM) for n in nodes)
        num_tokens = sum(n.num_tokens for n in nodes)
        if not ok or num_tokens != params.host_hit_length:
            return 0, start
        self.tiers.books.hold(nodes, Tier.DRAM)  # eviction for the slots must not drop them
        try:
            slots = self._alloc_device(num_tokens)
        finally:
            self.tiers.books.release(nodes, Tier.DRAM)
        if slots is None:
            return 0, start
        from_nvme = self.tiers.load_back(nodes, slots)
        req.storage_hit_length = from_nvme
        req.storage_hit_start = None
        return num_tokens, end

    def _alloc_device(self, num_tokens: int) -> Optional[torch.Tensor]:
        allocator = self.token_to_kv_pool_allocator
        short = num_tokens - allocator.available_size()
        if short > 0:
            self.evict(EvictParams(num_tokens=short))
        return allocator.alloc(num_tokens)

    def ready_to_load_host_cache(self) -> int:
        """Start the promotions queued while building this batch; returns its consumer index."""
        return -1 if self.tiers is None else self.tiers.start_loading()

    def check_hicache_events(self) -> None:
        """Per scheduler step: reap finished copies and worker acks, keep DRAM headroom."""
        if self.tiers is not None:
            self.tiers.step()
            if self.tier_metrics is not None:
                self.tier_metrics.update(self.tiers.stats, self.tiers.books, self.tree.tier_tokens, self.last_view)
        if self.check_every_step:
            self.check_integrity()

    def observe_queue(self, waiting_queue: list) -> Optional[QueueView]:
        """Look-ahead over the first W waiting requests (``lookahead`` policy only).

        Refreshes the policy's view of which nodes queued requests need (soft protection)
        and starts NVMe -> DRAM reads for the requests inside the prefetch window.
        """
        if not isinstance(self.tree.policy, LookaheadPolicy):
            return None
        keys = []
        for req in waiting_queue[: self.config.lookahead_window]:
            key = RadixKey(req.origin_input_ids + req.output_ids, req.extra_key, cache_salt=req.cache_salt)
            key = key.page_aligned(self.page_size)
            keys.append((key.raw_token_ids(), _namespace(key)))
        free_pages = self.tiers.books.dram.num_free if self.tiers is not None else 0
        view = plan(self.tree, keys, self.config.lookahead_window, free_pages)
        self.tree.policy.update(view.needed_at)
        if self.tiers is not None:
            for nodes in view.prefetch:
                self.tiers.prefetch(nodes, self.config.load_timeout_s, ahead=True)
        self.last_view = view
        return view

    def touch_prefix(self, key: RadixKey) -> None:
        key = key.page_aligned(self.page_size)
        if len(key):
            self.tree.touch(key.raw_token_ids(), _namespace(key))

    def checkpoint(self, req: Req, *, up_to: int, **kwargs) -> None:
        """Insert ``req``'s KV up to row position ``up_to`` (whole pages) into the tree.

        Frees the request's duplicate slots of tokens the tree already held in HBM, repoints
        the request's row onto the tree's slots, moves the request's lock to the new last
        node and advances ``req.kv.cache_protected_len``.
        """
        token_ids = req.full_untruncated_fill_ids[:up_to]
        key = RadixKey(token_ids, req.extra_key, cache_salt=req.cache_salt).page_aligned(self.page_size)
        key_len = len(key)
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(token_ids)]
        slots = row[:key_len].to(dtype=torch.int64, copy=True)
        protected = req.kv.cache_protected_len
        dup_len, last, new_nodes = self.tree.insert(
            key.raw_token_ids(), slots, _namespace(key), inserted_len=req.kv.cache_inserted_len
        )
        req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, key_len)
        if dup_len > protected:
            self.token_to_kv_pool_allocator.free_segment(row[protected:dup_len], start_pos=protected)
        tree_slots = self.path_device_indices(last)
        assert len(tree_slots) == key_len, (len(tree_slots), key_len)
        if key_len > protected:
            self.req_to_token_pool.write(
                (req.kv.req_pool_idx, slice(protected, key_len)), tree_slots[protected:]
            )
        req.kv.cache_protected_len = key_len
        if self.tiers is not None:
            self.tiers.after_insert(new_nodes)
        new_lock = self.lock(last)
        self.unlock(req.lock)
        req.lock = new_lock
        req.last_node = last

    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``params.num_tokens`` device slots (if evictable), in policy order."""
        start = time.perf_counter()
        if self.tiers is not None:
            freed = self.tiers.evict_hbm(params.num_tokens)
        else:
            freed = self.tree.evict_hbm(params.num_tokens)
        num_evicted = 0
        for slots in freed:
            self.token_to_kv_pool_allocator.free_segment(slots, start_pos=0)
            num_evicted += len(slots)
        self.update_eviction_metrics(num_evicted, start)
        if self.check_every_step:
            self.check_integrity()
        return EvictResult(num_tokens_evicted=num_evicted)

    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        return IncLockRefResult(delta=self.tree.inc_lock(node))

    def dec_lock_ref(self, node: TreeNode, params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        return DecLockRefResult(delta=self.tree.dec_lock(node))

    def path_device_indices(self, node: TreeNode) -> torch.Tensor:
        """Device slot ids on the path root..``node``. Shape ``(tokens,)``, int64."""
        slots = self.tree.path_hbm_slots(node)
        return torch.cat(slots) if slots else self._empty_slots

    # ---------------------------------------------------------- accounting
    def evictable_size(self) -> int:
        return self.tree.hbm_evictable_tokens

    def full_evictable_size(self) -> int:
        return self.tree.hbm_evictable_tokens

    def protected_size(self) -> int:
        return self.tree.hbm_protected_tokens

    def full_protected_size(self) -> int:
        return self.tree.hbm_protected_tokens

    def total_size(self) -> int:
        return self.tree.hbm_evictable_tokens + self.tree.hbm_protected_tokens

    def all_values_flatten(self) -> torch.Tensor:
        slots = self.tree.all_hbm_slots()
        return torch.cat(slots) if slots else self._empty_slots

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
            hiradix.tree.IntegrityError: naming the broken invariant.
        """
        (self.tree if self.tiers is None else self.tiers.books).check_integrity()  # books check the tree too


def create_hiradix_cache(ctx: TreeCacheBuildContext) -> HiRadixCache:
    """Factory registered with SGLang's radix-cache backend registry under ``hiradix``.

    Raises:
        RuntimeError: the hiradix config did not reach this process.
    """
    from hiradix.plugin import config_from_server_args

    config = config_from_server_args(ctx.server_args)
    kv_pool = ctx.tp_worker.model_runner.token_to_kv_pool
    identity = None
    if config.nvme_bytes > 0:
        from hiradix.fingerprint import model_identity

        args = ctx.server_args
        identity = {"model_id": model_identity(args.model_path, getattr(args, "revision", None)),
                    "model_dtype": str(ctx.model_config.dtype), "tp_size": ctx.tp_size}
    cache = HiRadixCache(ctx.params, config, kv_pool=kv_pool, tp_rank=ctx.tp_rank, identity=identity)
    if cache.tiers is not None:
        kv_pool.register_layer_transfer_counter(cache.tiers.loader)
        ctx.tp_worker.register_hicache_layer_transfer_counter(cache.tiers.loader)
    return cache
