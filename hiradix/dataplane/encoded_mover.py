"""HBM <-> DRAM movement when DRAM is a cold tier: pages encoded and decoded on the KV device.

With ``--hiradix-cold-tiers dram,...`` (issue 21) the DRAM pool holds pages encoded by
:class:`hiradix.dataplane.kv_codec.PageCodec` (``fp8``, ``int4``), ``encoded_bytes`` each, and NVMe
and the store get DRAM's bytes as they are (:class:`hiradix.io.cold_pages.EncodedDram`). So every
copy below HBM, the PCIe copy included, carries the compressed bytes, and DRAM holds 2-4x the
tokens of the same bytes (CacheGen, SIGCOMM '24, makes the case for moving compressed KV).

:class:`EncodedHostMover` is :class:`hiradix.dataplane.movers.HostMover` with the two copies
replaced:

- BACKUP (HBM -> DRAM): the op's token slots are gathered into exact pages on the device
  (:func:`hiradix.dataplane.layout.gather_pages`), encoded there, and the encoded rows copied
  straight into their DRAM pages, one copy per run of consecutive page ids
  (:func:`hiradix.dataplane.device_copy.contiguous_runs`). On CUDA this runs on the mover's side
  stream; into the pinned pool the copies are asynchronous and have landed when the op's event fires
  (the base class's completion). On the CPU (a CPU server, tests) it runs at the next reap, as the
  base class's.
- PROMOTE (DRAM -> HBM): at the op's first layer the encoded pages are copied to the device, one
  copy per run of consecutive DRAM pages, and decoded there once (on CUDA on the layer-wise
  loader's stream, asynchronous from the pinned pool, so copy and decode overlap the forward like
  any load); every layer then scatters its part of the decoded pages into the token slots.

Only page-major layouts (the I/O worker's) are supported; a decode whose header is not this codec's
cannot happen here (this process encoded the page, or the worker checked the header on its read).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from hiradix.core.ledger import Kind, Transfer
from hiradix.dataplane import device_copy
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
        super().__init__(kv_pool, dram, loader, load_path=None, writes_dram=writes_dram, flush_barrier=flush_barrier)

    def _choose_path(self, forced: Optional[str]) -> str:
        if self.cuda:
            logger.info("hiradix DRAM -> HBM path: %s (%s pages in DRAM, decoded on the device)", LOAD_PATH,
                        self.codec.fmt)
        return LOAD_PATH

    # ---------------------------------------------------------------- backup
    def _copy_backup(self, op: Transfer) -> None:
        """Gather, encode on the device, copy the encoded rows into their DRAM pages."""
        if not self.writes_dram:
            return  # the owner rank writes these pages of the shared pool
        pages = kv_layout.gather_pages(self._k(), self._v(), self._slots(op), self.layout)  # (n, L, E)
        encoded = self.codec.encode_pages(pages.view(pages.shape[0], -1).view(torch.uint8))
        for index, first, length in device_copy.contiguous_runs(op.dst_ids):
            self.dram.tensor[first : first + length].copy_(encoded[index : index + length], non_blocking=True)

    # --------------------------------------------------------------- promote
    def promote(self, op: Transfer) -> None:
        """Queue ``op``'s DRAM -> HBM load: decode all its pages at layer 0, scatter each layer."""
        assert op.kind == Kind.PROMOTE
        slots = self._slots(op)
        ids = list(op.src_ids)
        decoded: list[torch.Tensor] = []

        def copy_layer(layer: int) -> None:
            if not decoded:
                decoded.append(self._decode(ids, slots.device))
            bufs = kv_layout.layer_buffers(self._k(), self._v(), layer)
            kv_layout.scatter_planes(decoded[0][:, layer], bufs, slots, self.layout)

        self.loader.submit(op.op_id, copy_layer)

    def _decode(self, ids: list[int], device: torch.device) -> torch.Tensor:
        """DRAM pages ``ids`` copied to ``device`` encoded and decoded there: ``(n, L, E)`` of the
        layout's dtype."""
        encoded = torch.empty((len(ids), self.dram.page_bytes), dtype=torch.uint8, device=device)
        for index, first, length in device_copy.contiguous_runs(ids):
            encoded[index : index + length].copy_(self.dram.tensor[first : first + length], non_blocking=True)
        out = torch.empty((len(ids), self.layout.page_bytes), dtype=torch.uint8, device=device)
        self.codec.decode_pages(encoded, out)
        return out.view(self.layout.dtype).view(len(ids), self.layout.num_layers, -1)
