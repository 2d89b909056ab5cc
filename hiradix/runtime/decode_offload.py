"""Decode-side offload, the data movement: a finished request's pages from the device pool into
DRAM staging pages, then PUT into the cluster store by the I/O worker.

One :class:`DecodeOffloader` per decode scheduler process (TP rank), made by :meth:`DecodeOffloader.build`:
an anonymous shared-memory :class:`~hiradix.tiers.dram.DramPool` (the staging area, sized by
``--hiradix-dram-gb`` / ``--hiradix-dram-ratio``), an I/O worker over the cluster store only
(:func:`hiradix.runtime.assembly.start_worker`, no NVMe), and the store's key prefix, computed
as the prefill server's :func:`~hiradix.runtime.assembly.build_tiers` computes it. What goes
where and under which keys is :mod:`hiradix.core.decode_offload`.

Failures never reach the scheduler: a full staging area drops the PUT (counted
``staging_full``), a failed copy or PUT frees its pages (counted ``failed``), a dead worker is
respawned by the client (its jobs fail), a disabled one fails every job at once. Nothing here
blocks on the store: the PUT runs in the worker, with the store's own RPC deadline.
"""

from __future__ import annotations

import logging
import shutil
import time
from typing import Any, Callable, Optional, Sequence

import torch

from hiradix.core.decode_offload import OffloadBooks, offload_span, page_keys
from hiradix.dataplane import layout as kv_layout
from hiradix.dataplane.layout import KVLayout, device_buffers
from hiradix.io.client import IOWorkerClient
from hiradix.persistence.fingerprint import is_store_writer, store_key_prefix
from hiradix.runtime.assembly import dram_bytes_of, page_format_in, private_shm_dir, start_worker
from hiradix.tiers.dram import DramPool, num_pages_for_bytes

logger = logging.getLogger(__name__)

LOG_EVERY_S = 30.0  # at most one summary line per this many seconds (the first PUT is logged at once)


class DecodeOffloader:
    """Copies finished requests' pages into DRAM staging and PUTs them into the cluster store.

    Args:
        kv_pool: SGLang's device KV pool of this rank (``MHATokenToKVPool`` or ``MLATokenToKVPool``).
        layout: its page layout.
        dram: the staging area (``dram.layout`` is ``layout``).
        client: the started I/O worker (store only), or None when this rank does not write
            (MLA under TP: rank 0 writes the replicated latent, :func:`is_store_writer`).
        key_prefix: the store's key prefix for this rank's KV.
        on_close: called once by :meth:`close`, after the worker stopped.
    """

    def __init__(self, kv_pool: Any, layout: KVLayout, dram: DramPool, client: Optional[IOWorkerClient],
                 key_prefix: str, on_close: Callable[[], None] = lambda: None):
        self.kv_pool, self.layout, self.dram, self.client = kv_pool, layout, dram, client
        self.key_prefix = key_prefix
        self.books = OffloadBooks(dram.num_pages, layout.page_size)
        self._on_close = on_close
        self._logged_s: Optional[float] = None  # when the last summary was logged
        self._logged_tokens = -1

    @classmethod
    def build(cls, config: Any, kv_pool: Any, page_size: int, identity: dict, tp_rank: int = 0,
              io_backend: str = "auto", group_rank: Optional[int] = None) -> DecodeOffloader:
        """The offloader of one decode scheduler: staging pool, worker, key prefix.

        Args:
            config: hiradix settings (``dram_bytes``/``dram_ratio``, ``store_backend``, ``store_config``).
            kv_pool: the device KV pool of this rank.
            page_size: tokens per page.
            identity: ``model_id``, ``model_dtype``, ``tp_size`` (and ``attn_dp_size``), as the
                prefill server's (:func:`hiradix.persistence.fingerprint.store_key_prefix`).
            tp_rank: this rank (names its private directory).
            group_rank: this rank in its attention-TP group (the KV shard of the keys, and the
                writer of an MLA latent); default ``tp_rank`` (no DP attention).

        Raises:
            ValueError: no cluster store in ``config``.
            hiradix.io.client.WorkerStartError: the I/O worker did not start.
        """
        if not config.has_store_tier:
            raise ValueError("the decode-side offload needs a cluster store (--hiradix-store)")
        layout = KVLayout.from_device_pool(kv_pool, page_size)
        group_rank = tp_rank if group_rank is None else group_rank
        writer = is_store_writer(layout, group_rank)
        # a rank that does not write (MLA: rank 0 of the group puts the latent) stages nothing
        pages = num_pages_for_bytes(dram_bytes_of(config, layout, kv_pool.size // page_size), layout) if writer else 1
        shm_dir = private_shm_dir(tp_rank)
        dram = DramPool.create_anonymous(layout, pages)
        prefix = store_key_prefix(identity["model_id"], identity["model_dtype"], layout, group_rank, identity["tp_size"],
                                  attn_dp_size=identity.get("attn_dp_size", 1),
                                  page_format=page_format_in(config, "store"))
        client = None
        if writer:
            client = start_worker(dram, None, 0, shm_dir, io_backend, store_backend=config.store_backend,
                                  store_config=config.store_config, tp_rank=tp_rank, store_writer=True, config=config)

        def close() -> None:
            dram.close()
            shutil.rmtree(shm_dir, ignore_errors=True)

        logger.info("hiradix: decode-side offload on: finished requests' pages -> %s (keys %s*), DRAM staging "
                    "%d pages x %d bytes%s", config.store_backend, prefix, pages, layout.page_bytes,
                    "" if client is not None else "; this rank does not write (MLA: rank 0 puts the latent)")
        return cls(kv_pool, layout, dram, client, prefix, on_close=close)

    def offload(self, tokens: Sequence[int], namespace: Optional[tuple], prompt_tokens: int,
                slots: torch.Tensor) -> int:
        """Copy a finished request's pages into staging and submit their PUT; returns the pages
        submitted (0: nothing new, staging full, or this rank does not write).

        Synchronous copy: the staging pages hold the KV when this returns, so SGLang may free
        the request's slots right after. On the CPU the device pool is host memory and the rows
        are gathered and scattered into DRAM directly; on a GPU :func:`store_pages` gathers the
        rows on the device and moves them with one device-to-host copy per chunk, waiting for it
        (the scheduler thread pays that copy, a few pages per finished request). Not built: the
        asynchronous GPU variant (enqueue the copy on the forward stream, record an event, PUT
        once it passed), which is what HiCache's decode offload does.

        Args:
            tokens: the tokens whose KV the pool holds, in order (prompt + generated but the last).
            namespace: the request's namespace (``(extra_key, cache_salt)`` or None), as the
                prefill server's tree keys it.
            prompt_tokens: the prompt's length (its whole pages are the prefill server's).
            slots: device slot of each token of ``tokens``. Shape ``(len(tokens),)``, int64.
        """
        if self.client is None:
            return 0
        page_size = self.layout.page_size
        first, count = offload_span(prompt_tokens, len(tokens), page_size)
        if count <= 0:
            return 0
        keys = page_keys(self.key_prefix, tokens[: (first + count) * page_size], namespace, page_size, first)
        reserved = self.books.reserve(count, keys, time.monotonic())
        if reserved is None:
            return 0
        job_id, staging = reserved
        try:
            page_slots = slots[first * page_size : (first + count) * page_size]
            first_buffers, second_buffers = device_buffers(self.kv_pool, self.layout)
            kv_layout.store_pages(first_buffers, second_buffers, page_slots, self.dram.tensor, staging, self.layout)
            self.client.submit_put(job_id, staging, keys)
        except Exception:  # never the scheduler's problem: the put is dropped and counted
            logger.warning("hiradix: decode offload of %d pages dropped", count, exc_info=True)
            self.books.cancel(job_id)
            return 0
        return count

    def poll(self) -> None:
        """Reap finished PUTs (free their staging, count them); respawn a dead worker. Never blocks
        while the worker lives."""
        if self.client is None:
            return
        self.client.check_alive()
        now_s = time.monotonic()
        for done in self.client.poll():
            put = self.books.finish(done.job_id, done.ok, now_s)
            if put is not None and done.error:
                logger.info("hiradix: decode offload PUT of %d pages failed: %s", len(put.staging), done.error)
        for job_id, put in self.books.due_retries(now_s):  # failed pages, tried again (staging kept)
            logger.info("hiradix: decode offload: %d pages PUT again (try %d)", len(put.staging), put.attempt)
            try:
                self.client.submit_put(job_id, list(put.staging), list(put.keys))
            except Exception:  # never the scheduler's problem: the retry is dropped and counted
                logger.warning("hiradix: decode offload retry of %d pages dropped", len(put.staging), exc_info=True)
                self.books.cancel(job_id)
        self._log_summary()

    def _log_summary(self) -> None:
        tokens = self.books.tokens
        now = time.monotonic()
        first = self._logged_s is None and tokens["stored"] > 0
        due = self._logged_s is not None and now - self._logged_s >= LOG_EVERY_S
        if not (first or due) or sum(tokens.values()) == self._logged_tokens:
            return
        self._logged_s, self._logged_tokens = now, sum(tokens.values())
        logger.info("hiradix: decode offload: %d tokens of %d finished requests put into the store "
                    "(%d dropped: staging full; %d failed)", tokens["stored"], self.books.requests,
                    tokens["staging_full"], tokens["failed"])

    def close(self) -> None:
        """Stop the worker (its queued PUTs are dropped), release the staging area; idempotent."""
        client, self.client = self.client, None
        if client is not None:
            client.close()
        on_close, self._on_close = self._on_close, lambda: None
        on_close()
