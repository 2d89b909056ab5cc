"""Compressed pages in the lower tiers, in the I/O worker (``--hiradix-cold-format``, issue 21).

DRAM holds pages at the model's dtype (what HBM loads from); a *cold* tier (NVMe, the cluster
store: ``--hiradix-cold-tiers``) holds them encoded by :class:`hiradix.dataplane.kv_codec.PageCodec`
(``fp8``, ``int4``; ``exact`` is the unchanged bytes behind a header). :class:`ColdPages` sits
between the worker's jobs and a tier's batch calls: a write encodes the DRAM pages into a scratch
arena and moves the encoded bytes; a read moves encoded bytes into the arena and decodes the pages
whose move succeeded and whose header is this codec's into DRAM. A page of another format, dtype
or layout is a miss, never misread (the header check, on top of the tier's own checksum). So the
disk and the network carry the compressed bytes (CacheGen, SIGCOMM '24, makes the case for slow
links); decoding runs on the worker's CPU threads here, so PCIe carries decoded pages (with DRAM
as a cold tier the scheduler decodes on the device after the copy instead, see below).

With DRAM itself a cold tier (``--hiradix-cold-tiers dram,...``) the DRAM pages already hold encoded
pages (the scheduler encodes and decodes on the KV device, :mod:`hiradix.dataplane.encoded_mover`):
:class:`EncodedDram` then moves them as they are and checks each read page's header.

The arena: ``slots`` blocks of ``chunk_pages`` encoded pages, one per concurrent job (a job takes a
block and gives it back); the cluster store registers the whole arena once for zero-copy moves.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence

import torch

from hiradix.dataplane.kv_codec import HEADER_BYTES, PageCodec

Move = Callable[[list, list[memoryview]], list[bool]]  # (slot ids or keys, page views) -> ok per page


class ColdPages:
    """Encode on the way down, decode on the way up, through a fixed scratch arena.

    Args:
        codec: the format of the cold tier.
        chunk_pages: pages encoded per step (a job moves in chunks of this many).
        slots: concurrent jobs (the tier's thread count).
        register: called once with ``(pointer, bytes)`` of the arena (the store's zero-copy
            registration), or None.
    """

    def __init__(self, codec: PageCodec, chunk_pages: int, slots: int,
                 register: Callable[[int, int], None] | None = None):
        if chunk_pages < 1 or slots < 1:
            raise ValueError(f"chunk_pages and slots must be >= 1, got {chunk_pages}, {slots}")
        self.codec, self.chunk_pages = codec, chunk_pages
        self.arena = torch.zeros((slots, chunk_pages, codec.encoded_bytes), dtype=torch.uint8)
        if register is not None:
            register(self.arena.data_ptr(), self.arena.numel())
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(slots):
            self._free.put(i)

    @property
    def encoded_bytes(self) -> int:
        """Bytes of one page in the cold tier."""
        return self.codec.encoded_bytes

    def write(self, move: Move, ids: Sequence, pages: Sequence[memoryview]) -> list[bool]:
        """Encode ``pages`` (DRAM page views) and ``move`` the encoded bytes to ``ids``."""
        return self._chunked(ids, pages, lambda block, i, p: self._write_chunk(move, block, i, p))

    def read(self, move: Move, ids: Sequence, pages: Sequence[memoryview]) -> list[bool]:
        """``move`` encoded pages from ``ids`` and decode them into ``pages``; False for a page
        whose move failed or whose header is not this codec's (that page's DRAM bytes are then
        undefined, as after any failed read)."""
        return self._chunked(ids, pages, lambda block, i, p: self._read_chunk(move, block, i, p))

    # ------------------------------------------------------------------ internals
    def _chunked(self, ids: Sequence, pages: Sequence[memoryview],
                 run: Callable[[torch.Tensor, list, list[memoryview]], list[bool]]) -> list[bool]:
        if len(ids) != len(pages):
            raise ValueError(f"{len(ids)} ids for {len(pages)} pages")
        index = self._free.get()
        try:
            block = self.arena[index]
            ok: list[bool] = []
            for lo in range(0, len(pages), self.chunk_pages):
                hi = min(lo + self.chunk_pages, len(pages))
                ok += run(block[: hi - lo], list(ids[lo:hi]), list(pages[lo:hi]))
            return ok
        finally:
            self._free.put(index)

    def _write_chunk(self, move: Move, block: torch.Tensor, ids: list, pages: list[memoryview]) -> list[bool]:
        source = torch.stack([torch.frombuffer(p, dtype=torch.uint8) for p in pages])
        block.copy_(self.codec.encode_pages(source))
        return [bool(x) for x in move(ids, [memoryview(row.numpy()) for row in block])]

    def _read_chunk(self, move: Move, block: torch.Tensor, ids: list, pages: list[memoryview]) -> list[bool]:
        ok = [bool(x) for x in move(ids, [memoryview(row.numpy()) for row in block])]
        good = (block[:, :HEADER_BYTES] == self.codec.header).all(dim=1).tolist()
        ok = [a and b for a, b in zip(ok, good)]
        rows = [i for i, x in enumerate(ok) if x]
        if rows:
            out = torch.empty((len(rows), self.codec.layout.page_bytes), dtype=torch.uint8)
            self.codec.decode_pages(block[rows], out)
            for row, i in zip(out, rows):
                torch.frombuffer(pages[i], dtype=torch.uint8).copy_(row)
        return ok


class EncodedDram:
    """The worker's side of a DRAM pool that holds encoded pages: NVMe and the store get DRAM's
    bytes as they are; a read page whose header is not ``codec``'s is a miss (False), never misread.

    Args:
        codec: the DRAM pool's format (its ``encoded_bytes`` is the pool's page size).
    """

    def __init__(self, codec: PageCodec):
        self.codec = codec
        self._header = bytes(codec.header.tolist())

    @property
    def encoded_bytes(self) -> int:
        """Bytes of one page in every tier below HBM."""
        return self.codec.encoded_bytes

    def write(self, move: Move, ids: Sequence, pages: Sequence[memoryview]) -> list[bool]:
        """``move`` the DRAM pages as they are."""
        return [bool(x) for x in move(ids, pages)]

    def read(self, move: Move, ids: Sequence, pages: Sequence[memoryview]) -> list[bool]:
        """``move`` pages into DRAM, then check each moved page's header."""
        ok = [bool(x) for x in move(ids, pages)]
        return [x and bytes(p[:HEADER_BYTES]) == self._header for x, p in zip(ok, pages)]
