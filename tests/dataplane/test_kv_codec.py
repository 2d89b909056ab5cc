"""KV page codec (hiradix/dataplane/kv_codec.py): round trips within derived error bounds, headers, sizes."""

from __future__ import annotations

import pytest
import torch

from hiradix.dataplane.kv_codec import (
    FORMAT_IDS,
    FORMATS,
    HEADER_BYTES,
    FormatMismatch,
    PageCodec,
    format_bytes_per_token,
)
from hiradix.dataplane.layout import KVLayout

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
NUM_PAGES = 3


def gqa(dtype: torch.dtype) -> KVLayout:
    return KVLayout(num_layers=2, page_size=16, num_kv_heads=2, head_dim=64, dtype=dtype)


def mla(dtype: torch.dtype) -> KVLayout:
    return KVLayout(num_layers=2, page_size=16, num_kv_heads=1, head_dim=32 + 16, dtype=dtype, rope_dim=16)


LAYOUTS = (gqa, mla)


def make_pages(layout: KVLayout, seed: int = 0) -> torch.Tensor:
    """uint8 [NUM_PAGES, page_bytes] of KV-like values: per-channel magnitudes (outlier channels, as
    KIVI observes for keys) times N(0, 1), plus a per-channel offset; values in a few units."""
    gen = torch.Generator().manual_seed(seed)
    elements = layout.layer_page_elements
    channel_scale = torch.exp(torch.randn(elements, generator=gen))
    x = torch.randn(NUM_PAGES, layout.num_layers, elements, generator=gen) * channel_scale
    x += 0.5 * torch.randn(elements, generator=gen)
    return x.to(layout.dtype).view(torch.uint8).reshape(NUM_PAGES, layout.page_bytes)


def planes(x: torch.Tensor, layout: KVLayout) -> list[tuple[torch.Tensor, bool]]:
    """Each plane of x [n, L, E] as [n, L, ps, G, W] with its KIVI grouping (True: per channel)."""
    ps, out, offset = layout.page_size, [], 0
    for index, (_, _, width) in enumerate(layout.planes):
        g, w = (1, width) if layout.is_mla else (layout.num_kv_heads, layout.head_dim)
        per_channel = index == (1 if layout.is_mla else 0)  # K / kpe per channel; V / ckv per token
        out.append((x[:, :, offset: offset + ps * width].reshape(x.shape[0], x.shape[1], ps, g, w), per_channel))
        offset += ps * width
    return out


def round_trip(layout: KVLayout, fmt: str, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, decoded) as float32 [n, L, E]."""
    codec = PageCodec(layout, fmt)
    encoded = codec.encode_pages(pages)
    assert encoded.shape == (pages.shape[0], codec.encoded_bytes)
    out = torch.empty_like(pages)
    codec.decode_pages(encoded, out)
    as_float = lambda p: p.view(layout.dtype).float().view(p.shape[0], layout.num_layers, -1)  # noqa: E731
    return as_float(pages), as_float(out)


@pytest.mark.parametrize("make_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_is_bitwise(make_layout, dtype):
    layout = make_layout(dtype)
    pages = torch.randint(0, 256, (NUM_PAGES, layout.page_bytes), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(1))  # any bits, NaN patterns included
    codec = PageCodec(layout, "exact")
    encoded = codec.encode_pages(pages)
    assert torch.equal(encoded[:, HEADER_BYTES: HEADER_BYTES + layout.page_bytes], pages)
    out = torch.zeros_like(pages)
    codec.decode_pages(encoded, out)
    assert torch.equal(out, pages)


@pytest.mark.parametrize("make_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_error_within_e4m3_bound(make_layout, dtype):
    layout = make_layout(dtype)
    x, y = round_trip(layout, "fp8", make_pages(layout))
    u = UNIT_ROUNDOFF[dtype]
    for (xp, _), (yp, _) in zip(planes(x, layout), planes(y, layout)):
        # s = amax / 448 per (page, layer, plane, head). e4m3 keeps 3 mantissa bits: half an ulp is
        # <= 2^-4 |x/s| for normals, and the subnormal step is 2^-9, so |q - x/s| <= 2^-4 |x/s| + 2^-10.
        # Decoding rounds q*s to the source dtype (u |x'|); fp32 arithmetic adds ~2^-23 |x|.
        s = xp.abs().amax(dim=(2, 4), keepdim=True) / 448.0
        bound = (2.0**-4 + 2.0**-22) * xp.abs() + 2.0**-10 * s + u * yp.abs() + torch.finfo(dtype).tiny
        err = (xp - yp).abs()
        assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
        # and the bound is not vacuous: the error is a few percent of |x| on average, not zero
        assert 0 < (err.sum() / xp.abs().sum()).item() < 2.0**-4


@pytest.mark.parametrize("make_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_error_within_group_bound(make_layout, dtype):
    layout = make_layout(dtype)
    x, y = round_trip(layout, "int4", make_pages(layout))
    u = UNIT_ROUNDOFF[dtype]
    for (xp, per_channel), (yp, _) in zip(planes(x, layout), planes(y, layout)):
        dims = (2,) if per_channel else (4,)  # keys: over the page's tokens; values: over head_dim (<= 64)
        lo, hi = xp.amin(dim=dims, keepdim=True), xp.amax(dim=dims, keepdim=True)
        # scale = (max - min) / 15; the codec stores the zero rounded down to fp16 (<= 2^-11 |min|
        # below min) and the scale rounded up to fp16 (relative 2^-10), so no code clips.
        scale = ((hi - lo) + 2.0**-11 * lo.abs()) / 15.0 * (1 + 2.0**-10)
        bound = scale / 2 + u * yp.abs() + 2.0**-20 * torch.maximum(lo.abs(), hi.abs())
        err = (xp - yp).abs()
        assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
        assert (err > scale / 8).any()  # the bound is reached in order of magnitude, not vacuous


@pytest.mark.parametrize("make_layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_batched_equals_per_page(make_layout, fmt):
    layout = make_layout(torch.bfloat16)
    pages = make_pages(layout, seed=3)
    codec = PageCodec(layout, fmt)
    batch = codec.encode_pages(pages)
    singles = torch.stack([codec.encode(pages[i]) for i in range(NUM_PAGES)])
    assert torch.equal(batch, singles)
    assert torch.equal(codec.encode_pages(pages), batch)  # deterministic, padding included
    out_batch, out_single = torch.empty_like(pages), torch.empty_like(pages)
    codec.decode_pages(batch, out_batch)
    for i in range(NUM_PAGES):
        codec.decode(batch[i], out_single[i])
    assert torch.equal(out_batch, out_single)


def test_decode_of_another_format_raises_and_writes_nothing():
    layout = gqa(torch.bfloat16)
    pages = make_pages(layout)
    fp8, int4 = PageCodec(layout, "fp8"), PageCodec(layout, "int4")
    encoded = fp8.encode_pages(pages)
    out = torch.zeros_like(pages)
    with pytest.raises(FormatMismatch, match="fp8"):
        int4.decode_pages(encoded, out)
    assert not out.any()
    # the same bytes cut to int4's size still carry fp8's header
    with pytest.raises(FormatMismatch):
        int4.decode(encoded[0, : int4.encoded_bytes].clone(), out[0])


@pytest.mark.parametrize("other", [
    KVLayout(3, 16, 2, 64, torch.bfloat16),  # layers
    KVLayout(2, 16, 2, 64, torch.float16),  # dtype: same page size
    KVLayout(2, 16, 4, 32, torch.bfloat16),  # heads x dim: same page size
    KVLayout(2, 16, 1, 128, torch.bfloat16, rope_dim=64),  # MLA of the same page size
])
def test_decode_of_another_layout_raises(other):
    layout = gqa(torch.bfloat16)
    mine = PageCodec(layout, "fp8")
    encoded = PageCodec(other, "fp8").encode_pages(make_pages(other))
    with pytest.raises(FormatMismatch):
        mine.decode_pages(encoded[:, : mine.encoded_bytes].clone(), torch.empty(NUM_PAGES, layout.page_bytes,
                                                                                dtype=torch.uint8))


def test_decode_of_garbage_or_one_bad_page_raises():
    layout = gqa(torch.float32)
    codec = PageCodec(layout, "int4")
    encoded = codec.encode_pages(make_pages(layout))
    encoded[2, 5] ^= 1  # format id of the last page flipped
    with pytest.raises(FormatMismatch, match="page 2"):
        codec.decode_pages(encoded, torch.empty(NUM_PAGES, layout.page_bytes, dtype=torch.uint8))
    with pytest.raises(FormatMismatch, match="no KV page header"):
        codec.decode(torch.zeros(codec.encoded_bytes, dtype=torch.uint8),
                     torch.empty(layout.page_bytes, dtype=torch.uint8))


def expected_encoded_bytes(layout: KVLayout, fmt: str) -> int:
    """The documented sizes, written out: header 32 B, payload, padded to 8 B."""
    ps, n_layers, elements = layout.page_size, layout.num_layers, layout.num_layers * layout.layer_page_elements
    if layout.is_mla:
        lora, rope = layout.head_dim - layout.rope_dim, layout.rope_dim
        fp8_scales, int4_groups = 2, ps * max(1, lora // 64) + rope  # ckv per token (<= 64 wide), kpe per channel
    else:
        h, d = layout.num_kv_heads, layout.head_dim
        fp8_scales, int4_groups = 2 * h, h * d + ps * h * max(1, d // 64)  # K per channel, V per token
    payload = {"exact": layout.page_bytes, "fp8": 4 * fp8_scales * n_layers + elements,
               "int4": 4 * int4_groups * n_layers + (elements + 1) // 2}[fmt]
    return -(-(HEADER_BYTES + payload) // 8) * 8


@pytest.mark.parametrize("make_layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_encoded_bytes_as_documented(make_layout, dtype, fmt):
    layout = make_layout(dtype)
    codec = PageCodec(layout, fmt)
    assert codec.encoded_bytes == expected_encoded_bytes(layout, fmt)
    assert format_bytes_per_token(layout, fmt) == codec.encoded_bytes / layout.page_size
    ratio = layout.page_bytes / codec.encoded_bytes
    wide = dtype == torch.float32
    low, high = {"exact": (0.98, 1.0), "fp8": (3.8, 4.0) if wide else (1.9, 2.0),
                 "int4": (5.5, 8.0) if wide else (2.75, 4.0)}[fmt]
    assert low <= ratio <= high, ratio


def test_gqa_bf16_sizes_spelled_out():
    # page = 2 layers x [2, 16, 2, 64] bf16 = 16,384 B
    layout = gqa(torch.bfloat16)
    assert layout.page_bytes == 16384
    assert PageCodec(layout, "exact").encoded_bytes == 32 + 16384
    assert PageCodec(layout, "fp8").encoded_bytes == 32 + 4 * 8 + 8192  # 8 fp32 scales (2 L x K,V x 2 heads)
    assert PageCodec(layout, "int4").encoded_bytes == 32 + 4 * 2 * (128 + 32) + 4096  # K 128 + V 32 groups/layer


def test_refuses_unknown_format_and_quantized_pools():
    with pytest.raises(ValueError, match="supported: exact, fp8, int4"):
        PageCodec(gqa(torch.bfloat16), "zip")
    for dtype in (torch.uint8, torch.float8_e4m3fn):
        with pytest.raises(ValueError, match="float32/bfloat16/float16"):
            PageCodec(KVLayout(2, 16, 2, 64, dtype), "fp8")
    assert set(FORMAT_IDS) == set(FORMATS) and len(set(FORMAT_IDS.values())) == len(FORMATS)


def test_int4_refuses_values_beyond_fp16_range():
    layout = gqa(torch.float32)
    x = torch.zeros(1, layout.page_bytes // 4)
    x[0, 7] = 1e6
    with pytest.raises(ValueError, match="fp16 range"):
        PageCodec(layout, "int4").encode_pages(x.view(torch.uint8))
    PageCodec(layout, "fp8").encode_pages(x.view(torch.uint8))  # fp8 scales are fp32: fine


def test_wrong_page_shape_raises():
    codec = PageCodec(gqa(torch.bfloat16), "fp8")
    with pytest.raises(ValueError, match="uint8"):
        codec.encode_pages(torch.zeros(2, 100, dtype=torch.uint8))


def test_e4m3_bit_decode_equals_torch_cast():
    from hiradix.dataplane.kv_codec import E4M3_IN_FP16_SCALE, _e4m3_as_fp16_bits

    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8).view(1, -1)
    expected = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(_e4m3_as_fp16_bits(codes).float() * E4M3_IN_FP16_SCALE, expected)  # subnormals, -0 included


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_chunked_batches_equal_one_chunk(fmt):
    layout = mla(torch.float16)
    pages = make_pages(layout, seed=5)
    whole, chunked = PageCodec(layout, fmt), PageCodec(layout, fmt)
    assert whole.chunk_pages >= NUM_PAGES
    chunked.chunk_pages = 2  # chunks [0, 2) and [2, 3)
    encoded = whole.encode_pages(pages)
    assert torch.equal(chunked.encode_pages(pages), encoded)
    a, b = torch.empty_like(pages), torch.empty_like(pages)
    whole.decode_pages(encoded, a)
    chunked.decode_pages(encoded, b)
    assert torch.equal(a, b)


def test_int4_small_pages_work_but_cost_more_than_fp8():
    from hiradix.dataplane.kv_codec import INT4_MIN_PAGE_SIZE

    # ps = 4: a key group is 4 values + 4 bytes of scale/zero = 12 bits per key, worse than fp8
    small = KVLayout(2, 4, 2, 64, torch.bfloat16)
    assert PageCodec(small, "int4").encoded_bytes > PageCodec(small, "fp8").encoded_bytes
    x, y = round_trip(small, "int4", make_pages(small))
    assert ((x - y).norm() / x.norm()).item() < 0.1
    at_min = KVLayout(2, INT4_MIN_PAGE_SIZE, 2, 64, torch.bfloat16)
    assert PageCodec(at_min, "int4").encoded_bytes < PageCodec(at_min, "fp8").encoded_bytes
