"""HBM <-> DRAM data movement in the scheduler process (the in-process half of the data plane).

Carries out the BACKUP (HBM -> DRAM) and PROMOTE (DRAM -> HBM) transfers that the ledger
(:class:`hiradix.core.ledger.TierBooks`) opened; it is the real
:class:`hiradix.core.ports.HostMover`. DRAM <-> NVMe transfers go to the I/O worker.
Only op ids come back (:meth:`HostMover.finished`), never tree nodes.

Backups are asynchronous: on CUDA they run on a side stream after the forward stream's
current work and complete when their event fires (into a pinned DRAM pool every copy is
``non_blocking``, :func:`hiradix.dataplane.device_copy.store_pages_async`; into a pageable one
the host waits for each chunk); on CPU they are queued at checkpoint time and copied in one
batch at the next scheduler step (or earlier, when an eviction needs the pinned slots).
Promotions go through :class:`hiradix.dataplane.layerwise.LayerwiseLoader`, layer by layer: on
CUDA with a pinned pool, the promotions of one batch are merged into one
:class:`hiradix.dataplane.device_copy.LayerLoad` at :meth:`HostMover.start_loading` (a few
kernels per layer for the whole batch); otherwise each promotion copies with
:func:`hiradix.dataplane.layout.load_layer`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from hiradix.core.ledger import Kind, Transfer
from hiradix.dataplane import device_copy
from hiradix.dataplane import layout as kv_layout
from hiradix.dataplane.layerwise import LayerwiseLoader
from hiradix.tiers.dram import DramPool
from hiradix.tiers.pinned import host_pointer_usable_on_device

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Backup:
    op: Transfer
    event: Optional[Any] = None  # torch.cuda.Event on CUDA


class HostMover:
    """Copies pages between SGLang's device KV pool and the shared DRAM pool.

    Args:
        kv_pool: SGLang's ``MHATokenToKVPool`` (per-layer ``k_buffer``/``v_buffer``) or
            ``MLATokenToKVPool`` (``kv_buffer``).
        dram: the DRAM tier's shared-memory pool (pinned with ``DramPool.pin_for_cuda`` on CUDA).
        loader: the per-layer load counter registered with the KV pool.
        load_path: force a DRAM -> HBM path (``device_copy.LOAD_PATHS``; gpu_check, tests);
            None chooses with :func:`hiradix.dataplane.device_copy.choose_load_path`.
        writes_dram: False on a TP rank that maps another rank's DRAM pool (MLA, one host copy
            per node, :mod:`hiradix.runtime.shared_host_copy`): its backups complete without
            copying (the owner rank writes the identical latent); promotions still copy.
        flush_barrier: with a shared pool, called by :meth:`flush` on every rank after its own
            copies (a barrier over the TP group): a flush's copies are applied without an
            agreement (:meth:`hiradix.core.controller.TierController._reap`), so a rank that
            does not write must not go on until the owner's copies have landed.

    Attributes:
        load_path: the DRAM -> HBM path in use (``"gather"``, ``"runs"`` or ``"host"``).
    """

    def __init__(self, kv_pool: Any, dram: DramPool, loader: LayerwiseLoader, load_path: Optional[str] = None,
                 writes_dram: bool = True, flush_barrier: Optional[Callable[[], None]] = None):
        self.kv_pool = kv_pool
        self.writes_dram = writes_dram
        self.flush_barrier = flush_barrier
        self.dram = dram
        self.layout = dram.layout
        self.loader = loader
        self.cuda = loader.cuda
        self._backups: list[_Backup] = []
        self._stream = torch.cuda.Stream() if self.cuda else None
        self._pending: list[tuple[int, list[int], torch.Tensor]] = []  # merged promotions (not "host")
        self._source: Optional[torch.Tensor] = None  # the pool's device mapping ("gather")
        self.load_path = self._choose_path(load_path)

    def _choose_path(self, forced: Optional[str]) -> str:
        """Decide the DRAM -> HBM path once (and map the pool for ``gather``); logs the choice."""
        device = self._k()[0].device
        pinned = self.dram.cuda_pinned
        ok = host_pointer_usable_on_device(device.index or 0) if self.cuda and pinned else None
        path, reason = device_copy.choose_load_path(self.cuda, pinned, ok)
        if forced is not None:
            if forced not in device_copy.LOAD_PATHS:
                raise ValueError(f"unknown load path {forced!r}; choose one of {device_copy.LOAD_PATHS}")
            path, reason = forced, "forced"
        if path == "gather":
            if self.cuda:
                self._source, why = device_copy.mapped_view(self.dram.tensor, device)
            else:  # CPU tests and gpu_check's dry run: the pool is its own "device view"
                self._source, why = self.dram.tensor, "CPU"
            if self._source is None:
                path, reason = "runs", f"pinned DRAM cannot be mapped ({why}): one DMA copy per contiguous extent"
        if self.cuda:
            logger.info("hiradix DRAM -> HBM path: %s (%s)", path, reason)
        return path

    def _k(self) -> list[torch.Tensor]:
        return kv_layout.device_buffers(self.kv_pool, self.layout)[0]

    def _v(self) -> Optional[list[torch.Tensor]]:
        """V buffers per layer; None for MLA (one latent buffer, :func:`kv_layout.device_buffers`)."""
        return kv_layout.device_buffers(self.kv_pool, self.layout)[1]

    def _layer_v(self, layer: int) -> Optional[torch.Tensor]:
        v = self._v()
        return None if v is None else v[layer]

    # ---------------------------------------------------------------- backup
    def backup(self, op: Transfer) -> None:
        """Start copying ``op``'s HBM slots into its DRAM pages (all layers)."""
        assert op.kind == Kind.BACKUP
        entry = _Backup(op)
        if self.cuda:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                self._copy_backup(op)
                entry.event = torch.cuda.Event()
                entry.event.record()
        self._backups.append(entry)

    def _slots(self, op: Transfer) -> torch.Tensor:
        """``op.hbm_parts`` as one int64 tensor on the device pool's device."""
        device = self._k()[0].device
        parts = [torch.as_tensor(p, dtype=torch.int64, device=device) for p in op.hbm_parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _copy_backup(self, op: Transfer) -> None:
        if not self.writes_dram:
            return  # the owner rank writes these pages of the shared pool
        slots = self._slots(op)
        if self.cuda and self.dram.cuda_pinned:
            device_copy.store_pages_async(self._k(), self._v(), slots, self.dram.tensor, op.dst_ids, self.layout)
        else:
            kv_layout.store_pages(self._k(), self._v(), slots, self.dram.tensor, op.dst_ids, self.layout)

    # --------------------------------------------------------------- promote
    def promote(self, op: Transfer) -> None:
        """Queue ``op``'s DRAM -> HBM copy (merged with the batch's others unless the path is ``host``)."""
        assert op.kind == Kind.PROMOTE
        slots = self._slots(op)
        pages = list(op.src_ids)
        if self.load_path != "host":
            self._pending.append((op.op_id, pages, slots))
            return

        def copy_layer(layer: int) -> None:
            kv_layout.load_layer(self._k()[layer], self._layer_v(layer), layer, self.dram.tensor, pages, slots, self.layout)

        self.loader.submit(op.op_id, copy_layer)

    def _submit_pending(self) -> None:
        """Hand the merged promotions to the loader as one :class:`LayerLoad` (all their op ids)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        pages = [page for _, op_pages, _ in pending for page in op_pages]
        parts = [slots for _, _, slots in pending]
        slots = parts[0] if len(parts) == 1 else torch.cat(parts)
        load = device_copy.LayerLoad(self.dram.tensor, pages, slots, self.layout, self.load_path, self._source)

        def copy_layer(layer: int) -> None:
            load.copy_layer(layer, self._k()[layer], self._layer_v(layer))

        self.loader.submit([op_id for op_id, _, _ in pending], copy_layer)

    def start_loading(self) -> int:
        """Start the promotions queued for the batch being built; returns its consumer index."""
        self._submit_pending()
        return self.loader.start()

    # ------------------------------------------------------------ completion
    def finished(self) -> list[int]:
        """Op ids of backups and promotions that have fully landed (CPU backups run now)."""
        done = []
        still = []
        for entry in self._backups:
            if not self.cuda:
                self._copy_backup(entry.op)
                done.append(entry.op.op_id)
            elif entry.event.query():
                done.append(entry.op.op_id)
            else:
                still.append(entry)
        self._backups = still
        return done + self.loader.finished()

    def flush(self) -> list[int]:
        """Finish every pending copy now; returns all op ids that completed."""
        self._submit_pending()
        self.loader.flush()
        if self.cuda and self._backups:
            self._stream.synchronize()
        done = self.finished()
        if self.flush_barrier is not None:
            self.flush_barrier()  # every rank flushes at the same point: the owner's copies have landed
        return done

    def drop_pending(self) -> None:
        """Forget pending copies without running them (after :meth:`flush`, on reset)."""
        self._backups.clear()
        self._pending.clear()
        self.loader.reset()
