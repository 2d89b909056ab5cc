"""HBM <-> DRAM data movement in the scheduler process (the in-process half of the data plane).

Carries out the BACKUP (HBM -> DRAM) and PROMOTE (DRAM -> HBM) transfers that the ledger
(:class:`hiradix.core.ledger.TierBooks`) opened; it is the real
:class:`hiradix.core.ports.HostMover`. DRAM <-> NVMe transfers go to the I/O worker.
Only op ids come back (:meth:`HostMover.finished`), never tree nodes.

Backups are asynchronous: on CUDA they run on a side stream after the forward stream's
current work and complete when their event fires; on CPU they are queued at checkpoint time
and copied in one batch at the next scheduler step (or earlier, when an eviction needs the
pinned slots). Promotions go through :class:`hiradix.dataplane.layerwise.LayerwiseLoader`,
layer by layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from hiradix.core.ledger import Kind, Transfer
from hiradix.dataplane import layout as kv_layout
from hiradix.dataplane.layerwise import LayerwiseLoader
from hiradix.tiers.dram import DramPool


@dataclass(eq=False)
class _Backup:
    op: Transfer
    event: Optional[Any] = None  # torch.cuda.Event on CUDA


class HostMover:
    """Copies pages between SGLang's device KV pool and the shared DRAM pool.

    Args:
        kv_pool: SGLang's ``MHATokenToKVPool`` (per-layer ``k_buffer``/``v_buffer``).
        dram: the DRAM tier's shared-memory pool.
        loader: the per-layer load counter registered with the KV pool.
    """

    def __init__(self, kv_pool: Any, dram: DramPool, loader: LayerwiseLoader):
        self.kv_pool = kv_pool
        self.dram = dram
        self.layout = dram.layout
        self.loader = loader
        self.cuda = loader.cuda
        self._backups: list[_Backup] = []
        self._stream = torch.cuda.Stream() if self.cuda else None

    def _k(self) -> list[torch.Tensor]:
        return self.kv_pool.k_buffer

    def _v(self) -> list[torch.Tensor]:
        return self.kv_pool.v_buffer

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
        slots = self._slots(op)
        kv_layout.store_pages(self._k(), self._v(), slots, self.dram.tensor, op.dst_ids, self.layout)

    # --------------------------------------------------------------- promote
    def promote(self, op: Transfer) -> None:
        """Queue ``op``'s DRAM -> HBM copy with the layer-wise loader."""
        assert op.kind == Kind.PROMOTE
        slots = self._slots(op)
        pages = list(op.src_ids)

        def copy_layer(layer: int) -> None:
            kv_layout.load_layer(self._k()[layer], self._v()[layer], layer, self.dram.tensor, pages, slots, self.layout)

        self.loader.submit(op.op_id, copy_layer)

    def start_loading(self) -> int:
        """Start the promotions queued for the batch being built; returns its consumer index."""
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
        self.loader.flush()
        if self.cuda and self._backups:
            self._stream.synchronize()
        return self.finished()

    def drop_pending(self) -> None:
        """Forget pending copies without running them (after :meth:`flush`, on reset)."""
        self._backups.clear()
        self.loader.reset()
