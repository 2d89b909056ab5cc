"""HBM <-> DRAM movement when DRAM is a cold tier: pages encoded and decoded on the KV device.

With ``--hiradix-cold-tiers dram,...`` (issue 21) the DRAM pool holds pages encoded by
:class:`hiradix.dataplane.kv_codec.PageCodec` (``fp8``, ``int4``), ``encoded_bytes`` each, and NVMe
and the store get DRAM's bytes as they are (:class:`hiradix.io.cold_pages.EncodedDram`). So every
copy below HBM, the PCIe copy included, carries the compressed bytes, and DRAM holds 2-4x the
tokens of the same bytes (CacheGen, SIGCOMM '24, makes the case for moving compressed KV).

:class:`EncodedHostMover` is :class:`hiradix.dataplane.movers.HostMover` with the two copies
replaced:

- BACKUP (HBM -> DRAM): the op's token slots are gathered into exact pages on the device
  (:func:`hiradix.dataplane.layout.gather_pages`), encoded there, and the encoded bytes copied to
  DRAM. On CUDA this runs on the mover's side stream into a pinned staging buffer; the rows land
  in DRAM when its event has fired (:meth:`finished`). On the CPU (a CPU server, tests) the copy runs
  at the next reap, as the base class's.
- PROMOTE (DRAM -> HBM): at the op's first layer the encoded pages are copied to the device and
  decoded there once (on CUDA on the layer-wise loader's stream, so the decode overlaps the forward
  like any load); every layer then scatters its part of the decoded pages into the token slots.
  The encoded rows are gathered on the host (``index_select``) and copied from pageable memory, so
  the scheduler thread waits for that (compressed) copy; a pinned staging buffer would let it
  overlap too (not built).

Only page-major layouts (the I/O worker's) are supported; a decode whose header is not this codec's
cannot happen here (this process encoded the page, or the worker checked the header on its read).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from hiradix.core.ledger import Kind, Transfer
from hiradix.dataplane import layout as kv_layout
from hiradix.dataplane.kv_codec import PageCodec
from hiradix.dataplane.layerwise import LayerwiseLoader
from hiradix.dataplane.movers import HostMover
from hiradix.tiers.dram import DramPool

logger = logging.getLogger(__name__)

LOAD_PATH = "decode"  # the name of this mover's DRAM -> HBM path (``HostMover.load_path``)


class EncodedHostMover(HostMover):
    """Copies pages between SGLang's device KV pool and a DRAM pool of encoded pages.

    Args:
        kv_pool: SGLang's ``MHATokenToKVPool`` or ``MLATokenToKVPool``.
        dram: a pool created with ``page_bytes=codec.encoded_bytes`` (``DramPool.encoded``).
        loader: the per-layer load counter registered with the KV pool.
        codec: the DRAM tier's format (``PageCodec(layout, fmt)`` of the pool's layout).
        writes_dram, flush_barrier: as :class:`HostMover`'s (MLA's shared host copy).

    Raises:
        ValueError: the pool is not encoded in ``codec``'s size, or its layout is layer-major.
    """

    def __init__(self, kv_pool: Any, dram: DramPool, loader: LayerwiseLoader, codec: PageCodec,
                 writes_dram: bool = True, flush_barrier: Optional[Callable[[], None]] = None):
        if dram.page_bytes != codec.encoded_bytes or not dram.layout.page_major:
            raise ValueError(f"an encoded DRAM pool needs page-major pages of {codec.encoded_bytes} bytes "
                             f"({codec.fmt}), got {dram.page_bytes} (page_major={dram.layout.page_major})")
        self.codec = codec
        self._staged: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # CUDA: op id -> (DRAM ids, pinned rows)
        super().__init__(kv_pool, dram, loader, load_path=None, writes_dram=writes_dram, flush_barrier=flush_barrier)

    def _choose_path(self, forced: Optional[str]) -> str:
        if self.cuda:
            logger.info("hiradix DRAM -> HBM path: %s (%s pages in DRAM, decoded on the device)", LOAD_PATH,
                        self.codec.fmt)
        return LOAD_PATH

    # ---------------------------------------------------------------- backup
    def _copy_backup(self, op: Transfer) -> None:
        """Gather, encode on the device, copy the encoded rows toward DRAM (CUDA: staged)."""
        if not self.writes_dram:
            return  # the owner rank writes these pages of the shared pool
        pages = kv_layout.gather_pages(self._k(), self._v(), self._slots(op), self.layout)  # (n, L, E)
        encoded = self.codec.encode_pages(pages.view(pages.shape[0], -1).view(torch.uint8))
        ids = torch.as_tensor(list(op.dst_ids), dtype=torch.int64)
        if encoded.device.type == "cpu":
            self.dram.tensor.index_copy_(0, ids, encoded)
            return
        staging = torch.empty(encoded.shape, dtype=torch.uint8, pin_memory=True)
        staging.copy_(encoded, non_blocking=True)  # on the side stream; lands when the op's event fires
        self._staged[op.op_id] = (ids, staging)

    def finished(self) -> list[int]:
        """Op ids of backups and promotions that have landed; staged CUDA backups are copied into
        DRAM first."""
        done = super().finished()
        for op_id in done:
            staged = self._staged.pop(op_id, None)
            if staged is not None:
                self.dram.tensor.index_copy_(0, staged[0], staged[1])
        return done

    # --------------------------------------------------------------- promote
    def promote(self, op: Transfer) -> None:
        """Queue ``op``'s DRAM -> HBM load: decode all its pages at layer 0, scatter each layer."""
        assert op.kind == Kind.PROMOTE
        slots = self._slots(op)
        ids = torch.as_tensor(list(op.src_ids), dtype=torch.int64)
        decoded: list[torch.Tensor] = []

        def copy_layer(layer: int) -> None:
            if not decoded:
                decoded.append(self._decode(ids, slots.device))
            bufs = kv_layout.layer_buffers(self._k(), self._v(), layer)
            kv_layout.scatter_planes(decoded[0][:, layer], bufs, slots, self.layout)

        self.loader.submit(op.op_id, copy_layer)

    def _decode(self, ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        """DRAM pages ``ids`` copied to ``device`` encoded and decoded there: ``(n, L, E)`` of the
        layout's dtype."""
        encoded = self.dram.tensor.index_select(0, ids).to(device)
        out = torch.empty((ids.numel(), self.layout.page_bytes), dtype=torch.uint8, device=device)
        self.codec.decode_pages(encoded, out)
        return out.view(self.layout.dtype).view(ids.numel(), self.layout.num_layers, -1)

    def drop_pending(self) -> None:
        """Forget pending copies (after :meth:`flush`, on reset), staged backups included."""
        super().drop_pending()
        self._staged.clear()
