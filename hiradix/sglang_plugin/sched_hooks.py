"""Scheduler hooks (installed in scheduler processes only, when hiradix is enabled).

SGLang 0.5.23 gates its per-step cache events and its host-load start on
``--enable-hierarchical-cache`` (``managers/scheduler.py``: ``_process_hicache_events`` and
``_get_new_batch_prefill_raw``), which hiradix refuses; these hooks call the same cache methods
for a :class:`hiradix.sglang_plugin.cache.TieredRadixCache`, and let admission skip a request whose NVMe reads are
still in flight without blocking the requests behind it (``schedule_policy.PrefillAdder``).
Each hook is a no-op for any other tree cache.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from hiradix.core.read_landing import LAND_HEAD_REQUESTS, LAND_WAIT_S

# A scheduler with nothing to run but requests held for their NVMe or store reads blocks at most
# this long per loop iteration on the I/O results (or a new request) instead of spinning.
HELD_WAIT_S = 0.005


def _hiradix_cache(tree_cache: Any):
    from hiradix.sglang_plugin.cache import TieredRadixCache

    return tree_cache if isinstance(tree_cache, TieredRadixCache) else None


def after_process_hicache_events(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Every scheduler step (also when the running batch is full): reap acks, move pages."""
    cache = _hiradix_cache(scheduler.tree_cache)
    if cache is not None:
        cache.check_hicache_events()
        if cache.stop_signal is not None and cache.stop_signal.after_step():
            return None  # a stop agreed in this step: drained, closed, the process ends
        # The chunked request's next chunks run before anything queued: position 0. Requests
        # in the running batch hold locks on their prefixes, which is stronger protection.
        chunked = getattr(scheduler, "chunked_req", None)
        cache.observe_queue(([chunked] if chunked is not None else []) + list(scheduler.waiting_queue))
        # A prefill batch forms next: the head's reads about to land join it. The queue and the
        # batch's room are the same on every TP rank, and so is whether the tiers stepped again.
        running = scheduler.running_batch
        if scheduler.waiting_queue and not getattr(running, "batch_is_full", False):
            head = list(itertools.islice(scheduler.waiting_queue, LAND_HEAD_REQUESTS))
            if cache.land_queued_reads(head, LAND_WAIT_S) and cache.stop_signal is not None \
                    and cache.stop_signal.after_step():
                return None  # a stop agreed in that step: drained, closed, the process ends
    return None


def after_on_idle(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Nothing to run: if admission held requests for their reads, wait (bounded) for an I/O
    result or a new request instead of spinning through the loop. SGLang's own idle sleep is
    for a fully idle server only; a spinning scheduler takes a core from the I/O worker."""
    cache = _hiradix_cache(scheduler.tree_cache)
    if cache is None or not scheduler.running_batch.is_empty():
        return None
    import zmq

    wake = [s for s in (getattr(scheduler, "recv_from_tokenizer", None), getattr(scheduler, "recv_from_rpc", None))
            if isinstance(s, zmq.Socket)]  # fmt: skip
    cache.wait_for_reads(HELD_WAIT_S, wake)
    return None


def after_get_new_batch_prefill_raw(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Start the batch's layer-wise promotions; the batch carries the consumer index."""
    cache = _hiradix_cache(scheduler.tree_cache)
    if cache is None or result is None:
        return None
    new_batch = result[0]
    if new_batch is not None and new_batch.hicache_consumer_index < 0:
        new_batch.hicache_consumer_index = cache.ready_to_load_host_cache()
    return None


def around_add_one_req(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """Skip (``CONTINUE``) a request whose NVMe -> DRAM reads are in flight and not timed out."""
    cache = _hiradix_cache(adder.tree_cache)
    if cache is not None and cache.should_wait(req):
        from sglang.srt.managers.schedule_policy import AddReqResult

        return AddReqResult.CONTINUE
    return original(adder, req, *args, **kwargs)


def after_get_cached_tokens_details(result: Any, streamer: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """Set ``storage_backend`` of a request's ``cached_tokens_details`` to where its storage hits
    came from, e.g. ``"nvme=160,mooncake=320"`` (tokens per source; ``storage`` is their sum)."""
    from hiradix.sglang_plugin.overflow import details_of

    label = getattr(req, "hiradix_storage_backend", None)
    cut = details_of(req)
    if cut is not None:  # a prompt cut for the context (--hiradix-context-overflow): say how
        result = {**(result or {"device": 0, "host": 0}), **cut}
    if result is None or not label:
        return result if cut is not None else None
    return {**result, "storage_backend": label}


def around_run_batch(original: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """Time an extend batch's forward for the prefill-rate estimate (``--hiradix-store-read auto``).

    Measured where ``run_batch`` returns after the forward: on CPU (synchronous, also with the
    overlap scheduler, which SGLang 0.5.23 leaves on there) or without the overlap scheduler. On
    an accelerator with it, ``run_batch`` returns at launch: nothing is measured and ``auto``
    keeps reading.
    """
    cache = _hiradix_cache(scheduler.tree_cache)
    synchronous = str(getattr(batch, "device", "")) == "cpu" or not getattr(scheduler, "enable_overlap", True)
    measure = cache is not None and synchronous and batch.forward_mode.is_extend() and batch.extend_num_tokens
    if not measure:
        return original(scheduler, batch, *args, **kwargs)
    start_s = time.perf_counter()
    result = original(scheduler, batch, *args, **kwargs)
    cache.note_prefill(int(batch.extend_num_tokens), time.perf_counter() - start_s)
    return result
