"""NVMe -> device reads (``NvmeStore.read_slots_to_device``): the path choice and the POSIX path.

On the CPU the destination is a CPU tensor, which runs the POSIX path end to end on a real slot
file: reads verify, a corrupted or never-written slot is a miss whose row stays untouched. The
KvikIO/GDS path into GPU memory is in ``tests/dataplane/test_device_copy_gpu.py``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hiradix.tiers import nvme_device
from hiradix.tiers.nvme import NvmeStore, kvikio_unusable_reason
from hiradix.tiers.nvme_device import DeviceSlotReader, choose_device_read_path

PAGE_BYTES = 3 * 13_824  # not a multiple of 4096
NUM_SLOTS = 12


@pytest.mark.parametrize(("reason", "compat", "path"), [
    ("import kvikio failed: no module", None, "posix"),
    (None, None, "posix"),  # KvikIO could not say whether GDS is there
    (None, True, "posix"),  # compatibility mode: no GDS
    (None, False, "kvikio"),
])
def test_choose_device_read_path(reason, compat, path):
    chosen, why = choose_device_read_path(reason, compat)
    assert chosen == path and chosen in nvme_device.DEVICE_READ_PATHS
    assert why


def test_chunks_group_runs_and_cap_each_round():
    rounds = nvme_device._chunks([4, 5, 6, 7, 8, 1, 2, 9], chunk_slots=3)
    assert rounds == [[(0, 4, 3)], [(3, 7, 2)], [(5, 1, 2), (7, 9, 1)]]  # runs 4-6, 7-8, 1-2, 9
    assert nvme_device._chunks([], 3) == []
    assert nvme_device._chunks([0, 1, 2, 3, 4], 2) == [[(0, 0, 2)], [(2, 2, 2)], [(4, 4, 1)]]  # a long run split
    for r in rounds:
        assert sum(length for _, _, length in r) <= 3


@pytest.fixture
def store(tmp_path):
    st = NvmeStore.create(tmp_path / "nvme", PAGE_BYTES, NUM_SLOTS, backend="posix", threads=2)
    yield st
    st.close()


def pages(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE_BYTES), dtype=np.uint8)


def test_posix_reads_into_rows_and_a_bad_slot_is_a_miss(store):
    written = pages(8, 1)
    assert all(store.write_slots(list(range(8)), [memoryview(p) for p in written]))
    with open(store.path, "r+b") as f:  # flip one payload byte of slot 5
        f.seek(5 * store.slot_bytes + 100)
        byte = f.read(1)
        f.seek(5 * store.slot_bytes + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())
    order = [6, 7, 0, 5, 1, 9, 2]  # slot 9 was never written
    dst = torch.full((len(order), PAGE_BYTES), 0xA5, dtype=torch.uint8)
    ok = store.read_slots_to_device(order, dst)
    assert ok == [True, True, True, False, True, False, True]
    for i, slot in enumerate(order):
        want = written[slot] if ok[i] else np.full(PAGE_BYTES, 0xA5, dtype=np.uint8)
        assert np.array_equal(dst[i].numpy(), want), (i, slot)
    assert store._device_reader.path == "posix"


def test_small_rounds_give_the_same_bytes(store):
    written = pages(NUM_SLOTS, 2)
    assert all(store.write_slots(list(range(NUM_SLOTS)), [memoryview(p) for p in written]))
    reader = DeviceSlotReader(store, torch.device("cpu"), path="posix")
    reader.chunk_slots = 2  # many rounds, each reusing the bounce buffers
    order = [11, 3, 4, 5, 0, 10, 1]
    dst = torch.zeros((len(order), PAGE_BYTES), dtype=torch.uint8)
    assert all(reader.read(order, dst))
    assert np.array_equal(dst.numpy(), written[order])
    reader.close()


def test_bad_destinations_are_refused(store):
    with pytest.raises(ValueError, match="dst"):
        store.read_slots_to_device([0, 1], torch.zeros((1, PAGE_BYTES), dtype=torch.uint8))
    with pytest.raises(ValueError, match="dst"):
        store.read_slots_to_device([0], torch.zeros((1, PAGE_BYTES), dtype=torch.int16))
    with pytest.raises(ValueError, match="contiguous"):
        store.read_slots_to_device([0, 1], torch.zeros((PAGE_BYTES, 2), dtype=torch.uint8).t())
    with pytest.raises(ValueError, match="out of range"):
        store.read_slots_to_device([NUM_SLOTS], torch.zeros((1, PAGE_BYTES), dtype=torch.uint8))
    with pytest.raises(ValueError, match="unknown"):
        DeviceSlotReader(store, torch.device("cpu"), path="gds")


@pytest.mark.skipif(kvikio_unusable_reason() is None, reason="checks the answer where kvikio is not usable")
def test_forcing_kvikio_where_it_is_not_usable_fails_clearly(store):
    with pytest.raises(RuntimeError, match="kvikio"):
        DeviceSlotReader(store, torch.device("cpu"), path="kvikio")
