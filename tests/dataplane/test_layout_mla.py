"""MLA pages (issue 18, item 1): one latent row per token and layer, no K/V split, byte-exact.

SGLang's ``MLATokenToKVPool`` holds ``(rows, 1, kv_lora_rank + qk_rope_head_dim)`` per layer.
Off the device a layer page is FlashInfer's paged MLA pair: ``ckv [ps, kv_lora_rank]`` rows,
then ``kpe [ps, qk_rope_head_dim]`` rows. Sizes here are not powers of two (rank 40, rope 12:
row 52) so every word-size choice is exercised; data are random bit patterns (NaNs included).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hiradix.dataplane import device_copy
from hiradix.dataplane.layout import KVLayout, device_buffers, load_layer, load_pages, store_pages
from hiradix.persistence.fingerprint import is_store_writer, kv_fingerprint, store_key_prefix
from hiradix.tiers.dram import DramPool

LAYERS, PS, LORA, ROPE = 3, 16, 40, 12
ROWS = 12 * PS


def mla_layout(dtype=torch.bfloat16, page_major=True, lora=LORA, rope=ROPE) -> KVLayout:
    return KVLayout(LAYERS, PS, 1, lora + rope, dtype, page_major, rope_dim=rope)


def latent_buffers(layout: KVLayout, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    item = layout.dtype.itemsize
    shape = (ROWS, 1, layout.head_dim * item)
    return [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(layout.dtype) for _ in range(LAYERS)]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def slots_of(pages: list[int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.cat([p * PS + torch.randperm(PS, generator=gen) for p in pages]).to(torch.int64)


@pytest.fixture(params=[(torch.bfloat16, True), (torch.float16, False), (torch.float32, True), (torch.uint8, False)],
                ids=["bf16-page_major", "fp16-layer_major", "fp32-page_major", "fp8-layer_major"])
def layout(request) -> KVLayout:
    dtype, page_major = request.param
    return mla_layout(dtype, page_major)


@pytest.fixture
def pool(tmp_path, layout):
    pool = DramPool.create(layout, 6, tmp_path / "dram")
    yield pool
    pool.close()
    pool.unlink()


def test_mla_sizes_and_planes():
    layout = mla_layout()
    assert layout.is_mla and layout.num_buffers == 1
    assert layout.planes == ((0, 0, 40), (0, 40, 12))  # ckv columns, then kpe columns
    assert layout.layer_page_bytes == 16 * 52 * 2 == 1_664  # one latent row, no factor 2 for V
    assert layout.page_bytes == 3 * 1_664
    assert layout.dram_shape(5) == (5, 3, 16 * 52)
    assert mla_layout(page_major=False).dram_shape(5) == (3, 5, 16 * 52)
    # DeepSeek-V3 per token and layer: 576 elements (512 + 64), 1,152 bytes in bf16, 71x less than
    # per-head K and V of its 128 heads x (192 + 128) elements would take
    v3 = KVLayout(61, 1, 1, 576, torch.bfloat16, rope_dim=64)
    assert v3.layer_page_bytes == 1_152
    assert KVLayout(61, 1, 128, 192, torch.bfloat16).layer_page_bytes // 2 + 128 * 128 * 2 == 81_920
    assert KVLayout.from_json(v3.to_json()) == v3


@pytest.mark.parametrize("bad", [dict(rope_dim=52), dict(rope_dim=-1), dict(num_kv_heads=2)])
def test_invalid_mla_layout_rejected(bad):
    args = dict(num_layers=2, page_size=4, num_kv_heads=1, head_dim=52, dtype=torch.bfloat16, rope_dim=12) | bad
    with pytest.raises(ValueError, match="rope_dim|latent head"):
        KVLayout(**args)


def test_store_writes_ckv_then_kpe_rows(layout, pool):
    kv = latent_buffers(layout, seed=1)
    slots = slots_of([2, 7], seed=2)
    store_pages(kv, None, slots, pool.tensor, [4, 1], layout)
    for i, page in enumerate([4, 1]):
        rows = slots[i * PS : (i + 1) * PS]
        for layer in range(LAYERS):
            got = pool.tensor[page, layer] if layout.page_major else pool.tensor[layer, page]
            src = kv[layer][rows, 0]  # (ps, 52)
            ckv, kpe = got[: PS * LORA].view(PS, LORA), got[PS * LORA :].view(PS, ROPE)
            assert torch.equal(as_bytes(ckv), as_bytes(src[:, :LORA]))
            assert torch.equal(as_bytes(kpe), as_bytes(src[:, LORA:]))


def test_store_load_round_trip_to_other_slots(layout, pool):
    kv = latent_buffers(layout, seed=3)
    src, dst = slots_of([0, 5, 9], seed=4), slots_of([3, 1, 11], seed=5)
    store_pages(kv, None, src, pool.tensor, [0, 2, 5], layout)
    out = [torch.zeros_like(b) for b in kv]
    load_pages(out, None, pool.tensor, [0, 2, 5], dst, layout)
    for layer in range(LAYERS):
        assert torch.equal(as_bytes(out[layer][dst]), as_bytes(kv[layer][src]))
        untouched = torch.ones(ROWS, dtype=torch.bool)
        untouched[dst] = False
        assert int(as_bytes(out[layer][untouched]).count_nonzero()) == 0


def test_load_layer_touches_one_layer(layout, pool):
    kv = latent_buffers(layout, seed=6)
    slots = slots_of([4], seed=7)
    store_pages(kv, None, slots, pool.tensor, [3], layout)
    out = [torch.zeros_like(b) for b in kv]
    load_layer(out[1], None, 1, pool.tensor, [3], slots, layout)
    assert torch.equal(as_bytes(out[1][slots]), as_bytes(kv[1][slots]))
    assert int(as_bytes(out[0]).count_nonzero()) == 0 and int(as_bytes(out[2]).count_nonzero()) == 0


@pytest.mark.parametrize("path", ["gather", "runs"])
def test_layer_load_matches_load_layer(layout, pool, path):
    kv = latent_buffers(layout, seed=8)
    src, dst = slots_of([1, 2, 8], seed=9), slots_of([6, 0, 10], seed=10)
    store_pages(kv, None, src, pool.tensor, [5, 0, 3], layout)
    load = device_copy.LayerLoad(pool.tensor, [5, 0, 3], dst, layout, path, source=pool.tensor)
    out = [torch.zeros_like(b) for b in kv]
    for layer in range(LAYERS):
        load.copy_layer(layer, out[layer], None)
        assert torch.equal(as_bytes(out[layer][dst]), as_bytes(kv[layer][src]))


def test_store_pages_async_matches_store_pages(layout, tmp_path):
    kv = latent_buffers(layout, seed=11)
    slots = slots_of([3, 4, 9], seed=12)
    with DramPool.create(layout, 4, tmp_path / "a") as a, DramPool.create(layout, 4, tmp_path / "b") as b:
        store_pages(kv, None, slots, a.tensor, [2, 3, 0], layout)
        device_copy.store_pages_async(kv, None, slots, b.tensor, [2, 3, 0], layout)
        assert torch.equal(as_bytes(a.tensor), as_bytes(b.tensor))


def test_word_dtype_divides_every_plane():
    # 40 + 12 bf16 columns: 80 and 24 bytes, offset 80: 8-byte words
    assert device_copy.word_dtype(mla_layout()) == torch.int64
    # rank 41 + rope 13 (bf16): 82 and 26 bytes: 2-byte words only
    assert device_copy.word_dtype(mla_layout(lora=41, rope=13)) == torch.int16


def test_mixing_mla_and_mha_buffers_is_refused(layout, pool):
    kv = latent_buffers(layout, seed=13)
    slots = slots_of([0], seed=14)
    with pytest.raises(ValueError, match="MLA layout takes one buffer"):
        store_pages(kv, kv, slots, pool.tensor, [0], layout)
    with pytest.raises(ValueError, match="latent"):
        store_pages(kv[:-1], None, slots, pool.tensor, [0], layout)
    mha = KVLayout(LAYERS, PS, 1, LORA + ROPE, layout.dtype, layout.page_major)
    with pytest.raises(ValueError, match="MHA takes K and V|does not match"):
        store_pages(kv, None, slots, pool.tensor, [0], mha)


def _sglang_like_mla_pool(dtype=torch.bfloat16) -> SimpleNamespace:
    """The attributes of SGLang's MLATokenToKVPool that the layout reads."""
    kv = [torch.zeros((ROWS + PS, 1, LORA + ROPE), dtype=dtype) for _ in range(LAYERS)]
    return SimpleNamespace(kv_buffer=kv, kv_lora_rank=LORA, qk_rope_head_dim=ROPE, layer_num=LAYERS,
                           store_dtype=dtype, dtype=dtype, use_dsa=False, kv_scale_buffer=None)


def test_from_device_pool_reads_an_mla_pool():
    pool = _sglang_like_mla_pool()
    layout = KVLayout.from_device_pool(pool, PS)
    assert layout == mla_layout()
    first, second = device_buffers(pool, layout)
    assert first is pool.kv_buffer and second is None


def test_from_device_pool_refuses_dsa_and_wrong_rows():
    dsa = _sglang_like_mla_pool()
    dsa.use_dsa = True
    with pytest.raises(ValueError, match="DSA"):
        KVLayout.from_device_pool(dsa, PS)
    pool = _sglang_like_mla_pool()
    pool.kv_buffer[1] = torch.zeros((ROWS, 1, LORA), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="layer 1"):
        KVLayout.from_device_pool(pool, PS)


def test_mla_pages_have_their_own_fingerprint_and_store_keys():
    mla = mla_layout()
    mha = KVLayout(LAYERS, PS, 1, LORA + ROPE, torch.bfloat16)  # same bytes per row, other meaning
    assert mla.page_bytes != mha.page_bytes
    fp_mla = kv_fingerprint("m", "bfloat16", mla, 0, 1, 4096)
    assert fp_mla["mla_rope_dim"] == "12" and "mla_rope_dim" not in kv_fingerprint("m", "bfloat16", mha, 0, 1, 4096)
    assert store_key_prefix("m", "bfloat16", mla, 0, 1) != store_key_prefix("m", "bfloat16", mha, 0, 1)


def test_mla_store_keys_have_no_tp_rank_and_one_rank_writes():
    """Every TP rank holds the same latent: one object per page, put by rank 0, read by every rank."""
    mla = mla_layout()
    mha = KVLayout(LAYERS, PS, 2, 64, torch.bfloat16)
    assert store_key_prefix("m", "bfloat16", mla, 0, 2) == store_key_prefix("m", "bfloat16", mla, 1, 2)
    assert store_key_prefix("m", "bfloat16", mla, 0, 2) != store_key_prefix("m", "bfloat16", mla, 0, 4)  # TP size stays
    assert store_key_prefix("m", "bfloat16", mha, 0, 2) != store_key_prefix("m", "bfloat16", mha, 1, 2)
    assert [is_store_writer(mla, r) for r in range(3)] == [True, False, False]
    assert all(is_store_writer(mha, r) for r in range(3))
    # the NVMe tier's fingerprint keeps the rank: each rank has its own directory
    assert kv_fingerprint("m", "bfloat16", mla, 1, 2, 4096)["tp_rank"] == "1"
