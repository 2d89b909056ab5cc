"""The GPU data path's logic on the CPU: run grouping, path choice, LayerLoad and the async store.

``LayerLoad`` (gather and runs) and ``store_pages_async`` are plain torch code; on CPU tensors
they must produce the same bytes as ``layout.load_layer`` / ``layout.store_pages``, which the
CPU path uses. Random bit patterns (NaNs included), compared as integers. The CUDA copies
themselves are in ``test_device_copy_gpu.py``.
"""

from __future__ import annotations

import types

import pytest
import torch

from hiradix.core.ledger import Kind, Transfer
from hiradix.dataplane import device_copy
from hiradix.dataplane.device_copy import LayerLoad, choose_load_path, contiguous_runs, layer_runs, store_pages_async
from hiradix.dataplane.layerwise import LayerwiseLoader
from hiradix.dataplane.layout import KVLayout, load_layer, store_pages
from hiradix.dataplane.movers import HostMover
from hiradix.tiers.dram import DramPool

L, PS, H, D = 3, 4, 2, 40
POOL_PAGES, DEVICE_PAGES = 10, 14


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def random_bits(shape, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16)


def slots_of(device_pages: list[int], gen: torch.Generator) -> torch.Tensor:
    """Token slots of the device pages, each page's slots shuffled (the contract allows any order)."""
    return torch.cat([p * PS + torch.randperm(PS, generator=gen) for p in device_pages]).to(torch.int64)


@pytest.fixture(params=[True, False], ids=["page_major", "layer_major"])
def layout(request) -> KVLayout:
    return KVLayout(L, PS, H, D, torch.bfloat16, page_major=request.param)


@pytest.fixture
def dram(layout) -> torch.Tensor:
    return random_bits(layout.dram_shape(POOL_PAGES), torch.Generator().manual_seed(3))


def buffers(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shape = (DEVICE_PAGES * PS, H, D)
    return [random_bits(shape, gen) for _ in range(L)], [random_bits(shape, gen) for _ in range(L)]


@pytest.mark.parametrize(("ids", "runs"), [
    ([], []),
    ([5], [(0, 5, 1)]),
    ([3, 4, 5, 9, 10, 2], [(0, 3, 3), (3, 9, 2), (5, 2, 1)]),
    ([5, 4, 3], [(0, 5, 1), (1, 4, 1), (2, 3, 1)]),  # descending ids are not one extent
    ([2, 2, 3], [(0, 2, 1), (1, 2, 2)]),
])
def test_contiguous_runs(ids, runs):
    assert contiguous_runs(ids) == runs
    assert sum(length for _, _, length in runs) == len(ids)


def test_layer_runs_follow_the_pool_order():
    ids = [4, 5, 6, 1]
    page_major = KVLayout(L, PS, H, D, torch.bfloat16, page_major=True)
    layer_major = KVLayout(L, PS, H, D, torch.bfloat16, page_major=False)
    one_layer = KVLayout(1, PS, H, D, torch.bfloat16, page_major=True)
    assert layer_runs(ids, page_major) == [(0, 4, 1), (1, 5, 1), (2, 6, 1), (3, 1, 1)]
    assert layer_runs(ids, layer_major) == [(0, 4, 3), (3, 1, 1)]
    assert layer_runs(ids, one_layer) == [(0, 4, 3), (3, 1, 1)]


@pytest.mark.parametrize(("cuda", "pinned", "host_ok", "path"), [
    (False, False, None, "host"),
    (False, True, True, "host"),
    (True, False, True, "host"),  # registration failed: pageable
    (True, True, True, "gather"),
    (True, True, False, "runs"),
    (True, True, None, "runs"),  # the driver could not be asked: no kernel reads host memory
])
def test_choose_load_path(cuda, pinned, host_ok, path):
    chosen, reason = choose_load_path(cuda, pinned, host_ok)
    assert chosen == path and chosen in device_copy.LOAD_PATHS
    assert reason


@pytest.mark.parametrize("path", ["gather", "runs"])
def test_layer_load_matches_load_layer_bit_for_bit(layout, dram, path):
    gen = torch.Generator().manual_seed(11)
    page_ids = [7, 8, 9, 2, 0, 1, 5]  # runs of 3, 1, 2, 1
    slots = slots_of([12, 3, 4, 0, 9, 10, 6], gen)
    k_want, v_want = buffers(5)
    k_got, v_got = buffers(5)
    load = LayerLoad(dram, page_ids, slots, layout, path, source=dram if path == "gather" else None)
    for layer in range(L):
        load_layer(k_want[layer], v_want[layer], layer, dram, page_ids, slots, layout)
        load.copy_layer(layer, k_got[layer], v_got[layer])
    for layer in range(L):
        assert torch.equal(bits(k_got[layer]), bits(k_want[layer]))
        assert torch.equal(bits(v_got[layer]), bits(v_want[layer]))
    expected = {"gather": 1, "runs": 7 if layout.page_major else 4}[path]
    assert load.copies_per_layer == expected


def test_layer_load_rejects_bad_arguments(layout, dram):
    slots = torch.arange(2 * PS)
    with pytest.raises(ValueError, match="path"):
        LayerLoad(dram, [0, 1], slots, layout, "host")
    with pytest.raises(ValueError, match="source"):
        LayerLoad(dram, [0, 1], slots, layout, "gather")
    with pytest.raises(ValueError, match="token_slots"):
        LayerLoad(dram, [0, 1, 2], slots, layout, "runs")
    load = LayerLoad(dram, [0, 1], slots, layout, "runs")
    k, v = buffers(1)
    with pytest.raises(ValueError, match="layer"):
        load.copy_layer(L, k[0], v[0])


def test_store_pages_async_matches_store_pages(layout):
    k, v = buffers(21)
    gen = torch.Generator().manual_seed(2)
    page_ids = [3, 4, 5, 0, 8, 9]  # runs of 3, 1, 2
    slots = slots_of([1, 7, 2, 13, 5, 11], gen)
    want = random_bits(layout.dram_shape(POOL_PAGES), torch.Generator().manual_seed(9))
    got = want.clone()
    store_pages(k, v, slots, want, page_ids, layout)
    copies = store_pages_async(k, v, slots, got, page_ids, layout)
    assert torch.equal(bits(got), bits(want))
    assert copies == (3 if layout.page_major else 3 * L)
    with pytest.raises(ValueError, match="distinct"):
        store_pages_async(k, v, slots, got, [3, 3, 5, 0, 8, 9], layout)


@pytest.fixture
def pool(tmp_path, layout):
    pool = DramPool.create(layout, POOL_PAGES, tmp_path / "dram")
    pool.tensor.copy_(random_bits(layout.dram_shape(POOL_PAGES), torch.Generator().manual_seed(4)))
    yield pool
    pool.close()
    pool.unlink()


def promote_op(op_id: int, pages: list[int], slots: torch.Tensor) -> Transfer:
    return Transfer(op_id=op_id, kind=Kind.PROMOTE, nodes=[], src_ids=pages, dst_ids=[], hbm_parts=[slots])


@pytest.mark.parametrize("path", ["gather", "runs"])
def test_mover_merges_a_batch_of_promotions_into_one_load(layout, pool, path):
    k, v = buffers(8)
    kv = types.SimpleNamespace(k_buffer=k, v_buffer=v)
    loader = LayerwiseLoader(L, torch.device("cpu"))
    mover = HostMover(kv, pool, loader, load_path=path)
    assert mover.load_path == path
    gen = torch.Generator().manual_seed(6)
    ops = [promote_op(1, [4, 5], slots_of([2, 3], gen)), promote_op(2, [9, 0, 1], slots_of([8, 12, 0], gen))]
    k_want, v_want = [b.clone() for b in k], [b.clone() for b in v]
    for op in ops:
        for layer in range(L):
            load_layer(k_want[layer], v_want[layer], layer, pool.tensor, op.src_ids, op.hbm_parts[0], layout)
        mover.promote(op)
    assert loader._queued == []  # merged promotions wait for start_loading
    assert mover.start_loading() == 0
    assert [load.op_ids for load in loader._active] == [(1, 2)]
    loader.set_consumer(0)
    for layer in range(L):
        loader.wait_until(layer)
    assert sorted(mover.finished()) == [1, 2]
    for layer in range(L):
        assert torch.equal(bits(k[layer]), bits(k_want[layer]))
        assert torch.equal(bits(v[layer]), bits(v_want[layer]))


def test_mover_flush_lands_merged_promotions_and_drop_forgets_them(layout, pool):
    k, v = buffers(8)
    kv = types.SimpleNamespace(k_buffer=k, v_buffer=v)
    mover = HostMover(kv, pool, LayerwiseLoader(L, torch.device("cpu")), load_path="runs")
    slots = slots_of([5], torch.Generator().manual_seed(1))
    mover.promote(promote_op(3, [6], slots))
    assert mover.flush() == [3]  # flush submits and lands what start_loading has not taken
    k_want = k[1].clone()
    load_layer(k_want, v[1].clone(), 1, pool.tensor, [6], slots, layout)
    assert torch.equal(bits(k[1]), bits(k_want))
    mover.promote(promote_op(4, [7], slots))
    mover.drop_pending()
    assert mover.start_loading() == -1 and mover.finished() == []


def test_mover_on_cpu_keeps_the_host_path(layout, pool):
    kv = types.SimpleNamespace(k_buffer=buffers(1)[0], v_buffer=buffers(1)[1])
    mover = HostMover(kv, pool, LayerwiseLoader(L, torch.device("cpu")))
    assert mover.load_path == "host"
    with pytest.raises(ValueError, match="load path"):
        HostMover(kv, pool, LayerwiseLoader(L, torch.device("cpu")), load_path="dma")


@pytest.mark.parametrize(("dtype", "heads", "head_dim", "word"), [
    (torch.uint8, 1, 3, torch.uint8),  # 3-byte rows: byte copies
    (torch.float16, 3, 3, torch.int16),  # 18-byte rows
    (torch.float32, 1, 5, torch.int32),  # 20-byte rows
    (torch.bfloat16, 2, 40, torch.int64),
])
@pytest.mark.parametrize("page_major", [True, False])
def test_word_sized_copies_keep_every_byte(dtype, heads, head_dim, word, page_major):
    layout = KVLayout(L, PS, heads, head_dim, dtype, page_major=page_major)
    assert device_copy.word_dtype(layout) == word
    gen = torch.Generator().manual_seed(5)

    def raw(shape):
        return torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8, generator=gen).view(dtype)

    dram = raw(layout.dram_shape(POOL_PAGES))
    rows = (DEVICE_PAGES * PS, heads, head_dim)
    k_want, v_want = [raw(rows) for _ in range(L)], [raw(rows) for _ in range(L)]
    k_got, v_got = [b.clone() for b in k_want], [b.clone() for b in v_want]
    page_ids, slots = [1, 2, 6], slots_of([4, 0, 13], gen)
    load = LayerLoad(dram, page_ids, slots, layout, "gather", source=dram)
    for layer in range(L):
        load_layer(k_want[layer], v_want[layer], layer, dram, page_ids, slots, layout)
        load.copy_layer(layer, k_got[layer], v_got[layer])
        assert torch.equal(k_got[layer].view(torch.uint8), k_want[layer].view(torch.uint8))
        assert torch.equal(v_got[layer].view(torch.uint8), v_want[layer].view(torch.uint8))
    want, got = dram.clone(), dram.clone()
    store_pages(k_want, v_want, slots, want, [9, 0, 3], layout)
    store_pages_async(k_want, v_want, slots, got, [9, 0, 3], layout)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("path", ["gather", "runs"])
def test_a_large_batch_is_copied_in_chunks_of_staging(layout, dram, path, monkeypatch):
    monkeypatch.setattr(device_copy, "LOAD_STAGING_BYTES", 2 * layout.layer_page_bytes)  # 2 pages a chunk
    gen = torch.Generator().manual_seed(13)
    page_ids = [2, 3, 4, 8, 0]  # chunks [2, 3] [4, 8] [0]: the run 2-4 is cut at a chunk boundary
    slots = slots_of([1, 9, 10, 4, 7], gen)
    k_want, v_want = buffers(3)
    k_got, v_got = buffers(3)
    load = LayerLoad(dram, page_ids, slots, layout, path, source=dram if path == "gather" else None)
    assert load.copies_per_layer == {"gather": 3, "runs": 5 if layout.page_major else 4}[path]
    for layer in range(L):
        load_layer(k_want[layer], v_want[layer], layer, dram, page_ids, slots, layout)
        load.copy_layer(layer, k_got[layer], v_got[layer])
        assert torch.equal(bits(k_got[layer]), bits(k_want[layer]))
        assert torch.equal(bits(v_got[layer]), bits(v_want[layer]))
    assert load._staging.shape[0] == 2
