"""KVLayout sizes and the HBM <-> DRAM copies, byte-exact, in both DRAM orders.

Shapes are chosen so no size is a power of two (head_dim 72, 3 KV heads): a page of one layer
is 2 * 16 * 3 * 72 * 2 = 13,824 bytes. Data are random bit patterns (NaNs included), so the
checks compare bits, not values.
"""

from __future__ import annotations

import pytest
import torch

from hiradix.dataplane.layout import KVLayout, load_layer, load_pages, store_pages
from hiradix.tiers.dram import DramPool

NUM_LAYERS, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM = 3, 16, 3, 72
POOL_ROWS = 20 * PAGE_SIZE


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same memory as int16 (both test dtypes are 2 bytes), so NaN payloads compare exactly."""
    return t.view(torch.int16)


def random_buffers(layout: KVLayout, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer (POOL_ROWS, H, D) K and V buffers filled with random bit patterns."""
    gen = torch.Generator().manual_seed(seed)

    def one() -> torch.Tensor:
        raw = torch.randint(-(2**15), 2**15, (POOL_ROWS, layout.num_kv_heads, layout.head_dim), dtype=torch.int16, generator=gen)
        return raw.view(layout.dtype)

    return [one() for _ in range(layout.num_layers)], [one() for _ in range(layout.num_layers)]


def zero_buffers(layout: KVLayout) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    shape = (POOL_ROWS, layout.num_kv_heads, layout.head_dim)
    return (
        [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)],
        [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)],
    )


def scattered_slots(device_pages: list[int], seed: int) -> torch.Tensor:
    """Token slots of the given device pages, each page's slots in a shuffled order (non-contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    groups = [p * PAGE_SIZE + torch.randperm(PAGE_SIZE, generator=gen) for p in device_pages]
    return torch.cat(groups).to(torch.int64)


@pytest.fixture(params=[torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture(params=[True, False], ids=["page_major", "layer_major"])
def layout(request, dtype) -> KVLayout:
    return KVLayout(NUM_LAYERS, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype, page_major=request.param)


@pytest.fixture
def pool(tmp_path, layout):
    pool = DramPool.create(layout, 8, tmp_path / "dram")
    yield pool
    pool.close()
    pool.unlink()


def test_sizes_are_flashinfer_nhd_pages():
    layout = KVLayout(NUM_LAYERS, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16)
    assert layout.layer_page_bytes == 2 * 16 * 3 * 72 * 2 == 13_824
    assert layout.page_bytes == 3 * 13_824 == 41_472
    assert layout.dram_shape(5) == (5, 3, 2, 16, 3, 72)
    layer_major = KVLayout(NUM_LAYERS, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, page_major=False)
    assert layer_major.dram_shape(5) == (3, 5, 2, 16, 3, 72)
    assert KVLayout(2, 1, 1, 64, torch.uint8).page_bytes == 2 * 2 * 64  # fp8 stored as uint8


@pytest.mark.parametrize("dtype_", [torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn])
@pytest.mark.parametrize("page_major", [True, False])
def test_json_round_trip(dtype_, page_major):
    layout = KVLayout(4, 16, 3, 72, dtype_, page_major)
    d = layout.to_json()
    assert d["dtype"] == str(dtype_).removeprefix("torch.")
    assert KVLayout.from_json(d) == layout


@pytest.mark.parametrize(
    "bad",
    [{"num_layers": 0}, {"page_size": -1}, {"head_dim": 7.5}, {"dtype": "float16"}],
)
def test_invalid_layout_rejected(bad):
    args = dict(num_layers=2, page_size=16, num_kv_heads=3, head_dim=72, dtype=torch.float16) | bad
    with pytest.raises(ValueError):
        KVLayout(**args)


def test_from_json_rejects_unknown_dtype():
    d = KVLayout(2, 16, 3, 72, torch.float16).to_json() | {"dtype": "float17"}
    with pytest.raises(ValueError, match="float17"):
        KVLayout.from_json(d)


def test_store_writes_flashinfer_pages(layout, pool):
    k, v = random_buffers(layout, seed=1)
    page_ids = [6, 0, 3]
    slots = scattered_slots([4, 11, 2], seed=2)
    store_pages(k, v, slots, pool.tensor, page_ids, layout)
    for i, page in enumerate(page_ids):
        rows = slots[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]
        for layer in range(layout.num_layers):
            block = pool.tensor[page, layer] if layout.page_major else pool.tensor[layer, page]
            assert torch.equal(bits(block[0]), bits(k[layer][rows])), (page, layer, "K")
            assert torch.equal(bits(block[1]), bits(v[layer][rows])), (page, layer, "V")
    # Pages not named stay untouched (zero-filled by the pool's fallocate).
    untouched = [p for p in range(8) if p not in page_ids]
    idx = torch.tensor(untouched)
    rest = pool.tensor[idx] if layout.page_major else pool.tensor[:, idx]
    assert not bits(rest).any()


def test_store_load_round_trip_to_other_slots(layout, pool):
    k, v = random_buffers(layout, seed=3)
    page_ids = [1, 7, 4, 5]
    src_slots = scattered_slots([3, 9, 14, 1], seed=4)
    store_pages(k, v, src_slots, pool.tensor, page_ids, layout)
    k2, v2 = zero_buffers(layout)
    dst_slots = scattered_slots([12, 2, 6, 18], seed=5)
    load_pages(k2, v2, pool.tensor, page_ids, dst_slots, layout)
    others = torch.ones(POOL_ROWS, dtype=torch.bool)
    others[dst_slots] = False
    for layer in range(layout.num_layers):
        assert torch.equal(bits(k2[layer][dst_slots]), bits(k[layer][src_slots])), layer
        assert torch.equal(bits(v2[layer][dst_slots]), bits(v[layer][src_slots])), layer
        assert not bits(k2[layer][others]).any() and not bits(v2[layer][others]).any(), layer


def test_load_layer_touches_one_layer(layout, pool):
    k, v = random_buffers(layout, seed=6)
    slots = scattered_slots([5, 8], seed=7)
    store_pages(k, v, slots, pool.tensor, [2, 3], layout)
    k2, v2 = zero_buffers(layout)
    load_layer(k2[1], v2[1], 1, pool.tensor, [3, 2], slots, layout)  # pages swapped on the way back
    half = PAGE_SIZE
    assert torch.equal(bits(k2[1][slots[:half]]), bits(k[1][slots[half:]]))
    assert torch.equal(bits(v2[1][slots[half:]]), bits(v[1][slots[:half]]))
    for layer in (0, 2):
        assert not bits(k2[layer]).any() and not bits(v2[layer]).any()


def test_store_larger_than_staging_chunk(monkeypatch, layout, tmp_path):
    """Batches above STAGING_BYTES_MAX are copied in chunks; the result must not change."""
    monkeypatch.setattr("hiradix.dataplane.layout.STAGING_BYTES_MAX", layout.page_bytes * 2 - 1)  # 1 page per chunk
    k, v = random_buffers(layout, seed=8)
    slots = scattered_slots([0, 3, 7, 10, 19], seed=9)
    with DramPool.create(layout, 5, tmp_path / "d") as pool:
        store_pages(k, v, slots, pool.tensor, [4, 2, 0, 1, 3], layout)
        k2, v2 = zero_buffers(layout)
        load_pages(k2, v2, pool.tensor, [4, 2, 0, 1, 3], slots, layout)
        for layer in range(layout.num_layers):
            assert torch.equal(bits(k2[layer][slots]), bits(k[layer][slots]))
            assert torch.equal(bits(v2[layer][slots]), bits(v[layer][slots]))


def test_bad_arguments_raise(layout, pool):
    k, v = random_buffers(layout, seed=10)
    slots = scattered_slots([1, 2], seed=11)
    with pytest.raises(ValueError, match="token_slots"):
        store_pages(k, v, slots[:-1], pool.tensor, [0, 1], layout)
    with pytest.raises(ValueError, match="distinct"):
        store_pages(k, v, slots, pool.tensor, [1, 1], layout)
    with pytest.raises(ValueError, match="K and V buffers"):
        store_pages(k[:-1], v[:-1], slots, pool.tensor, [0, 1], layout)
    with pytest.raises(ValueError, match="layer"):
        load_layer(k[0], v[0], layout.num_layers, pool.tensor, [0, 1], slots, layout)
    with pytest.raises(ValueError, match="does not match"):
        store_pages(k, v, slots, pool.tensor.flatten(), [0, 1], layout)
    wrong = [t.float() for t in k]
    with pytest.raises(ValueError, match="k_buffers"):
        store_pages(wrong, v, slots, pool.tensor, [0, 1], layout)
    assert not bits(pool.tensor).any()  # nothing was written by the failed calls


def test_from_device_pool_reads_sglang_pool():
    """A real SGLang MHATokenToKVPool on the CPU: layout read from it, and a round trip through
    its fused K/V buffers (``k_buffer[l]`` and ``v_buffer[l]`` are halves of one allocation)."""
    memory_pool = pytest.importorskip("sglang.srt.mem_cache.memory_pool")
    kv_pool = memory_pool.MHATokenToKVPool(
        size=4 * PAGE_SIZE, page_size=PAGE_SIZE, dtype=torch.bfloat16, head_num=NUM_KV_HEADS,
        head_dim=HEAD_DIM, layer_num=2, device="cpu", enable_memory_saver=False,
    )
    layout = KVLayout.from_device_pool(kv_pool, PAGE_SIZE)
    assert layout == KVLayout(2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, page_major=True)
    gen = torch.Generator().manual_seed(12)
    for buf in (*kv_pool.k_buffer, *kv_pool.v_buffer):
        buf.copy_(torch.randn(buf.shape, generator=gen).bfloat16())
    expected_k = [buf.clone() for buf in kv_pool.k_buffer]
    expected_v = [buf.clone() for buf in kv_pool.v_buffer]
    slots = torch.arange(PAGE_SIZE, 3 * PAGE_SIZE)  # device pages 1 and 2 (page 0 is padding)
    dram = torch.zeros(layout.dram_shape(2), dtype=layout.dtype)
    store_pages(kv_pool.k_buffer, kv_pool.v_buffer, slots, dram, [1, 0], layout)
    for buf in (*kv_pool.k_buffer, *kv_pool.v_buffer):
        buf.zero_()
    load_pages(kv_pool.k_buffer, kv_pool.v_buffer, dram, [1, 0], slots, layout)
    for layer in range(2):
        assert torch.equal(kv_pool.k_buffer[layer][slots], expected_k[layer][slots])
        assert torch.equal(kv_pool.v_buffer[layer][slots], expected_v[layer][slots])
        assert not kv_pool.k_buffer[layer][3 * PAGE_SIZE :].any()


def test_from_device_pool_rejects_mismatched_heads():
    class FakePool:  # V head dim differs from K (e.g. MLA-like shapes): not a FlashInfer MHA page
        head_num, head_dim, v_head_dim, layer_num = 2, 64, 32, 1
        dtype = store_dtype = torch.float16
        k_buffer = [torch.zeros(32, 2, 64, dtype=torch.float16)]
        v_buffer = [torch.zeros(32, 2, 32, dtype=torch.float16)]

    with pytest.raises(ValueError, match="head_dim"):
        KVLayout.from_device_pool(FakePool(), 16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device for the HBM side of the copies")
@pytest.mark.parametrize("page_major", [True, False], ids=["page_major", "layer_major"])
def test_round_trip_with_cuda_buffers(tmp_path, page_major):
    """HBM -> DRAM -> HBM with the K/V buffers and token slots on the GPU, the pool in shared memory."""
    layout = KVLayout(NUM_LAYERS, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, page_major)
    k_cpu, v_cpu = random_buffers(layout, seed=13)
    k, v = [t.cuda() for t in k_cpu], [t.cuda() for t in v_cpu]
    src_slots = scattered_slots([7, 2, 15], seed=14)
    dst_slots = scattered_slots([1, 19, 4], seed=15)
    page_ids = [3, 0, 5]
    with DramPool.create(layout, 6, tmp_path / "d") as pool:
        store_pages(k, v, src_slots.cuda(), pool.tensor, page_ids, layout)
        for i, page in enumerate(page_ids):  # DRAM holds the FlashInfer pages, read back on the CPU
            rows = src_slots[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]
            block = pool.tensor[page, 2] if page_major else pool.tensor[2, page]
            assert torch.equal(bits(block[1]), bits(v_cpu[2][rows]))
        k2 = [torch.zeros_like(t) for t in k]
        v2 = [torch.zeros_like(t) for t in v]
        load_pages(k2, v2, pool.tensor, page_ids, dst_slots.cuda(), layout)
        torch.cuda.synchronize()
        for layer in range(layout.num_layers):
            assert torch.equal(bits(k2[layer].cpu()[dst_slots]), bits(k_cpu[layer][src_slots]))
            assert torch.equal(bits(v2[layer].cpu()[dst_slots]), bits(v_cpu[layer][src_slots]))
            assert int(k2[layer].view(torch.int16).count_nonzero()) == int(k_cpu[layer][src_slots].view(torch.int16).count_nonzero())
