"""The GPU data path on a CUDA device: pinned DRAM, DRAM -> HBM per layer, HBM -> DRAM, NVMe -> HBM.

Skipped without CUDA (this project's CI has none); ``scripts/gpu_check`` runs the same paths at
scale and times them. Every check compares bytes against the CPU path (``layout.load_layer`` /
``store_pages``) or against what was written.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from hiradix.core.ledger import Kind, Transfer
from hiradix.dataplane.device_copy import LayerLoad, mapped_view, store_pages_async
from hiradix.dataplane.layerwise import LayerwiseLoader
from hiradix.dataplane.layout import KVLayout, load_layer, store_pages
from hiradix.dataplane.movers import HostMover
from hiradix.tiers.dram import DramPool
from hiradix.tiers.nvme import NvmeStore, kvikio_unusable_reason

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

L, PS, H, D = 4, 16, 2, 64
POOL_PAGES, DEVICE_PAGES = 40, 48


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def random_bits(shape, seed: int, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, generator=gen).view(torch.bfloat16).to(device)


class _Event:
    """SGLang 0.5.23's ``LayerLoadingEvent`` contract (one CUDA event per layer)."""

    def __init__(self, n: int):
        self.load_events = [torch.cuda.Event() for _ in range(n)]

    def complete(self, layer: int) -> None:
        self.load_events[layer].record()

    def wait(self, layer: int) -> None:
        torch.cuda.current_stream().wait_event(self.load_events[layer])

    @property
    def finish_event(self):
        return self.load_events[-1]


class _Counter:
    """SGLang 0.5.23's ``LayerDoneCounter`` contract, used when SGLang is not importable."""

    def __init__(self, n: int):
        self.events = [_Event(n) for _ in range(3)]
        self.producer_index = self.consumer_index = -1

    def update_producer(self) -> int:
        self.producer_index = (self.producer_index + 1) % 3
        assert self.events[self.producer_index].finish_event.query()
        return self.producer_index

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def wait_until(self, layer: int) -> None:
        if self.consumer_index >= 0:
            self.events[self.consumer_index].wait(layer)

    def reset(self) -> None:
        self.producer_index = self.consumer_index = -1


def counter_factory():
    try:
        from sglang.srt.managers.cache_controller import LayerDoneCounter

        return LayerDoneCounter
    except Exception:
        return _Counter


@pytest.fixture(params=[True, False], ids=["page_major", "layer_major"])
def layout(request) -> KVLayout:
    return KVLayout(L, PS, H, D, torch.bfloat16, page_major=request.param)


@pytest.fixture
def pool(layout):
    pool = DramPool.create_anonymous(layout, POOL_PAGES)
    pool.tensor.copy_(random_bits(layout.dram_shape(POOL_PAGES), 4))
    assert pool.pin_for_cuda(), pool.pin_failure
    yield pool
    pool.close()


def slots_of(device_pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in device_pages]).cuda()


def test_pool_is_pinned_and_unpinned_at_close(layout):
    pool = DramPool.create_anonymous(layout, 8)
    assert pool.pin_for_cuda() and pool.cuda_pinned and pool.tensor.is_pinned()
    view = pool.tensor
    pool.close()
    assert not pool.cuda_pinned
    assert not view.is_pinned()  # unregistered before the mapping went


def test_mapped_view_reads_the_pool(pool):
    view, reason = mapped_view(pool.tensor, torch.device("cuda"))
    assert view is not None, reason
    assert view.is_cuda and view.shape == pool.tensor.shape
    # read through a kernel (the view is host memory; it is not for cudaMemcpy)
    assert torch.equal(bits(view).to(torch.int32).cpu(), bits(pool.tensor).to(torch.int32))


@pytest.mark.parametrize("path", ["gather", "runs"])
def test_layer_load_on_a_side_stream_matches_the_cpu_path(layout, pool, path):
    page_ids = [30, 31, 32, 3, 9, 10, 0]
    dev_pages = [40, 2, 3, 17, 5, 6, 11]
    k_cpu = [random_bits((DEVICE_PAGES * PS, H, D), 10 + i) for i in range(L)]
    v_cpu = [random_bits((DEVICE_PAGES * PS, H, D), 20 + i) for i in range(L)]
    k_gpu, v_gpu = [b.cuda() for b in k_cpu], [b.cuda() for b in v_cpu]
    source = mapped_view(pool.tensor, torch.device("cuda"))[0] if path == "gather" else None
    slots = slots_of(dev_pages)
    load = LayerLoad(pool.tensor, page_ids, slots, layout, path, source)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for layer in range(L):
            load.copy_layer(layer, k_gpu[layer], v_gpu[layer])
    side.synchronize()
    for layer in range(L):
        load_layer(k_cpu[layer], v_cpu[layer], layer, pool.tensor, page_ids, slots.cpu(), layout)
        assert torch.equal(bits(k_gpu[layer]).cpu(), bits(k_cpu[layer]))
        assert torch.equal(bits(v_gpu[layer]).cpu(), bits(v_cpu[layer]))


def test_store_pages_async_into_pinned_dram(layout, pool):
    k = [random_bits((DEVICE_PAGES * PS, H, D), 30 + i, "cuda") for i in range(L)]
    v = [random_bits((DEVICE_PAGES * PS, H, D), 40 + i, "cuda") for i in range(L)]
    page_ids, slots = [5, 6, 7, 1, 20], slots_of([9, 8, 30, 1, 2])
    want = pool.tensor.clone()
    store_pages([b.cpu() for b in k], [b.cpu() for b in v], slots.cpu(), want, page_ids, layout)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        store_pages_async(k, v, slots, pool.tensor, page_ids, layout)
        done = torch.cuda.Event()
        done.record()
    done.synchronize()
    assert torch.equal(bits(pool.tensor), bits(want))


def test_mover_streams_a_batch_layer_by_layer(layout, pool):
    k = [torch.zeros((DEVICE_PAGES * PS, H, D), dtype=torch.bfloat16, device="cuda") for _ in range(L)]
    v = [torch.zeros_like(b) for b in k]
    loader = LayerwiseLoader(L, torch.device("cuda"), counter_factory())
    mover = HostMover(types.SimpleNamespace(k_buffer=k, v_buffer=v), pool, loader)
    assert mover.load_path in ("gather", "runs")
    ops = [Transfer(op_id=1, kind=Kind.PROMOTE, nodes=[], src_ids=[11, 12], dst_ids=[], hbm_parts=[slots_of([3, 4])]),
           Transfer(op_id=2, kind=Kind.PROMOTE, nodes=[], src_ids=[39, 0], dst_ids=[], hbm_parts=[slots_of([7, 1])])]
    for op in ops:
        mover.promote(op)
    producer = mover.start_loading()
    loader.set_consumer(producer)
    sums = []
    for layer in range(L):  # the "forward": waits per layer on the compute stream, then reads
        loader.wait_until(layer)
        sums.append(bits(k[layer]).sum(dtype=torch.int64) + bits(v[layer]).sum(dtype=torch.int64))
    torch.cuda.synchronize()
    assert sorted(mover.finished()) == [1, 2]
    for layer in range(L):
        k_want = torch.zeros((DEVICE_PAGES * PS, H, D), dtype=torch.bfloat16)
        v_want = torch.zeros_like(k_want)
        for op in ops:
            load_layer(k_want, v_want, layer, pool.tensor, op.src_ids, op.hbm_parts[0].cpu(), layout)
        assert torch.equal(bits(k[layer]).cpu(), bits(k_want)) and torch.equal(bits(v[layer]).cpu(), bits(v_want))
        assert int(sums[layer]) == int(bits(k_want).sum(dtype=torch.int64) + bits(v_want).sum(dtype=torch.int64))


def test_pageable_pool_takes_the_host_path(layout):
    pool = DramPool.create_anonymous(layout, 8)  # not pinned
    try:
        k = [torch.zeros((DEVICE_PAGES * PS, H, D), dtype=torch.bfloat16, device="cuda") for _ in range(L)]
        loader = LayerwiseLoader(L, torch.device("cuda"), counter_factory())
        mover = HostMover(types.SimpleNamespace(k_buffer=k, v_buffer=[torch.zeros_like(b) for b in k]), pool, loader)
        assert mover.load_path == "host"
    finally:
        pool.close()


@pytest.mark.parametrize("path", ["posix", "kvikio"])
def test_read_slots_to_device(tmp_path, path):
    if path == "kvikio" and kvikio_unusable_reason() is not None:
        pytest.skip(f"kvikio not usable: {kvikio_unusable_reason()}")
    page_bytes = 3 * 13_824
    store = NvmeStore.create(tmp_path / "nvme", page_bytes, 16, backend="posix", threads=2)
    try:
        written = np.random.default_rng(1).integers(0, 256, (10, page_bytes), dtype=np.uint8)
        assert all(store.write_slots(list(range(10)), [memoryview(p) for p in written]))
        order = [9, 0, 1, 2, 12, 5]  # slot 12 was never written
        dst = torch.full((len(order), page_bytes), 0xA5, dtype=torch.uint8, device="cuda")
        ok = store.read_slots_to_device(order, dst, path=path)
        assert ok == [True, True, True, True, False, True]
        got = dst.cpu().numpy()
        for i, slot in enumerate(order):
            assert np.array_equal(got[i], written[slot] if ok[i] else np.full(page_bytes, 0xA5, np.uint8))
    finally:
        store.close()


def test_build_tiers_pins_the_dram_tier_of_a_gpu_pool(layout):
    from hiradix.config import HiRadixConfig
    from hiradix.core.tree import TieredRadixTree
    from hiradix.runtime.assembly import build_tiers

    k = [torch.zeros((DEVICE_PAGES * PS, H, D), dtype=torch.bfloat16, device="cuda") for _ in range(L)]
    kv_pool = types.SimpleNamespace(k_buffer=k, v_buffer=[torch.zeros_like(b) for b in k], head_num=H, head_dim=D,
                                    v_head_dim=D, layer_num=L, dtype=torch.bfloat16, store_dtype=torch.bfloat16)
    config = HiRadixConfig(dram_bytes=8 * layout.page_bytes, policy="lru")
    tiers, loader = build_tiers(TieredRadixTree(PS), config, kv_pool, PS, counter_factory=counter_factory())
    try:
        assert loader.cuda
        assert tiers.mover.dram.cuda_pinned, tiers.mover.dram.pin_failure
        assert tiers.mover.load_path in ("gather", "runs")
    finally:
        tiers.close()
    assert not tiers.mover.dram.cuda_pinned  # unregistered when the tiers closed
