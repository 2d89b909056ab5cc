"""Builds hiradix's prefix cache for one scheduler process (SGLang's radix-cache registry entry)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hiradix.sglang_plugin.cache import TieredRadixCache

if TYPE_CHECKING:
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

logger = logging.getLogger(__name__)


def create_hiradix_cache(ctx: TreeCacheBuildContext) -> TieredRadixCache:
    """Factory registered with SGLang's radix-cache backend registry under ``hiradix``.

    Raises:
        RuntimeError: the hiradix config did not reach this process, or SGLang built a device KV
            pool hiradix does not tier (a hybrid SWA or linear-attention pool: the message names why).
    """
    from sglang.srt.managers.cache_controller import LayerDoneCounter

    from hiradix.sglang_plugin.model_check import unsupported_device_pool_reason
    from hiradix.sglang_plugin.plugin import config_from_server_args

    config = config_from_server_args(ctx.server_args)
    kv_pool = ctx.tp_worker.model_runner.token_to_kv_pool
    reason = unsupported_device_pool_reason(kv_pool)
    if reason is not None:
        raise RuntimeError(f"hiradix: cannot build the cache: {reason}")
    logger.info("hiradix: device KV pool %s (every layer's KV in one pool; hybrid_swa=%s)",
                type(kv_pool).__name__, ctx.is_hybrid_swa)
    identity = None
    if config.nvme_bytes > 0 or config.has_store_tier:
        from hiradix.persistence.fingerprint import model_identity, weights_stamp

        args = ctx.server_args
        identity = {"model_id": model_identity(args.model_path, getattr(args, "revision", None)),
                    "model_dtype": str(ctx.model_config.dtype), "tp_size": ctx.tp_size,
                    "attn_dp_size": int(getattr(args, "attn_dp_size", 1) or 1),
                    "weights_stamp": weights_stamp(args.model_path)}
    partial_pages = config.partial_page == "on" and ctx.params.page_size > 1
    if partial_pages and (config.context_overflow != "off" or getattr(ctx.server_args, "disaggregation_mode", "null") != "null"):
        logger.info("hiradix: --hiradix-partial-page is off with prefill/decode disaggregation and with context overflow")
        partial_pages = False
    cache = TieredRadixCache(ctx.params, config, kv_pool=kv_pool, tp_rank=ctx.tp_rank, identity=identity,
                             counter_factory=LayerDoneCounter, partial_pages=partial_pages)
    if config.context_overflow != "off":
        from hiradix.sglang_plugin.overflow import ContextOverflow, resolve_mode

        mode, rope, why = resolve_mode(config.context_overflow, ctx.model_config.hf_config.to_dict())
        if why:
            logger.warning("hiradix: --hiradix-context-overflow %s falls back to recompute: %s", config.context_overflow, why)
        cache.overflow = ContextOverflow(cache, kv_pool, mode, rope, config.keep_tokens, config.drop_ratio)
    if cache.loader is not None:
        kv_pool.register_layer_transfer_counter(cache.loader)
        ctx.tp_worker.register_hicache_layer_transfer_counter(cache.loader)
    from hiradix.sglang_plugin.stop import install_scheduler_stop

    cache.stop_signal = install_scheduler_stop(cache, config.stop_timeout_s)
    return cache
