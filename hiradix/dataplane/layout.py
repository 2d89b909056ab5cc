"""Paged KV layout of the DRAM and NVMe tiers, and the copies between it and SGLang's device pool.

SGLang 0.5.23's ``MHATokenToKVPool`` (``sglang/srt/mem_cache/memory_pool.py``) keeps, per
layer, ``k_buffer[l]`` and ``v_buffer[l]`` of shape ``(pool_rows, H, D)`` indexed by token
slot (NHD). Off the device a page of one layer is FlashInfer's paged NHD block
``[2, page_size, H, D]`` (K then V), ``layer_page_bytes`` bytes; a page of all layers is
``num_layers`` such blocks, ``page_bytes`` bytes.

MLA models (``MLATokenToKVPool``, same file) keep one latent row per token and layer,
``kv_buffer[l]`` of shape ``(pool_rows, 1, kv_lora_rank + qk_rope_head_dim)`` (the compressed
KV, then the decoupled RoPE key), and no V. Off the device a page of one layer is FlashInfer's
paged MLA pair (``BatchMLAPagedAttentionWrapper``): ``ckv [page_size, kv_lora_rank]`` then
``kpe [page_size, qk_rope_head_dim]``, so a GPU load can hand both parts to its kernels as they
are. Each part of a layer page is a *plane* (:attr:`KVLayout.planes`): a block of ``page_size``
rows taken from columns of one device buffer. The outer order of the DRAM pool is:

- page-major ``(num_pages, L, 2, ps, H, D)``: a page (all layers) is one contiguous extent, so
  it goes to an NVMe slot as one write; one layer of a page is still one contiguous extent.
- layer-major ``(L, num_pages, 2, ps, H, D)``: layer ``l`` of all pages is contiguous
  (SGLang HiCache's ``layer_first``); a page is ``L`` extents ``layer_page_bytes`` apart.

Page-major is the default because it is as fast for the layer-wise load (one layer of a page is
one extent in both orders) and faster for the all-layer store and the NVMe path (a page goes to
its slot as one extent, no gather); ``bench/micro/layout_order.py`` measures it, the figures are in
``bench/RESULTS.md`` ("KV layout order").

Data movement only: these functions copy bytes and keep no books; which page ids are free is
:class:`hiradix.core.allocator.PageAllocator`'s business.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

# Upper bound of the device staging buffer used by ``store_pages`` (bytes). Bigger batches are
# copied in chunks, so a store never needs more than this much free device memory. 16 MiB stays
# under glibc's largest mmap threshold (32 MiB), so on the CPU the buffer is reused from the heap
# instead of being mapped and page-faulted afresh each chunk (measured 2x faster than 256 MiB).
STAGING_BYTES_MAX = 16 << 20


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache as the DRAM and NVMe tiers hold it (one tensor-parallel rank).

    Attributes:
        num_layers: attention layers held by this rank's pool (``L``).
        page_size: tokens per page (``ps``), SGLang's ``--page-size``.
        num_kv_heads: KV heads on this rank (``H``; ``head_num`` of the device pool); 1 for MLA.
        head_dim: elements per head (``D``); K and V must have the same head dim. MLA: the
            latent row, ``kv_lora_rank + qk_rope_head_dim``.
        dtype: element type as stored (SGLang's ``store_dtype``, e.g. ``torch.uint8`` for fp8).
        page_major: outer order of DRAM/NVMe pages; see the module docstring.
        rope_dim: MLA only (``qk_rope_head_dim``, > 0): the latent row's last ``rope_dim``
            columns are the RoPE key (``kpe``); 0 for per-head K/V (MHA, GQA, MQA).

    Raises:
        ValueError: a non-positive size, a ``dtype`` that is not a ``torch.dtype``, or an MLA
            ``rope_dim`` that leaves no latent column (or with more than one head).
    """

    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    page_major: bool = True
    rope_dim: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "page_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVLayout.dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.rope_dim, int) or not 0 <= self.rope_dim < self.head_dim:
            raise ValueError(f"KVLayout.rope_dim must be in [0, head_dim={self.head_dim}), got {self.rope_dim!r}")
        if self.rope_dim and self.num_kv_heads != 1:
            raise ValueError(f"an MLA layout (rope_dim > 0) has one latent head, got num_kv_heads={self.num_kv_heads}")

    @property
    def is_mla(self) -> bool:
        """One latent row per token and layer (``MLATokenToKVPool``), no separate V."""
        return self.rope_dim > 0

    @property
    def num_buffers(self) -> int:
        """Device buffers per layer: 2 (``k_buffer``, ``v_buffer``) or 1 for MLA (``kv_buffer``)."""
        return 1 if self.is_mla else 2

    @property
    def row_elements(self) -> int:
        """Elements of one token's row in one device buffer (``H * D``)."""
        return self.num_kv_heads * self.head_dim

    @property
    def planes(self) -> tuple[tuple[int, int, int], ...]:
        """The parts of one layer page, in order: ``(buffer, first column, columns)`` per plane.

        A plane is ``page_size`` rows of those columns of device buffer ``buffer`` of the layer.
        MHA: ``((0, 0, H*D), (1, 0, H*D))`` (K, then V). MLA: ``((0, 0, kv_lora_rank),
        (0, kv_lora_rank, rope_dim))`` (``ckv``, then ``kpe``).
        """
        row = self.row_elements
        if self.is_mla:
            return ((0, 0, row - self.rope_dim), (0, row - self.rope_dim, self.rope_dim))
        return ((0, 0, row), (1, 0, row))

    @property
    def layer_page_elements(self) -> int:
        """Elements of one page of one layer (every plane)."""
        return self.page_size * sum(width for _, _, width in self.planes)

    @property
    def layer_page_bytes(self) -> int:
        """Bytes of one page of one layer: ``[2, page_size, H, D]``, or MLA's ``ckv`` + ``kpe``."""
        return self.layer_page_elements * self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of all layers (``num_layers * layer_page_bytes``)."""
        return self.num_layers * self.layer_page_bytes

    @property
    def layer_page_shape(self) -> tuple[int, ...]:
        """Shape of one page of one layer: ``(2, page_size, H, D)``; MLA ``(page_size * row,)``
        (``ckv`` rows, then ``kpe`` rows: the planes differ in width)."""
        if self.is_mla:
            return (self.layer_page_elements,)
        return (2, self.page_size, self.num_kv_heads, self.head_dim)

    def dram_shape(self, num_pages: int) -> tuple[int, ...]:
        """Shape of a DRAM pool of ``num_pages`` pages.

        Returns:
            ``(num_pages, L, *layer_page_shape)`` when page-major (MHA: ``(num_pages, L, 2,
            ps, H, D)``), ``(L, num_pages, *layer_page_shape)`` when layer-major.
        """
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if self.page_major:
            return (num_pages, self.num_layers, *self.layer_page_shape)
        return (self.num_layers, num_pages, *self.layer_page_shape)

    def to_json(self) -> dict[str, Any]:
        """Plain dict (JSON/msgpack-safe) for the I/O worker's spawn arguments; dtype as ``"bfloat16"``."""
        return {
            "num_layers": self.num_layers,
            "page_size": self.page_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "page_major": self.page_major,
            "rope_dim": self.rope_dim,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> KVLayout:
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: unknown dtype name or a missing/invalid field.
        """
        dtype = getattr(torch, str(d["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown torch dtype {d['dtype']!r}")
        return cls(
            num_layers=int(d["num_layers"]),
            page_size=int(d["page_size"]),
            num_kv_heads=int(d["num_kv_heads"]),
            head_dim=int(d["head_dim"]),
            dtype=dtype,
            page_major=bool(d.get("page_major", True)),
            rope_dim=int(d.get("rope_dim", 0)),
        )

    @classmethod
    def from_device_pool(cls, kv_pool: Any, page_size: int, page_major: bool = True) -> KVLayout:
        """Layout of SGLang's ``MHATokenToKVPool`` (``memory_pool.py``, NHD buffers).

        Reads ``k_buffer`` (list of ``(pool_rows, H, D)`` per local layer), ``head_num``,
        ``head_dim``, ``v_head_dim``, ``store_dtype`` (falls back to ``dtype``), ``layer_num``.

        An MLA pool (``MLATokenToKVPool``: ``kv_buffer``, ``kv_lora_rank``, ``qk_rope_head_dim``)
        gives one latent head of ``kv_lora_rank + qk_rope_head_dim`` and ``rope_dim``.

        Raises:
            ValueError: the pool is neither a plain NHD MHA pool nor a plain MLA pool (HND or 5-D
                layout, K and V head dims differ, buffer shapes disagree with ``head_num`` /
                ``head_dim``, DSA's packed fp8 latent).
        """
        if getattr(kv_pool, "kv_buffer", None) is not None and getattr(kv_pool, "kv_lora_rank", None):
            return _mla_layout(kv_pool, int(page_size), page_major)
        k_buffers = getattr(kv_pool, "k_buffer", None)
        v_buffers = getattr(kv_pool, "v_buffer", None)
        if not k_buffers or not v_buffers:
            raise ValueError(f"{type(kv_pool).__name__} has no per-layer k_buffer/v_buffer (MHA only)")
        head_num, head_dim = int(kv_pool.head_num), int(kv_pool.head_dim)
        v_head_dim = int(getattr(kv_pool, "v_head_dim", head_dim) or head_dim)
        if v_head_dim != head_dim:
            raise ValueError(f"K head_dim {head_dim} != V head_dim {v_head_dim}: not supported")
        if getattr(kv_pool, "use_hnd", False):
            raise ValueError("HND device layout (SGLANG_USE_HND_KVCACHE) is not supported; use NHD")
        expected = (head_num, head_dim)
        for layer, (k, v) in enumerate(zip(k_buffers, v_buffers)):
            if k.dim() != 3 or tuple(k.shape[1:]) != expected or k.shape != v.shape:
                raise ValueError(
                    f"layer {layer}: k {tuple(k.shape)} / v {tuple(v.shape)} are not "
                    f"(rows, {head_num}, {head_dim}) NHD buffers"
                )
        num_layers = len(k_buffers)
        layer_num = int(getattr(kv_pool, "layer_num", num_layers))
        if layer_num != num_layers:
            raise ValueError(f"layer_num {layer_num} != len(k_buffer) {num_layers}")
        dtype = getattr(kv_pool, "store_dtype", None) or kv_pool.dtype
        if k_buffers[0].dtype != dtype:
            raise ValueError(f"buffer dtype {k_buffers[0].dtype} != store_dtype {dtype}")
        return cls(num_layers, int(page_size), head_num, head_dim, dtype, page_major)


def _mla_layout(kv_pool: Any, page_size: int, page_major: bool) -> KVLayout:
    """Layout of SGLang's ``MLATokenToKVPool``: ``(rows, 1, kv_lora_rank + qk_rope_head_dim)`` per layer."""
    buffers = kv_pool.kv_buffer
    lora, rope = int(kv_pool.kv_lora_rank), int(kv_pool.qk_rope_head_dim)
    if getattr(kv_pool, "use_dsa", False) or getattr(kv_pool, "kv_scale_buffer", None) is not None:
        raise ValueError("a DSA (sparse-attention) or scaled fp4/fp8 MLA pool is not supported")
    if rope <= 0:
        raise ValueError(f"qk_rope_head_dim {rope}: an MLA pool without a RoPE part is not supported")
    for layer, buf in enumerate(buffers):
        if buf.dim() != 3 or tuple(buf.shape[1:]) != (1, lora + rope):
            raise ValueError(f"layer {layer}: kv_buffer {tuple(buf.shape)} is not (rows, 1, {lora} + {rope})")
    layer_num = int(getattr(kv_pool, "layer_num", len(buffers)))
    if layer_num != len(buffers):
        raise ValueError(f"layer_num {layer_num} != len(kv_buffer) {len(buffers)}")
    dtype = getattr(kv_pool, "store_dtype", None) or kv_pool.dtype
    if buffers[0].dtype != dtype:
        raise ValueError(f"buffer dtype {buffers[0].dtype} != store_dtype {dtype}")
    return KVLayout(len(buffers), page_size, 1, lora + rope, dtype, page_major, rope_dim=rope)


def device_buffers(kv_pool: Any, layout: KVLayout) -> tuple[list[torch.Tensor], Optional[list[torch.Tensor]]]:
    """The per-layer device buffers of SGLang's pool as ``(first, second)``: ``(k_buffer,
    v_buffer)``, or ``(kv_buffer, None)`` for MLA (the arguments of the copies below)."""
    if layout.is_mla:
        return kv_pool.kv_buffer, None
    return kv_pool.k_buffer, kv_pool.v_buffer


def _check_dram(dram_tensor: torch.Tensor, layout: KVLayout) -> int:
    """Validate a DRAM pool tensor against ``layout``; returns its number of pages."""
    ndim = 2 + len(layout.layer_page_shape)
    num_pages = dram_tensor.shape[0 if layout.page_major else 1] if dram_tensor.dim() == ndim else -1
    if tuple(dram_tensor.shape) != layout.dram_shape(max(num_pages, 0)) or dram_tensor.dtype != layout.dtype:
        raise ValueError(
            f"DRAM tensor {tuple(dram_tensor.shape)} {dram_tensor.dtype} does not match "
            f"layout {layout.dram_shape(max(num_pages, 0))} {layout.dtype}"
        )
    if dram_tensor.device.type != "cpu":
        raise ValueError(f"DRAM tensor must be on the CPU, got {dram_tensor.device}")
    return num_pages


def _page_ids_tensor(page_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Page ids as a CPU int64 tensor of shape ``(n,)``."""
    return torch.as_tensor(page_ids, dtype=torch.int64, device="cpu").reshape(-1)


def _check_slots(token_slots: torch.Tensor, num_pages: int, layout: KVLayout) -> None:
    if token_slots.dim() != 1 or token_slots.numel() != num_pages * layout.page_size:
        raise ValueError(
            f"token_slots must have shape ({num_pages} pages * {layout.page_size},), "
            f"got {tuple(token_slots.shape)}"
        )


def _check_device_buffer(buf: torch.Tensor, layout: KVLayout, what: str) -> None:
    if buf.dim() != 3 or tuple(buf.shape[1:]) != (layout.num_kv_heads, layout.head_dim) or buf.dtype != layout.dtype:
        raise ValueError(
            f"{what} {tuple(buf.shape)} {buf.dtype} is not (rows, {layout.num_kv_heads}, "
            f"{layout.head_dim}) {layout.dtype}"
        )


def store_pages(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Optional[Sequence[torch.Tensor]],
    token_slots: torch.Tensor,
    dram_tensor: torch.Tensor,
    page_ids: Sequence[int] | torch.Tensor,
    layout: KVLayout,
) -> None:
    """Copy ``n`` pages of all layers from the device pool into DRAM pages (HBM -> DRAM).

    Page ``page_ids[i]`` of every layer receives the tokens at
    ``token_slots[i*ps:(i+1)*ps]``. The device rows are gathered into a device staging
    buffer in the DRAM order, moved to the host in one copy per chunk (at most
    ``STAGING_BYTES_MAX`` bytes), and scattered into ``dram_tensor`` with ``index_copy_``; when
    the device pool is host memory (CPU) each layer's rows are scattered into DRAM directly.
    Synchronous: the DRAM pages hold the data when it returns. Mirrors HiCache's
    ``backup_from_device_all_layer`` (``pool_host/mha.py``, ``pool_host/mla.py``) for the
    ``direct`` I/O backend.

    Args:
        k_buffers: ``L`` tensors ``(pool_rows, H, D)``, dtype ``layout.dtype`` (SGLang's
            ``MHATokenToKVPool.k_buffer``, or ``MLATokenToKVPool.kv_buffer``), on any device.
        v_buffers: same for V; None for MLA (:func:`device_buffers`).
        token_slots: int64 ``(n * page_size,)``, token slot ids into the device buffers.
        dram_tensor: CPU tensor of shape ``layout.dram_shape(num_pages)``.
        page_ids: ``n`` DRAM page ids (distinct).
        layout: the pool layout.

    Raises:
        ValueError: a shape, dtype or length mismatch, or repeated page ids.
        IndexError: a page id or token slot out of range.
    """
    ids = _check_store_args(k_buffers, v_buffers, token_slots, dram_tensor, page_ids, layout)
    num_pages = ids.numel()
    device = k_buffers[0].device
    slots = token_slots.to(device=device, dtype=torch.int64)
    dram = _dram_pages(dram_tensor, layout)
    if device.type == "cpu":  # no device staging: gather each layer's rows and scatter them into DRAM
        _store_pages_from_host(k_buffers, v_buffers, slots, dram, ids, layout)
        return
    chunk_pages = max(1, STAGING_BYTES_MAX // layout.page_bytes)
    for start in range(0, num_pages, chunk_pages):
        stop = min(start + chunk_pages, num_pages)
        staging = _gather_device(k_buffers, v_buffers, slots[start * layout.page_size : stop * layout.page_size], layout)
        host = staging.to("cpu")  # (c, L, E) or (L, c, E)
        if layout.page_major:
            dram.view(dram.shape[0], -1).index_copy_(0, ids[start:stop], host.view(host.shape[0], -1))
        else:
            for layer in range(layout.num_layers):
                dram[layer].index_copy_(0, ids[start:stop], host[layer])


def layer_buffers(k_buffers: Sequence[torch.Tensor], v_buffers: Optional[Sequence[torch.Tensor]],
                  layer: int) -> tuple[torch.Tensor, ...]:
    """The device buffers of one layer, indexed as :attr:`KVLayout.planes` name them."""
    return (k_buffers[layer],) if v_buffers is None else (k_buffers[layer], v_buffers[layer])


def _check_store_args(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Optional[Sequence[torch.Tensor]],
    token_slots: torch.Tensor,
    dram_tensor: torch.Tensor,
    page_ids: Sequence[int] | torch.Tensor,
    layout: KVLayout,
) -> torch.Tensor:
    """Validate the arguments of an HBM -> DRAM store; returns the page ids as a CPU int64 tensor."""
    _check_dram(dram_tensor, layout)
    ids = _page_ids_tensor(page_ids)
    num_pages = ids.numel()
    _check_slots(token_slots, num_pages, layout)
    if ids.unique().numel() != num_pages:
        raise ValueError(f"page_ids must be distinct, got {ids.tolist()}")
    _check_buffer_lists(k_buffers, v_buffers, layout)
    return ids


def _check_buffer_lists(k_buffers: Sequence[torch.Tensor], v_buffers: Optional[Sequence[torch.Tensor]],
                        layout: KVLayout) -> None:
    if (v_buffers is None) != layout.is_mla:
        raise ValueError("an MLA layout takes one buffer per layer (v_buffers None); MHA takes K and V")
    if v_buffers is None and len(k_buffers) != layout.num_layers:
        raise ValueError(f"expected {layout.num_layers} latent (kv_buffer) buffers, got {len(k_buffers)}")
    if v_buffers is not None and not len(k_buffers) == len(v_buffers) == layout.num_layers:
        raise ValueError(f"expected {layout.num_layers} K and V buffers, got {len(k_buffers)}/{len(v_buffers)}")
    names = ("kv_buffers",) if v_buffers is None else ("k_buffers", "v_buffers")
    for layer in range(layout.num_layers):
        for name, buf in zip(names, layer_buffers(k_buffers, v_buffers, layer)):
            _check_device_buffer(buf, layout, f"{name}[{layer}]")


def _plane_rows(buf: torch.Tensor, first: int, width: int, layout: KVLayout) -> torch.Tensor:
    """Columns ``[first, first + width)`` of a device buffer's ``(rows, H*D)`` view (a view)."""
    rows = _rows(buf)
    return rows if width == layout.row_elements else rows[:, first : first + width]


def _store_pages_from_host(
    k_buffers: Sequence[torch.Tensor], v_buffers: Optional[Sequence[torch.Tensor]], slots: torch.Tensor,
    dram: torch.Tensor, ids: torch.Tensor, layout: KVLayout,
) -> None:
    """HBM -> DRAM when the device pool is host memory (CPU): two copies per byte (the row
    gather, the page scatter) instead of three through a staging buffer.

    ``dram``: ``(N, L, E)`` (page-major) or ``(L, N, E)``, ``E`` the planes of a layer page."""
    for layer in range(layout.num_layers):
        pages = dram[:, layer] if layout.page_major else dram[layer]  # (N, E)
        for cols, rows in _gathered_planes(layer_buffers(k_buffers, v_buffers, layer), slots, layout):
            pages[:, cols].index_copy_(0, ids, rows)


def gather_pages(
    k_buffers: Sequence[torch.Tensor], v_buffers: Optional[Sequence[torch.Tensor]], slots: torch.Tensor,
    layout: KVLayout,
) -> torch.Tensor:
    """The pages at token ``slots`` (int64 ``(c * page_size,)``) of all layers, gathered on the
    buffers' device: ``(c, L, E)`` page-major (``(L, c, E)`` layer-major) of ``layout.dtype``; what
    :func:`store_pages` would write into ``c`` DRAM pages (the encoded DRAM tier encodes it)."""
    return _gather_device(k_buffers, v_buffers, slots.to(device=k_buffers[0].device, dtype=torch.int64), layout)


def _gather_device(
    k_buffers: Sequence[torch.Tensor], v_buffers: Optional[Sequence[torch.Tensor]], slots: torch.Tensor,
    layout: KVLayout,
) -> torch.Tensor:
    """Gather ``c`` pages of all layers on the device, in DRAM order.

    Works on 2-D ``(rows, H*D)`` views: ``index_select`` on them is a row memcpy, while on the
    3-D buffers the CPU kernel is ~200x slower (measured with torch 2.13 CPU).

    Returns:
        ``(c, L, E)`` if page-major else ``(L, c, E)`` (``E``: the planes of a layer page), on
        the buffers' device.
    """
    count = slots.numel() // layout.page_size
    outer = (count, layout.num_layers) if layout.page_major else (layout.num_layers, count)
    staging = torch.empty((*outer, layout.layer_page_elements), dtype=layout.dtype, device=k_buffers[0].device)
    for layer in range(layout.num_layers):
        dst = staging[:, layer] if layout.page_major else staging[layer]  # (c, E)
        for cols, rows in _gathered_planes(layer_buffers(k_buffers, v_buffers, layer), slots, layout):
            dst[:, cols].copy_(rows)
    return staging


def _gathered_planes(bufs: Sequence[torch.Tensor], slots: torch.Tensor, layout: KVLayout):
    """Per plane of one layer: ``(columns of the layer page, rows gathered at slots as (c, size))``."""
    count = slots.numel() // layout.page_size
    offset = 0
    for index, first, width in layout.planes:
        size = layout.page_size * width
        rows = _plane_rows(bufs[index], first, width, layout).index_select(0, slots)
        yield slice(offset, offset + size), rows.view(count, size)
        offset += size


def _rows(buf: torch.Tensor) -> torch.Tensor:
    """``(rows, H, D)`` device buffer as a ``(rows, H*D)`` view (never a copy: loads write to it).

    Raises:
        ValueError: the buffer's rows are not contiguous, so no such view exists.
    """
    try:
        return buf.view(buf.shape[0], -1)
    except RuntimeError as exc:
        raise ValueError(f"device KV buffer {tuple(buf.shape)} strides {buf.stride()} has no (rows, H*D) view") from exc


def _dram_pages(dram_tensor: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """The DRAM pool as ``(N, L, E)`` (page-major) or ``(L, N, E)``, ``E = layer_page_bytes / itemsize``."""
    return dram_tensor.view(*dram_tensor.shape[:2], -1)


def scatter_planes(pages: torch.Tensor, bufs: Sequence[torch.Tensor], slots: torch.Tensor, layout: KVLayout) -> None:
    """Write ``n`` staged layer pages into their token slots of one layer's device buffers.

    Args:
        pages: ``(n, E)`` layer pages (:attr:`KVLayout.planes` in order), on the buffers' device.
        bufs: the layer's device buffers (:func:`layer_buffers`).
        slots: int64 ``(n * page_size,)`` destination token slots.
    """
    count = pages.shape[0]
    offset = 0
    for index, first, width in layout.planes:
        size = layout.page_size * width
        part = pages[:, offset : offset + size].reshape(count * layout.page_size, width)
        _plane_rows(bufs[index], first, width, layout).index_copy_(0, slots, part)
        offset += size


def load_layer(
    k_buffer: torch.Tensor,
    v_buffer: Optional[torch.Tensor],
    layer: int,
    dram_tensor: torch.Tensor,
    page_ids: Sequence[int] | torch.Tensor,
    token_slots: torch.Tensor,
    layout: KVLayout,
) -> None:
    """Copy one layer of ``n`` DRAM pages into the device pool (DRAM -> HBM, layer-wise path).

    DRAM page ``page_ids[i]`` of ``layer`` lands in rows ``token_slots[i*ps:(i+1)*ps]`` of
    ``k_buffer``/``v_buffer``. The ``n`` extents of ``layer_page_bytes`` are gathered on the
    host (``index_select``, into pageable memory), copied to the device once, and scattered
    with ``index_copy_``. Synchronous: on CUDA the host waits for the copy, so this is the path
    of a pageable DRAM pool only; a pinned pool loads through
    :class:`hiradix.dataplane.device_copy.LayerLoad`. Mirrors HiCache's
    ``load_to_device_per_layer`` (``pool_host/mha.py``).

    Args:
        k_buffer: ``(pool_rows, H, D)`` of dtype ``layout.dtype``: ``MHATokenToKVPool.k_buffer[layer]``
            (MLA: ``MLATokenToKVPool.kv_buffer[layer]``).
        v_buffer: same for V; None for MLA.
        layer: layer index in ``[0, layout.num_layers)`` (local to this pool).
        dram_tensor: CPU tensor of shape ``layout.dram_shape(num_pages)``.
        page_ids: ``n`` DRAM page ids.
        token_slots: int64 ``(n * page_size,)`` destination token slots (distinct).
        layout: the pool layout.

    Raises:
        ValueError: a shape, dtype, length or layer mismatch.
        IndexError: a page id or token slot out of range.
    """
    _check_dram(dram_tensor, layout)
    if not 0 <= layer < layout.num_layers:
        raise ValueError(f"layer {layer} out of range [0, {layout.num_layers})")
    if (v_buffer is None) != layout.is_mla:
        raise ValueError("an MLA layout takes one buffer per layer (v_buffer None); MHA takes K and V")
    bufs = (k_buffer,) if v_buffer is None else (k_buffer, v_buffer)
    for index, buf in enumerate(bufs):
        _check_device_buffer(buf, layout, ("k_buffer", "v_buffer")[index])
    ids = _page_ids_tensor(page_ids)
    _check_slots(token_slots, ids.numel(), layout)
    dram = _dram_pages(dram_tensor, layout)
    src = dram[:, layer] if layout.page_major else dram[layer]  # (N, E), rows of layer_page_bytes
    pages = src.index_select(0, ids).to(k_buffer.device)  # (n, E)
    scatter_planes(pages, bufs, token_slots.to(device=k_buffer.device, dtype=torch.int64), layout)


def load_pages(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Optional[Sequence[torch.Tensor]],
    dram_tensor: torch.Tensor,
    page_ids: Sequence[int] | torch.Tensor,
    token_slots: torch.Tensor,
    layout: KVLayout,
) -> None:
    """Copy ``n`` DRAM pages of all layers into the device pool: :func:`load_layer` per layer.

    Args:
        k_buffers: ``L`` tensors ``(pool_rows, H, D)`` (``MHATokenToKVPool.k_buffer``, or MLA's ``kv_buffer``).
        v_buffers: same for V; None for MLA.
        dram_tensor: CPU tensor of shape ``layout.dram_shape(num_pages)``.
        page_ids: ``n`` DRAM page ids.
        token_slots: int64 ``(n * page_size,)`` destination token slots.
        layout: the pool layout.

    Raises:
        ValueError: a shape, dtype or length mismatch (see :func:`load_layer`).
    """
    _check_buffer_lists(k_buffers, v_buffers, layout)
    for layer in range(layout.num_layers):
        load_layer(k_buffers[layer], None if v_buffers is None else v_buffers[layer], layer, dram_tensor,
                   page_ids, token_slots, layout)
