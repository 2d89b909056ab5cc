"""The GPU data path between the pinned DRAM tier and SGLang's device pool, one layer at a time.

Three ways to copy layer ``l`` of ``n`` DRAM pages into their device token slots (DRAM ->
HBM), chosen once per process by :func:`choose_load_path`:

- ``gather``: the pinned pool is mapped into the device's address space (UVA), so one
  ``index_select`` kernel reads the ``n`` layer extents (``layout.layer_page_bytes`` each)
  over PCIe straight into a device staging buffer (``LOAD_STAGING_BYTES`` at most; larger
  batches go in chunks), and two ``index_put_`` kernels scatter K and V into the token slots.
  No host work per page. The role of SGLang HiCache's ``kernel``
  I/O backend (``transfer_kv_per_layer``, ``pool_host/mha.py``), with torch kernels.
- ``runs``: the pool is pinned but kernels may not read it: one ``non_blocking`` H2D copy per
  contiguous DRAM extent of the layer (:func:`layer_runs`) into the staging buffer (DMA by the
  copy engine), then the same GPU scatter. A page-major pool has one extent per page and layer,
  so this is one copy call per page (HiCache's ``direct`` backend).
- ``host``: no CUDA, or the pool stayed pageable: :func:`hiradix.dataplane.layout.load_layer`
  (a host gather, then one copy; the CPU path).

Every copy is enqueued on the current stream, which the layer-wise loader makes its side
stream, so a load of layer i+1 overlaps the forward of layer i (``hiradix.dataplane.layerwise``).
HBM -> DRAM stores of a pinned pool (:func:`store_pages_async`) gather on the device and copy
each contiguous run of destination pages down with one ``non_blocking`` D2H copy.
Data movement only: page ids come from the core's ledger.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Optional

import torch

from hiradix.dataplane import layout as kv_layout
from hiradix.dataplane.layout import KVLayout

logger = logging.getLogger(__name__)

LOAD_PATHS = ("gather", "runs", "host")
# Device staging of one DRAM -> HBM layer copy, at most (bytes): a larger batch is copied in
# chunks of pages, so a load never holds more than this much device memory outside SGLang's pool.
LOAD_STAGING_BYTES = 64 << 20
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}  # integer views, widest first


def choose_load_path(cuda: bool, pinned: bool, host_pointer_ok: Optional[bool]) -> tuple[str, str]:
    """Which DRAM -> HBM path to use, and why (for the log).

    Args:
        cuda: the device pool is on a CUDA device.
        pinned: the DRAM pool is registered with CUDA (``DramPool.cuda_pinned``).
        host_pointer_ok: the device may read registered memory at its host address
            (``hiradix.tiers.pinned.host_pointer_usable_on_device``); None = unknown.

    Returns:
        ``(path, reason)``, path one of :data:`LOAD_PATHS`.
    """
    if not cuda:
        return "host", "no CUDA device: the CPU path"
    if not pinned:
        return "host", "DRAM tier is pageable (registration failed): host gather, synchronous copies"
    if host_pointer_ok:
        return "gather", "DRAM tier pinned and mapped: GPU gather over PCIe"
    return "runs", "DRAM tier pinned but not usable from kernels: one DMA copy per contiguous extent"


def contiguous_runs(page_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ascending ids, in the order given.

    Returns:
        ``(index, first_id, length)`` per run: ``page_ids[index:index+length]`` is
        ``first_id, first_id+1, ...``. ``[]`` for no ids.
    """
    runs: list[tuple[int, int, int]] = []
    for i, page_id in enumerate(page_ids):
        page_id = int(page_id)
        if runs:
            index, first, length = runs[-1]
            if first + length == page_id:
                runs[-1] = (index, first, length + 1)
                continue
        runs.append((i, page_id, 1))
    return runs


def layer_runs(page_ids: Sequence[int], layout: KVLayout) -> list[tuple[int, int, int]]:
    """Runs of ``page_ids`` whose extents of ONE layer are contiguous in the DRAM pool.

    Layer-major pools (and one-layer pools): consecutive ids are adjacent. Page-major pools
    with more than one layer: layer ``l`` of page ``p+1`` is ``page_bytes`` after that of page
    ``p``, so every page is its own run.

    Returns:
        ``(index, first_id, length)`` as :func:`contiguous_runs`.
    """
    if layout.page_major and layout.num_layers > 1:
        return [(i, int(p), 1) for i, p in enumerate(page_ids)]
    return contiguous_runs(page_ids)


def word_dtype(layout: KVLayout) -> torch.dtype:
    """The widest integer type whose size divides a token row (``H * D * itemsize`` bytes) and
    every plane's columns and offset in it (MLA: ``kv_lora_rank`` and ``qk_rope_head_dim``).

    Copies move words of this type: never float values (bit patterns, NaNs included, move
    untouched) and as few elements as the rows allow (8-byte loads over PCIe on the gather path).
    """
    item = layout.dtype.itemsize
    sizes = [layout.row_elements * item] + [n * item for _, first, width in layout.planes for n in (first, width)]
    return next(dtype for size, dtype in _WORDS.items() if all(b % size == 0 for b in sizes))


def _words(t: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A tensor whose last dimension is whole token rows, viewed as ``word_dtype(layout)``."""
    return t.view(torch.uint8).view(word_dtype(layout))


def _layer_rows(pool: torch.Tensor, layer: int, layout: KVLayout) -> torch.Tensor:
    """Layer ``layer`` of every page of a pool tensor ``layout.dram_shape(N)``, as ``(N, E)`` words."""
    pages = _words(kv_layout._dram_pages(pool, layout), layout)  # (N, L, E) or (L, N, E)
    return pages[:, layer] if layout.page_major else pages[layer]


class LayerLoad:
    """The per-layer DRAM -> HBM copies of one batch of promotions (one plan, every layer).

    Args:
        dram_tensor: the DRAM pool, CPU tensor ``layout.dram_shape(N)``; pinned for ``runs``.
        page_ids: ``n`` DRAM page ids, in token order.
        token_slots: int64 ``(n * page_size,)`` destination token slots (distinct), on the
            device pool's device.
        layout: the pool layout.
        path: ``"gather"`` or ``"runs"`` (``"host"`` is ``layout.load_layer``).
        source: ``gather`` only: the pool as a device tensor of the same shape (:func:`mapped_view`).

    Raises:
        ValueError: an unknown path, a slot count that does not match, or ``gather`` without source.
    """

    def __init__(self, dram_tensor: torch.Tensor, page_ids: Sequence[int] | torch.Tensor, token_slots: torch.Tensor,
                 layout: KVLayout, path: str, source: Optional[torch.Tensor] = None):
        if path not in ("gather", "runs"):
            raise ValueError(f"LayerLoad path must be 'gather' or 'runs', got {path!r}")
        if path == "gather" and source is None:
            raise ValueError("the gather path needs the pool's device mapping (source)")
        kv_layout._check_dram(dram_tensor, layout)
        ids = kv_layout._page_ids_tensor(page_ids)
        self.num_pages = ids.numel()
        kv_layout._check_slots(token_slots, self.num_pages, layout)
        self.layout, self.path = layout, path
        self.device = token_slots.device
        self._pool = dram_tensor if source is None else source
        self._slots = token_slots.to(dtype=torch.int64).reshape(self.num_pages, layout.page_size)
        self._ids = _to_device(ids, self.device) if path == "gather" else None
        step = max(1, LOAD_STAGING_BYTES // layout.layer_page_bytes)
        self._chunks = [(a, min(a + step, self.num_pages)) for a in range(0, self.num_pages, step)]
        page_list = ids.tolist()
        self._runs = [layer_runs(page_list[a:b], layout) if path == "runs" else [] for a, b in self._chunks]
        self._staging: Optional[torch.Tensor] = None  # made at the first copy, on the copying stream

    @property
    def copies_per_layer(self) -> int:
        """Copy calls per layer: H2D copies for ``runs``, gather kernels (one per chunk) for ``gather``."""
        return sum(map(len, self._runs)) if self.path == "runs" else len(self._chunks)

    def copy_layer(self, layer: int, k_buffer: torch.Tensor, v_buffer: Optional[torch.Tensor]) -> None:
        """Enqueue layer ``layer`` on the current stream: gather into staging, scatter into K/V.

        Args:
            layer: layer index in ``[0, layout.num_layers)``.
            k_buffer: ``(pool_rows, H, D)`` of ``layout.dtype`` (``MHATokenToKVPool.k_buffer[layer]``,
                or ``MLATokenToKVPool.kv_buffer[layer]``).
            v_buffer: same for V; None for MLA.
        """
        layout = self.layout
        if not 0 <= layer < layout.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {layout.num_layers})")
        if (v_buffer is None) != layout.is_mla:
            raise ValueError("an MLA layout takes one buffer per layer (v_buffer None); MHA takes K and V")
        bufs = (k_buffer,) if v_buffer is None else (k_buffer, v_buffer)
        for what, buf in zip(("k_buffer", "v_buffer"), bufs):
            kv_layout._check_device_buffer(buf, layout, what)
        src = _layer_rows(self._pool, layer, layout)  # (N, E) words
        if self._staging is None:
            rows = self._chunks[0][1] if self._chunks else 0
            self._staging = torch.empty((rows, src.shape[1]), dtype=src.dtype, device=self.device)
        for (a, b), runs in zip(self._chunks, self._runs):
            staging = self._staging[: b - a]
            if self.path == "gather":
                torch.index_select(src, 0, self._ids[a:b], out=staging)
            else:
                for index, first, length in runs:
                    staging[index : index + length].copy_(src[first : first + length], non_blocking=True)
            self._scatter(staging, self._slots[a:b], bufs)

    def _scatter(self, staging: torch.Tensor, slots: torch.Tensor, bufs: Sequence[torch.Tensor]) -> None:
        """Each plane of the staged pages into its token slots (one ``index_put_`` kernel per
        plane: K then V, or MLA's ``ckv`` then ``kpe`` columns of the latent rows)."""
        layout = self.layout
        scale = layout.dtype.itemsize / word_dtype(layout).itemsize  # elements -> words
        offset = 0
        for index, first, width in layout.planes:
            w0, w = int(first * scale), int(width * scale)
            part = staging[:, offset : offset + layout.page_size * w].view(staging.shape[0], layout.page_size, w)
            rows = _words(kv_layout._rows(bufs[index]), layout)
            (rows if w == rows.shape[1] else rows[:, w0 : w0 + w]).index_put_((slots,), part)
            offset += layout.page_size * w


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small CPU tensor on ``device`` without a host stall: through pinned memory, ``non_blocking``.

    A plain ``.to(device)`` of pageable memory synchronizes the current stream, i.e. waits for the
    forward queued on it; the pinned copy only orders after it.
    """
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def mapped_view(dram_tensor: torch.Tensor, device: torch.device) -> tuple[Optional[torch.Tensor], str]:
    """The pinned DRAM pool as a CUDA tensor over the same host memory (zero-copy, UVA).

    Built from the pool's address through ``__cuda_array_interface__`` (torch checks with
    ``cudaPointerGetAttributes`` that the memory is registered), then probed: a pattern written
    on the host at both ends of the pool must read back through a kernel (the bytes are
    restored). Only kernels may read the view (``index_select`` does); a ``cudaMemcpy`` from it
    would name host memory as device memory.

    Args:
        dram_tensor: the DRAM pool tensor, registered with ``cudaHostRegister``.
        device: the CUDA device whose kernels will read it.

    Returns:
        ``(view, reason)``: the view (same shape and dtype) or None, and why not.
    """
    nbytes = dram_tensor.numel() * dram_tensor.element_size()
    try:
        raw = torch.as_tensor(_HostArray(dram_tensor.data_ptr(), nbytes), device=device)
        if raw.device.type != "cuda" or raw.data_ptr() != dram_tensor.data_ptr():
            return None, f"torch made a {raw.device} tensor at {raw.data_ptr():#x}, not a view of the pool"
        reason = _probe(dram_tensor.view(-1).view(torch.uint8), raw)
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"
    if reason is not None:
        return None, reason
    return raw.view(dram_tensor.dtype).view(dram_tensor.shape), "ok"


class _HostArray:
    """A registered host range described by ``__cuda_array_interface__`` (v3), bytes, no stream."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3, "stream": None}


def _probe(host: torch.Tensor, device_view: torch.Tensor, probe_bytes: int = 4096) -> Optional[str]:
    """Write a pattern at both ends of ``host`` and read it through ``device_view``; restore it."""
    size = min(probe_bytes, host.numel())
    spans = [(0, size), (host.numel() - size, host.numel())]
    saved = [host[a:b].clone() for a, b in spans]
    try:
        for a, b in spans:
            host[a:b].copy_(torch.arange(a, b, dtype=torch.int64).remainder(251).to(torch.uint8))
        for a, b in spans:
            # a conversion kernel reads the mapping (a cudaMemcpy of a host pointer named as device
            # memory would be undefined); its output is ordinary device memory
            got = device_view[a:b].to(torch.int32).cpu().to(torch.uint8)
            if not torch.equal(got, host[a:b]):
                return f"the device read other bytes than the host wrote at offset {a}"
        return None
    finally:
        for (a, b), old in zip(spans, saved):
            host[a:b].copy_(old)


def store_pages_async(k_buffers: Sequence[torch.Tensor], v_buffers: Optional[Sequence[torch.Tensor]], token_slots: torch.Tensor,
                      dram_tensor: torch.Tensor, page_ids: Sequence[int] | torch.Tensor, layout: KVLayout) -> int:
    """HBM -> pinned DRAM without blocking the host: device gather, one D2H copy per run.

    Same contract as :func:`hiradix.dataplane.layout.store_pages` (page ``page_ids[i]`` of every
    layer receives the tokens at ``token_slots[i*ps:(i+1)*ps]``), but every copy is enqueued on
    the current stream with ``non_blocking=True``: the DRAM pages hold the data once the stream
    reaches that point (record an event after this call). Page-major: a run of consecutive page
    ids is one contiguous extent of all layers, so it moves in one copy; layer-major: one copy
    per run and layer. Staging is at most ``STAGING_BYTES_MAX`` bytes per chunk.

    Returns:
        The number of D2H copy calls made.

    Raises:
        ValueError: as ``store_pages`` (shapes, dtypes, repeated page ids).
    """
    kv_layout._check_store_args(k_buffers, v_buffers, token_slots, dram_tensor, page_ids, layout)
    ids = kv_layout._page_ids_tensor(page_ids).tolist()
    slots = token_slots.to(device=k_buffers[0].device, dtype=torch.int64)
    dram = _words(kv_layout._dram_pages(dram_tensor, layout), layout)  # (N, L, E) or (L, N, E) words
    chunk_pages = max(1, kv_layout.STAGING_BYTES_MAX // layout.page_bytes)
    copies = 0
    for start in range(0, len(ids), chunk_pages):
        stop = min(start + chunk_pages, len(ids))
        chunk_slots = slots[start * layout.page_size : stop * layout.page_size]
        staging = kv_layout._gather_device(k_buffers, v_buffers, chunk_slots, layout)
        staging = _words(staging, layout)  # (c, L, E) or (L, c, E) words
        for index, first, length in contiguous_runs(ids[start:stop]):
            if layout.page_major:
                dram[first : first + length].copy_(staging[index : index + length], non_blocking=True)
                copies += 1
                continue
            for layer in range(layout.num_layers):
                dram[layer, first : first + length].copy_(staging[layer, index : index + length], non_blocking=True)
                copies += 1
    return copies


def copy_token_rows(kv_pool: object, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy the KV rows of device token slots ``src_slots`` to ``dst_slots`` in every layer of
    SGLang's pool (K and V, or MLA's one latent buffer): a partial page's copy-on-write."""
    if hasattr(kv_pool, "k_buffer"):
        buffers = list(kv_pool.k_buffer) + list(kv_pool.v_buffer)
    else:
        buffers = list(kv_pool.kv_buffer)
    src = src_slots.to(device=buffers[0].device, dtype=torch.int64)
    dst = dst_slots.to(device=buffers[0].device, dtype=torch.int64)
    for buf in buffers:
        buf[dst] = buf[src]
