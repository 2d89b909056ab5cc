"""NVMe store: runs of consecutive slots move in one call, yet each slot is verified alone."""

from __future__ import annotations

import os

import numpy as np

from hiradix.tiers.nvme import NVME_FILE_NAME, NvmeStore

PAGE = 8192


def pages(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, PAGE, dtype=np.uint8) for _ in range(n)]


def read(store: NvmeStore, ids: list[int]) -> tuple[list[bool], list[np.ndarray]]:
    out = [np.zeros(PAGE, dtype=np.uint8) for _ in ids]
    return store.read_slots(ids, [memoryview(o) for o in out]), out


def test_runs_split_on_gaps_and_length(tmp_path):
    with NvmeStore.create(tmp_path, PAGE, 64, backend="posix", threads=2) as store:
        assert store.run_slots == (4 << 20) // store.slot_bytes
        assert store._runs([3, 4, 5, 9, 10, 2, 3]) == [[0, 1, 2], [3, 4], [5, 6]]
        assert store._runs([1, 2, 3, 4, 5]) == [[0, 1, 2], [3, 4]]  # at most ceil(5 / 2) per run
        assert max(len(r) for r in store._runs(list(range(40)))) == 20  # both threads get a run


def test_coalesced_round_trip_and_per_slot_verification(tmp_path):
    ids = list(range(10, 22)) + [40, 7]
    data = pages(len(ids), seed=1)
    with NvmeStore.create(tmp_path, PAGE, 64, backend="posix", threads=2) as store:
        assert store.write_slots(ids, [memoryview(p) for p in data]) == [True] * len(ids)
        ok, out = read(store, ids)
        assert ok == [True] * len(ids) and all((o == p).all() for o, p in zip(out, data))
        slot_bytes = store.slot_bytes
    with open(tmp_path / NVME_FILE_NAME, "r+b") as f:  # flip one byte inside slot 15 (mid-run)
        f.seek(15 * slot_bytes + 100)
        byte = f.read(1)
        f.seek(15 * slot_bytes + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with NvmeStore.open(tmp_path / NVME_FILE_NAME, PAGE, 64, backend="posix", threads=2) as store:
        ok, out = read(store, ids)
    assert ok == [i != 15 for i in ids]
    assert (out[ids.index(15)] == 0).all()  # a failed slot leaves its page untouched
    assert all((o == p).all() for i, o, p in zip(ids, out, data) if i != 15)


def test_truncation_inside_a_run_fails_only_the_missing_slots(tmp_path):
    ids = list(range(0, 8))
    data = pages(len(ids), seed=2)
    with NvmeStore.create(tmp_path, PAGE, 8, backend="posix", threads=1) as store:
        assert all(store.write_slots(ids, [memoryview(p) for p in data]))
        slot_bytes = store.slot_bytes
    os.truncate(tmp_path / NVME_FILE_NAME, 5 * slot_bytes)
    with NvmeStore.open(tmp_path / NVME_FILE_NAME, PAGE, 8, backend="posix", threads=1) as store:
        ok, out = read(store, ids)
    assert ok == [True] * 5 + [False] * 3
    assert all((o == p).all() for o, p in zip(out[:5], data[:5]))
