"""The decode side of PD disaggregation: SGLang's hooks for the decode-side offload.

On a ``--disaggregation-mode decode`` server SGLang 0.5.23 disables the radix cache (the decode
server keeps no prefix cache; ``arg_groups/pd_disaggregation_hook.py``), so hiradix builds no
tree there. ``--enable-hiradix`` with a cluster store (``--hiradix-store``) turns on the
decode-side offload instead (:mod:`hiradix.runtime.decode_offload`): when a request finishes,
its whole pages beyond the prompt's are copied into DRAM staging and PUT into the store under
the keys the prefill server's hiradix computes, so the next turn's prefill finds its whole
history with its normal store lookup. Three hooks, each a no-op on any other server:

- after ``Scheduler.init_batch_result_processor`` (once, at start): build the offloader of this
  rank (found by the scheduler and its batch-result processor);
- before ``SchedulerBatchResultProcessor._prepare_kv_cache_release``: SGLang calls it for a
  finished request right before ``release_kv_cache`` frees its slots (the non-offload branch of
  ``_handle_finish_state_updated_req``), so the copy reads slots that are still the request's;
- after ``SchedulerDisaggregationDecodeMixin.process_decode_queue`` (every step of the decode
  event loop): reap finished PUTs, advance the counter.

SGLang's own decode offload (``disaggregation/decode_kvcache_offload_manager.py``) needs HiCache
(``--disaggregation-decode-enable-offload-kvcache`` with ``--hicache-storage-backend``); this is
hiradix's, keyed for hiradix's prefill servers.
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

import torch

from hiradix.sglang_plugin import hooks

logger = logging.getLogger(__name__)

OFFLOADER_ATTR = "hiradix_decode_offload"  # on the scheduler
METRICS_ATTR = "hiradix_decode_metrics"  # on the scheduler
# The batch-result processor is a frozen dataclass (no attribute can be added): its offloader is
# found by the processor's id; one scheduler, so one entry, per process.
_BY_PROCESSOR: dict[int, Any] = {}


def _is_decode(scheduler: Any) -> bool:
    mode = getattr(scheduler, "disaggregation_mode", None)
    return getattr(mode, "value", mode) == "decode"


def after_init_batch_result_processor(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """On a decode server with hiradix: build this rank's offloader (staging, I/O worker, keys).

    Raises:
        RuntimeError: a hiradix hook is missing in this process.
        hiradix.io.client.WorkerStartError: the I/O worker did not start.
    """
    if not _is_decode(scheduler):
        return None
    problem = hooks.problem(hooks.Scope.SCHEDULER)
    if problem:
        raise RuntimeError(f"hiradix: {problem}")
    from sglang.srt.runtime_context import get_parallel

    from hiradix.persistence.fingerprint import model_identity
    from hiradix.runtime.decode_offload import DecodeOffloader
    from hiradix.sglang_plugin.plugin import config_from_server_args

    config = config_from_server_args(scheduler.server_args)
    args, parallel = scheduler.server_args, get_parallel()
    identity = {"model_id": model_identity(args.model_path, getattr(args, "revision", None)),
                "model_dtype": str(scheduler.model_config.dtype), "tp_size": parallel.tp_size,
                "attn_dp_size": int(getattr(args, "attn_dp_size", 1) or 1)}  # as the prefill side's (cache.py)
    # The KV shard is the rank in the attention-TP group (the TP rank without DP attention).
    offloader = DecodeOffloader.build(config, scheduler.tp_worker.model_runner.token_to_kv_pool,
                                      scheduler.page_size, identity, tp_rank=parallel.tp_rank,
                                      group_rank=parallel.attn_tp_rank)
    atexit.register(offloader.close)
    _BY_PROCESSOR[id(scheduler.batch_result_processor)] = offloader
    setattr(scheduler, OFFLOADER_ATTR, offloader)
    setattr(scheduler, METRICS_ATTR, _metrics(parallel) if getattr(args, "enable_metrics", False) else None)
    return None


def _metrics(parallel: Any) -> Any:
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.observability.metrics_collector import radix_cache_metric_labels
    from sglang.srt.runtime_context import get_observability

    from hiradix.runtime.decode_metrics import DecodeOffloadMetrics

    labels = radix_cache_metric_labels("DecodeOffload", parallel, is_dp_attention_enabled())
    labels.update(get_observability().extra_metric_labels or {})
    return DecodeOffloadMetrics(labels)


def before_prepare_kv_cache_release(processor: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """A request finished: offload its pages before SGLang frees its slots (an aborted one's KV
    may be incomplete, e.g. a failed transfer from the prefill server: it is skipped)."""
    offloader = _BY_PROCESSOR.get(id(processor))
    if offloader is None or not req.finished() or req.kv.req_pool_idx is None or req.kv.req_pool_idx < 0:
        return None
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from hiradix.sglang_plugin.cache import namespace_of

    if isinstance(req.finished_reason, FINISH_ABORT):
        return None
    tokens = list(req.origin_input_ids) + list(req.output_ids)
    kv_tokens = min(req.kv.kv_committed_len, len(tokens) - 1)  # the last token's KV is never computed
    if kv_tokens <= 0:
        return None
    row = processor.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :kv_tokens]
    namespace = namespace_of(RadixKey([], req.extra_key, cache_salt=req.cache_salt))
    offloader.offload(tokens[:kv_tokens], namespace, len(req.origin_input_ids), row.to(dtype=torch.int64))
    return None


def after_process_decode_queue(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """Every decode step: reap finished PUTs and advance the counter."""
    offloader = getattr(scheduler, OFFLOADER_ATTR, None)
    if offloader is None:
        return None
    offloader.poll()
    metrics = getattr(scheduler, METRICS_ATTR, None)
    if metrics is not None:
        metrics.update(offloader.books.tokens)
    return None
