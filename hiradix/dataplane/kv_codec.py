"""Compressed copies of KV pages for the lower tiers (NVMe, cluster store, optionally DRAM).

A page is the unit the tiers hold: ``KVLayout.page_bytes`` bytes, ``num_layers`` layer pages in
the default page-major order (:mod:`hiradix.dataplane.layout`). A layer page is its
:attr:`KVLayout.planes`: MHA/GQA ``K [ps, H, D]`` then ``V [ps, H, D]``; MLA ``ckv [ps, kv_lora_rank]``
then ``kpe [ps, rope_dim]``. A :class:`PageCodec` turns such a page into an encoded page of a
fixed size per (layout, format), :attr:`PageCodec.encoded_bytes`, so an NVMe slot or a store
object has one size, and back. Motivation: CacheGen (Liu et al., SIGCOMM '24) shows KV caches
compress several-fold with little quality loss, which makes the slower tiers hold more tokens.

Encoded page (little-endian), ``HEADER_BYTES`` = 32 bytes of header, then the payload::

    0  magic  b"HRKV"           4  version u8        5  format id u8 (FORMAT_IDS)
    6  dtype id u8 (DTYPE_IDS)  7  reserved (0)      8  num_layers u32
    12 page_size u32            16 num_kv_heads u32  20 head_dim u32
    24 rope_dim u32             28 payload bytes u32

Formats (``x`` a source element, ``x'`` its decoded value, ``u`` the unit roundoff of the source
dtype: 2^-24 fp32, 2^-8 bf16, 2^-11 fp16):

- ``exact``: the page bytes unchanged; ``x' == x`` bitwise.
- ``fp8``: e4m3 (``torch.float8_e4m3fn``), one fp32 scale ``s = amax / 448`` per (page, layer,
  KV head) for K and for V separately (MLA: per (page, layer, plane)). Bound:
  ``|x - x'| <= 2^-4 |x| + 2^-10 s`` (half an ulp of e4m3's 3-bit mantissa; ``2^-10 s`` is half
  the subnormal step) plus the source rounding ``u |x'|``. Size: 1 byte per element + scales.
- ``int4``: asymmetric 4-bit groups as in KIVI (Liu et al., ICML 2024, section 3): keys
  quantized per channel (a group is one channel over the page's ``ps`` tokens), values per token
  (a group is one token's ``head_dim`` values of one head, or ``INT4_TOKEN_GROUP_MAX`` of them when
  ``head_dim`` is larger); MLA: ``ckv`` like values, ``kpe`` like keys. Per group a scale and a zero
  (the minimum) in fp16, the zero rounded down and the scale rounded up so no code clips;
  ``q = round((x - zero) / scale)`` in ``[0, 15]``, two codes per byte (even element in the low
  nibble). Bound: ``|x - x'| <= scale / 2`` plus the source rounding ``u |x'|``, with
  ``scale ~= (max - min) / 15`` of the group. Size: 4 bits per element + 4 bytes per group
  (keys' groups are ``ps`` long: at ``ps = 16`` keys cost 6 bits, values 4.5 bits at ``D = 64``,
  3.04x vs 16-bit; 3.55x at ``ps = 64``; below ``INT4_MIN_PAGE_SIZE`` = 8 an int4 page is larger
  than an fp8 one, and at ``ps = 1`` larger than the source: choosing it there is the caller's call).
  ``encode`` raises ``ValueError`` for a page whose values pass fp16's range (|x| > 65504).

Payloads: ``exact`` the page; ``fp8`` fp32 scales ``[L, planes, G]`` (G = KV heads, MLA 1) then
e4m3 codes in the page's element order; ``int4`` fp16 scales of every group, fp16 zeros of every
group (per plane: keys ``[L, H, D]``, values ``[L, ps, H, D / group]``), then the packed codes in
the page's element order. Zero padding follows, so ``encoded_bytes`` is a multiple of 8.
A lossless format (byte planes + zstd/lz4) was measured and not offered: ratio 1.28-1.32 on bf16
KV, 1.07-1.11 on fp32, decode < 0.5 GB/s per core, and variable sizes (``bench/RESULTS.md``,
"KV page codec").

All formats accept source dtypes float32, bfloat16, float16 (SGLang's ``store_dtype``); an fp8 or
uint8 device pool is refused. Encoding and decoding run on the tensors' device: on the CPU (the I/O
worker; a CPU server's DRAM cold tier) with torch's intra-op threads (``torch.get_num_threads()``), on
CUDA after the copy when DRAM is a cold tier (:mod:`hiradix.dataplane.encoded_mover`), in chunks of
about 1 MiB of source pages, with a loop per plane (two), never per element.
"""

from __future__ import annotations

import struct

import torch

from hiradix.dataplane.layout import KVLayout

FORMATS = ("exact", "fp8", "int4")
FORMAT_IDS = {"exact": 1, "fp8": 2, "int4": 3}
DTYPE_IDS = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
MAGIC = b"HRKV"
VERSION = 1
HEADER_BYTES = 32
_HEADER = struct.Struct("<4sBBBBIIIIII")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT4_LEVELS = 15  # codes 0..15
INT4_MIN_PAGE_SIZE = 8  # below, a key group (one channel over ps tokens) makes int4 pages larger than fp8's
INT4_TOKEN_GROUP_MAX = 64  # values per token group when head_dim (or kv_lora_rank) is larger
CHUNK_SOURCE_BYTES = 1 << 20  # source bytes per vectorized step (see PageCodec.encode_pages)
E4M3_IN_FP16_SCALE = 256.0  # see _e4m3_as_fp16_bits
ENCODED_ALIGN_BYTES = 8  # encoded_bytes is a multiple of this (zero padding after the payload)


class FormatMismatch(ValueError):
    """An encoded page's header names another format, dtype or layout than the decoding codec."""


def format_bytes_per_token(layout: KVLayout, fmt: str) -> float:
    """Encoded bytes per token of one page (all layers), header included: ``encoded_bytes / page_size``.

    Raises:
        ValueError: unknown format or unsupported dtype (see :class:`PageCodec`).
    """
    return PageCodec(layout, fmt).encoded_bytes / layout.page_size


class _Plane:
    """One plane of a layer page seen as ``[ps, G, W]`` (G heads of W columns; MLA: G = 1)."""

    def __init__(self, offset: int, groups: int, width: int, per_channel: bool, token_group: int) -> None:
        self.offset = offset  # first element of the plane in the layer page
        self.groups = groups  # G: KV heads (MHA) or 1 (MLA)
        self.width = width  # W: columns per head
        self.per_channel = per_channel  # int4 grouping: keys/kpe per channel, values/ckv per token
        self.token_group = token_group  # int4 values per token group (divides W)


class PageCodec:
    """Encode and decode KV pages of one layout in one format; fixed encoded size.

    Args:
        layout: the pool layout (only its shape and dtype matter; the page is page-major order).
        fmt: one of :data:`FORMATS`.

    Raises:
        ValueError: unknown format, or a dtype other than float32/bfloat16/float16 (fp8 or uint8
            pools are already compressed and must use another path).
    """

    def __init__(self, layout: KVLayout, fmt: str) -> None:
        if fmt not in FORMAT_IDS:
            raise ValueError(f"unknown KV page format {fmt!r}; supported: {', '.join(FORMATS)}")
        if layout.dtype not in DTYPE_IDS:
            raise ValueError(f"KV page codec needs a float32/bfloat16/float16 pool, got {layout.dtype} "
                             "(an fp8/uint8 store dtype is already quantized)")
        self.layout = layout
        self.fmt = fmt
        self.num_elements = layout.num_layers * layout.layer_page_elements  # per page
        self._planes = _planes(layout)
        self.payload_bytes = self._payload_bytes()
        # fixed per (layout, format); rounded up to 8 bytes so every page's scales stay aligned in a batch
        self.chunk_pages = max(1, CHUNK_SOURCE_BYTES // layout.page_bytes)  # pages per vectorized step
        self.encoded_bytes = -(-(HEADER_BYTES + self.payload_bytes) // ENCODED_ALIGN_BYTES) * ENCODED_ALIGN_BYTES
        self.header = torch.frombuffer(bytearray(_HEADER.pack(
            MAGIC, VERSION, FORMAT_IDS[fmt], DTYPE_IDS[layout.dtype], 0, layout.num_layers, layout.page_size,
            layout.num_kv_heads, layout.head_dim, layout.rope_dim, self.payload_bytes)), dtype=torch.uint8)
        self._headers = {self.header.device: self.header}  # the header per device it was needed on

    # -- sizes -----------------------------------------------------------------------------
    def _num_params(self, per_channel_only: bool | None = None) -> int:
        """Quantization groups per page: fp8 one per (layer, plane, head); int4 per KIVI group."""
        ps, total = self.layout.page_size, 0
        for plane in self._planes:
            if self.fmt == "fp8":
                total += plane.groups
            elif plane.per_channel:
                total += plane.groups * plane.width
            else:
                total += ps * plane.groups * (plane.width // plane.token_group)
        return total * self.layout.num_layers

    def _payload_bytes(self) -> int:
        if self.fmt == "exact":
            return self.layout.page_bytes
        if self.fmt == "fp8":
            return 4 * self._num_params() + self.num_elements
        return 2 * 2 * self._num_params() + (self.num_elements + 1) // 2

    # -- single page -----------------------------------------------------------------------
    def encode(self, page: torch.Tensor) -> torch.Tensor:
        """Encode one page.

        Args:
            page: uint8 ``[page_bytes]`` (contiguous, any device).

        Returns:
            uint8 ``[encoded_bytes]``, a new tensor.

        Raises:
            ValueError: wrong shape/dtype; int4 values outside fp16's range.
        """
        return self.encode_pages(page.view(1, -1) if page.dim() == 1 else page)[0]

    def decode(self, encoded: torch.Tensor, out: torch.Tensor) -> None:
        """Decode one page into ``out`` (uint8 ``[page_bytes]``), in place.

        Raises:
            FormatMismatch: the header is not this codec's (format, dtype or layout).
            ValueError: wrong shape/dtype.
        """
        self.decode_pages(encoded.view(1, -1), out.view(1, -1))

    # -- batches ---------------------------------------------------------------------------
    def encode_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """Encode ``n`` pages: uint8 ``[n, page_bytes]`` -> uint8 ``[n, encoded_bytes]`` (a new tensor).

        Raises:
            ValueError: wrong shape/dtype; int4 values outside fp16's range.
        """
        _check_u8(pages, self.layout.page_bytes, "pages")
        n = pages.shape[0]
        out = torch.empty((n, self.encoded_bytes), dtype=torch.uint8, device=pages.device)
        out[:, :HEADER_BYTES] = self._header_on(pages.device)
        out[:, HEADER_BYTES + self.payload_bytes:] = 0
        payload = out[:, HEADER_BYTES: HEADER_BYTES + self.payload_bytes]
        if self.fmt == "exact":
            payload.copy_(pages)
        else:
            if not pages.is_contiguous() or pages.storage_offset() % self.layout.dtype.itemsize:
                pages = pages.clone()  # torch views a uint8 buffer as fp16/fp32 only when aligned
            x = pages.view(self.layout.dtype).view(n, self.layout.num_layers, -1)
            encode = self._encode_fp8 if self.fmt == "fp8" else self._encode_int4
            for start in range(0, n, self.chunk_pages):  # chunks keep the float32 temporaries in cache
                encode(x[start: start + self.chunk_pages], payload[start: start + self.chunk_pages])
        return out

    def decode_pages(self, encoded: torch.Tensor, out: torch.Tensor) -> None:
        """Decode ``n`` pages: uint8 ``[n, encoded_bytes]`` into uint8 ``[n, page_bytes]`` ``out``, in place.

        Raises:
            FormatMismatch: a header is not this codec's (checked for every page before writing).
            ValueError: wrong shape/dtype, or ``out`` not contiguous.
        """
        self.check_headers(encoded)
        _check_u8(out, self.layout.page_bytes, "out")
        if (encoded.shape[0] != out.shape[0] or not out.is_contiguous() or out.device != encoded.device
                or out.storage_offset() % self.layout.dtype.itemsize):
            raise ValueError(f"decode: {encoded.shape[0]} encoded pages on {encoded.device} into out "
                             f"{tuple(out.shape)} on {out.device} (same device, contiguous and aligned to "
                             f"{self.layout.dtype.itemsize} bytes needed)")
        payload = encoded[:, HEADER_BYTES: HEADER_BYTES + self.payload_bytes]
        if self.fmt == "exact":
            out.copy_(payload)
            return
        y = out.view(self.layout.dtype).view(out.shape[0], self.layout.num_layers, -1)
        decode = self._decode_fp8 if self.fmt == "fp8" else self._decode_int4
        for start in range(0, out.shape[0], self.chunk_pages):
            decode(payload[start: start + self.chunk_pages], y[start: start + self.chunk_pages])

    def check_headers(self, encoded: torch.Tensor) -> None:
        """Raise :class:`FormatMismatch` unless every page of ``encoded`` (uint8 ``[n, bytes]``) has this header."""
        if encoded.dtype != torch.uint8 or encoded.dim() != 2 or encoded.shape[1] < HEADER_BYTES:
            raise FormatMismatch(f"not encoded KV pages: {encoded.dtype} {tuple(encoded.shape)}")
        bad = (encoded[:, :HEADER_BYTES] != self._header_on(encoded.device)).any(dim=1).nonzero()
        if bad.numel():
            raise FormatMismatch(f"page {int(bad[0])}: {describe_header(encoded[int(bad[0])])}; "
                                 f"this codec: {describe_header(self.header)}")
        if encoded.shape[1] != self.encoded_bytes:
            raise FormatMismatch(f"encoded pages of {encoded.shape[1]} bytes, expected {self.encoded_bytes}")

    def _header_on(self, device: torch.device) -> torch.Tensor:
        """This codec's header (uint8 ``[HEADER_BYTES]``) on ``device`` (one copy per device, kept)."""
        if device not in self._headers:
            self._headers[device] = self.header.to(device)
        return self._headers[device]

    # -- fp8 -------------------------------------------------------------------------------
    def _plane_view(self, x: torch.Tensor, plane: _Plane) -> torch.Tensor:
        """``[n, L, ps, G, W]`` view of one plane of ``x`` ``[n, L, E]``."""
        size = self.layout.page_size * plane.groups * plane.width
        part = x[:, :, plane.offset: plane.offset + size]
        return part.unflatten(2, (self.layout.page_size, plane.groups, plane.width))

    def _encode_fp8(self, x: torch.Tensor, payload: torch.Tensor) -> None:
        n = x.shape[0]
        scales = payload[:, : 4 * self._num_params()].view(torch.float32).view(n, self.layout.num_layers, -1)
        codes = payload[:, 4 * self._num_params():].view(torch.float8_e4m3fn).view(n, self.layout.num_layers, -1)
        first = 0
        for plane in self._planes:
            v = self._plane_view(x, plane).float()  # [n, L, ps, G, W]
            amax = v.abs().amax(dim=(2, 4))  # [n, L, G]
            scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
            scales[:, :, first: first + plane.groups] = scale
            q = (v / scale[:, :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            self._plane_view(codes, plane).copy_(q)
            first += plane.groups

    def _decode_fp8(self, payload: torch.Tensor, y: torch.Tensor) -> None:
        n = y.shape[0]
        scales = payload[:, : 4 * self._num_params()].clone().view(torch.float32).view(n, self.layout.num_layers, -1)
        codes = _e4m3_as_fp16_bits(payload[:, 4 * self._num_params():]).view(n, self.layout.num_layers, -1)
        first = 0
        for plane in self._planes:
            scale = scales[:, :, first: first + plane.groups] * E4M3_IN_FP16_SCALE  # exact: a power of two
            v = self._plane_view(codes, plane).float() * scale[:, :, None, :, None]
            self._plane_view(y, plane).copy_(v)
            first += plane.groups

    # -- int4 ------------------------------------------------------------------------------
    def _groups(self, v: torch.Tensor, plane: _Plane) -> torch.Tensor:
        """Plane values ``[n, L, ps, G, W]`` with each KIVI group on the last dim."""
        if plane.per_channel:  # [n, L, G, W, ps]
            return v.permute(0, 1, 3, 4, 2)
        return v.unflatten(4, (plane.width // plane.token_group, plane.token_group))  # [n, L, ps, G, W/g, g]

    def _ungroup(self, g: torch.Tensor, plane: _Plane) -> torch.Tensor:
        """Inverse of :meth:`_groups` (a view)."""
        return g.permute(0, 1, 4, 2, 3) if plane.per_channel else g.flatten(4)

    def _encode_int4(self, x: torch.Tensor, payload: torch.Tensor) -> None:
        n, num_params = x.shape[0], self._num_params()
        params = payload[:, : 4 * num_params].view(torch.float16).view(n, 2, -1)  # [n, scale|zero, groups]
        codes = torch.empty((n, self.layout.num_layers, self.layout.layer_page_elements), dtype=torch.uint8,
                            device=x.device)
        first = 0
        for plane in self._planes:
            g = self._groups(self._plane_view(x, plane).float(), plane)
            lo, hi = g.amin(dim=-1), g.amax(dim=-1)
            zero = _fp16_round(lo, down=True)
            scale = _fp16_round((hi - zero.float()) / INT4_LEVELS, down=False)
            if not (torch.isfinite(zero).all() and torch.isfinite(scale).all()):
                raise ValueError("int4 KV page codec: a value outside the fp16 range (|x| > 65504)")
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            q = ((g - zero.float()[..., None]) / scale.float()[..., None]).round_().clamp_(0, INT4_LEVELS)
            self._plane_view(codes, plane).copy_(self._ungroup(q, plane))
            count = scale.numel() // n
            params[:, 0, first: first + count] = scale.reshape(n, -1)
            params[:, 1, first: first + count] = zero.reshape(n, -1)
            first += count
        _pack_nibbles(codes.view(n, -1), payload[:, 4 * num_params:])

    def _decode_int4(self, payload: torch.Tensor, y: torch.Tensor) -> None:
        n, num_params = y.shape[0], self._num_params()
        params = payload[:, : 4 * num_params].clone().view(torch.float16).view(n, 2, -1).float()
        codes = _unpack_nibbles(payload[:, 4 * num_params:], self.num_elements).view(n, self.layout.num_layers, -1)
        first = 0
        for plane in self._planes:
            g = self._groups(self._plane_view(codes, plane), plane)
            count = g[0].numel() // g.shape[-1]
            scale = params[:, 0, first: first + count].reshape(g.shape[:-1])
            zero = params[:, 1, first: first + count].reshape(g.shape[:-1])
            v = g.float() * scale[..., None] + zero[..., None]
            self._plane_view(y, plane).copy_(self._ungroup(v, plane))
            first += count


def describe_header(encoded: torch.Tensor) -> str:
    """Human-readable header of one encoded page (uint8 ``[>= HEADER_BYTES]``), for error messages."""
    raw = bytes(encoded[:HEADER_BYTES].tolist())
    if len(raw) < HEADER_BYTES or raw[:4] != MAGIC:
        return f"no KV page header (first bytes {raw[:8]!r})"
    _, version, fmt_id, dtype_id, _, layers, ps, heads, dim, rope, payload = _HEADER.unpack(raw)
    fmt = {v: k for k, v in FORMAT_IDS.items()}.get(fmt_id, f"format#{fmt_id}")
    dtype = {v: k for k, v in DTYPE_IDS.items()}.get(dtype_id, f"dtype#{dtype_id}")
    return (f"v{version} {fmt} {dtype} L={layers} ps={ps} H={heads} D={dim} rope={rope} "
            f"payload={payload} B")


def _planes(layout: KVLayout) -> tuple[_Plane, ...]:
    """The planes of a layer page with their int4 grouping (keys/kpe per channel, values/ckv per token)."""
    planes, offset = [], 0
    for index, (_, _, width) in enumerate(layout.planes):
        groups, w = (1, width) if layout.is_mla else (layout.num_kv_heads, layout.head_dim)
        per_channel = (index == 1) if layout.is_mla else (index == 0)
        planes.append(_Plane(offset, groups, w, per_channel, _token_group(w)))
        offset += layout.page_size * width
    return tuple(planes)


def _token_group(width: int) -> int:
    """Values per token group: the whole width up to 64, else the largest of 64/32 dividing it."""
    if width <= INT4_TOKEN_GROUP_MAX:
        return width
    for size in (INT4_TOKEN_GROUP_MAX, INT4_TOKEN_GROUP_MAX // 2):
        if width % size == 0:
            return size
    return width


def _fp16_round(x: torch.Tensor, down: bool) -> torch.Tensor:
    """``x`` (float32) in fp16, rounded toward -inf (``down``) or +inf; inf where out of range."""
    h = x.to(torch.float16)
    wrong = h.float() > x if down else h.float() < x
    if wrong.any():
        toward = torch.full_like(h, float("-inf") if down else float("inf"))
        h = torch.where(wrong, torch.nextafter(h, toward), h)
    return h


def _e4m3_as_fp16_bits(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (uint8 ``[n, m]``) as float16 ``[n, m]`` equal to ``code / E4M3_IN_FP16_SCALE``, exactly.

    The code's 4 exponent and 3 mantissa bits go to fp16's exponent and mantissa positions (the
    sign to bit 15): fp16 then reads ``2^(e-15) 1.m`` (subnormals ``2^-14 0.m``) where e4m3 reads
    ``2^(e-7) 1.m`` (``2^-6 0.m``), a factor 2^8 in both cases. 2x faster than torch's fp8 -> fp32
    cast on the CPU (torch 2.13). e4m3fn's NaN codes (0x7F, 0xFF) read as +-480; encode never
    writes them (it clamps to +-448).
    """
    shifted = codes.to(torch.int16) << 7  # code in bits 14..7, its sign in bit 14
    return (shifted + (shifted & 0x4000)).view(torch.float16)  # sign bit 14 -> 15


def _pack_nibbles(codes: torch.Tensor, out: torch.Tensor) -> None:
    """uint8 codes ``[n, m]`` (values 0..15) -> ``out`` ``[n, ceil(m/2)]``: even index low nibble."""
    n, m = codes.shape
    if m % 2:
        codes = torch.cat([codes, codes.new_zeros(n, 1)], dim=1)
    pairs = codes.view(n, -1, 2)
    out.copy_(pairs[:, :, 0] | (pairs[:, :, 1] << 4))


def _unpack_nibbles(packed: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of :func:`_pack_nibbles`: uint8 ``[n, m]`` codes."""
    n = packed.shape[0]
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=2).view(n, -1)
    return codes[:, :m]


def _check_u8(t: torch.Tensor, row_bytes: int, name: str) -> None:
    if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] != row_bytes:
        raise ValueError(f"{name}: expected uint8 [n, {row_bytes}], got {t.device} {t.dtype} {tuple(t.shape)}")
