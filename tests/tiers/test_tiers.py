"""The off-device tiers: page allocator scenarios, the shared DRAM pool, the NVMe slot store.

Real files, real processes, real O_DIRECT. The NVMe tests run in pytest's ``tmp_path`` (under
the temp dir: a disk file system here) and on ``/dev/shm`` (tmpfs); the buffered fallback is
forced by making ``open(O_DIRECT)`` (or the first direct read) fail with EINVAL, because no
writable file system on the development machine refuses O_DIRECT (tmpfs accepts it since
Linux 6.6).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import multiprocessing
import os
import stat
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from hiradix.dataplane.layout import KVLayout
from hiradix.core.allocator import PageAllocator
from hiradix.tiers.dram import DramPool, num_pages_for_bytes
from hiradix.tiers.files import default_shm_dir
from hiradix.tiers.nvme import SLOT_ALIGN, NvmeIO, NvmeStore
from hiradix.tiers import nvme as nvme_mod
from hiradix.tiers.nvme import TRAILER, kvikio_unusable_reason

LAYOUT = KVLayout(num_layers=3, page_size=16, num_kv_heads=3, head_dim=72, dtype=torch.bfloat16)
PAGE_BYTES = LAYOUT.page_bytes  # 41,472: not a multiple of 4096


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def page_pattern(seed: int, nbytes: int = PAGE_BYTES) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


# ---------------------------------------------------------------- PageAllocator


def test_allocator_all_or_nothing():
    alloc = PageAllocator(4)
    assert (alloc.capacity, alloc.num_free, alloc.num_used) == (4, 4, 0)
    first = alloc.alloc(3)  # -> [0, 1, 2]
    assert first == [0, 1, 2]
    alloc.check_integrity()
    assert alloc.alloc(2) is None  # only 1 free -> None, nothing taken
    assert (alloc.num_free, alloc.num_used) == (1, 3)
    alloc.check_integrity()
    assert alloc.alloc(0) == []
    assert alloc.alloc(1) == [3]
    assert alloc.alloc(1) is None
    alloc.check_integrity()
    with pytest.raises(ValueError):
        alloc.alloc(-1)


def test_allocator_free_and_reuse_lifo():
    alloc = PageAllocator(5)
    ids = alloc.alloc(5)
    alloc.free([1, 3])  # -> free list ends with 1 (freed first goes last)
    alloc.check_integrity()
    assert [alloc.is_used(i) for i in range(5)] == [True, False, True, False, True]
    assert alloc.alloc(2) == [1, 3]
    assert alloc.num_free == 0 and sorted(ids) == [0, 1, 2, 3, 4]
    alloc.check_integrity()


@pytest.mark.parametrize(
    "bad_free, error",
    [
        ([2, 4], "double free of page 4"),  # 4 was never allocated
        ([0, 0], "double free of page 0"),  # repeated inside one call
        ([1, 7], "out of range"),
        ([1, -1], "out of range"),
        ([1, "x"], "not an integer"),
    ],
)
def test_allocator_bad_free_changes_nothing(bad_free, error):
    alloc = PageAllocator(5)
    alloc.alloc(3)  # 0, 1, 2 used; 3, 4 free
    with pytest.raises(ValueError, match=error):
        alloc.free(bad_free)
    assert [alloc.is_used(i) for i in range(5)] == [True, True, True, False, False]
    assert (alloc.num_free, alloc.num_used) == (2, 3)
    alloc.check_integrity()
    assert alloc.alloc(2) == [3, 4]  # the free list itself is unchanged


def test_allocator_double_free_after_free():
    alloc = PageAllocator(3)
    alloc.alloc(3)
    alloc.free([1])
    with pytest.raises(ValueError, match="double free"):
        alloc.free(np.array([2, 1]))  # numpy ids are accepted; 1 is already free
    assert alloc.is_used(2) and not alloc.is_used(1)
    alloc.check_integrity()


def test_allocator_integrity_detects_corruption():
    alloc = PageAllocator(4)
    alloc.alloc(2)
    alloc._free.append(0)  # simulate a bug: page 0 both used and free
    with pytest.raises(AssertionError):
        alloc.check_integrity()


# ---------------------------------------------------------------- DramPool


def test_dram_pool_creates_private_files(tmp_path):
    directory = tmp_path / "shm" / "pool"
    with DramPool.create(LAYOUT, 6, directory) as pool:
        assert mode_of(directory) == 0o700
        assert mode_of(pool.path) == 0o600
        assert pool.path == directory / "dram.kv"
        assert os.path.getsize(pool.path) == 6 * PAGE_BYTES == pool.dram_bytes
        assert pool.tensor.shape == (6, 3, 2, 16, 3, 72) and pool.tensor.dtype == torch.bfloat16
    pool.unlink()
    assert not directory.exists()  # made by create, removed by unlink


def test_dram_pool_refuses_shared_directory(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)
    with pytest.raises(PermissionError, match="0755"):
        DramPool.create(LAYOUT, 2, shared)
    assert not (shared / "dram.kv").exists()
    target = tmp_path / "private"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(PermissionError, match="symlink"):
        DramPool.create(LAYOUT, 2, link)


def test_default_shm_dir_and_sizing():
    directory = default_shm_dir()
    assert directory.name == f"hiradix-{os.geteuid()}-{os.getpid()}"
    if Path("/dev/shm").is_dir():
        assert directory.parent == Path("/dev/shm")
    assert num_pages_for_bytes(10 * PAGE_BYTES + PAGE_BYTES - 1, LAYOUT) == 10
    with pytest.raises(ValueError, match="holds no page"):
        num_pages_for_bytes(PAGE_BYTES - 1, LAYOUT)


@pytest.mark.parametrize("page_major", [True, False])
def test_dram_views_match_tensor(tmp_path, page_major):
    layout = KVLayout(3, 16, 3, 72, torch.float16, page_major)
    with DramPool.create(layout, 4, tmp_path / "d") as pool:
        gen = torch.Generator().manual_seed(0)
        pool.tensor.copy_(torch.randn(pool.tensor.shape, generator=gen).half())
        block = pool.tensor[2, 1] if page_major else pool.tensor[1, 2]  # layer 1 of page 2
        assert bytes(pool.layer_page_view(1, 2)) == block.contiguous().view(torch.uint8).numpy().tobytes()
        assert len(pool.layer_page_view(0, 0)) == layout.layer_page_bytes
        if page_major:
            assert bytes(pool.page_view(3)) == pool.tensor[3].view(torch.uint8).numpy().tobytes()
        else:
            with pytest.raises(ValueError, match="page-major"):
                pool.page_view(3)
        with pytest.raises(ValueError, match="out of range"):
            pool.layer_page_view(0, 4)


def _child_attach_and_write(path: str, layout_json: dict, num_pages: int, pattern: bytes, result_queue) -> None:
    """Runs in a spawned process: attach, report page 0 as written by the parent, fill page 1."""
    pool = DramPool.attach(Path(path), KVLayout.from_json(layout_json), num_pages)
    result_queue.put(bytes(pool.page_view(0)))
    pool.page_view(1)[:] = pattern
    pool.close()


def test_dram_pool_shared_with_spawned_process(tmp_path):
    with DramPool.create(LAYOUT, 3, tmp_path / "d") as pool:
        from_parent = page_pattern(1).tobytes()
        from_child = page_pattern(2).tobytes()
        pool.page_view(0)[:] = from_parent
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        child = ctx.Process(
            target=_child_attach_and_write,
            args=(str(pool.path), LAYOUT.to_json(), 3, from_child, results),
        )
        child.start()
        seen_by_child = results.get(timeout=120)
        child.join(timeout=120)
        assert child.exitcode == 0
        assert seen_by_child == from_parent
        assert bytes(pool.page_view(1)) == from_child  # written by the child through its own mapping
        assert pool.tensor[1].view(torch.uint8).flatten().numpy().tobytes() == from_child
        assert not pool.tensor[2].view(torch.uint8).any()


def test_dram_attach_checks_size_and_mode(tmp_path):
    with DramPool.create(LAYOUT, 3, tmp_path / "d") as pool:
        with pytest.raises(ValueError, match="expected 4 pages"):
            DramPool.attach(pool.path, LAYOUT, 4)
        os.chmod(pool.path, 0o644)
        with pytest.raises(PermissionError):
            DramPool.attach(pool.path, LAYOUT, 3)


# ---------------------------------------------------------------- NvmeStore


def odirect_works(directory: Path) -> bool:
    """Independent probe: can a file in ``directory`` be read with O_DIRECT?"""
    probe = directory / "probe"
    probe.write_bytes(b"\0" * SLOT_ALIGN)
    buf = mmap.mmap(-1, SLOT_ALIGN)
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [buf], 0)
        finally:
            os.close(fd)
        return True
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    finally:
        buf.close()
        probe.unlink()


@pytest.fixture(params=["tmp_path", "dev_shm"])
def nvme_dir(request, tmp_path):
    """A private directory on the temp dir's file system, or on /dev/shm (tmpfs)."""
    if request.param == "tmp_path":
        directory = tmp_path / "nvme"
        directory.mkdir(mode=0o700)
        yield directory
        return
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    directory = Path(tempfile.mkdtemp(prefix="hiradix-test-", dir="/dev/shm"))
    yield directory
    for child in directory.iterdir():
        child.unlink()
    directory.rmdir()


def write_patterns(store: NvmeStore, slot_ids: list[int], seed: int = 0) -> dict[int, bytes]:
    pages = {slot: page_pattern(seed + slot, store.page_bytes) for slot in slot_ids}
    assert store.write_slots(slot_ids, [memoryview(pages[s]) for s in slot_ids]) == [True] * len(slot_ids)
    return {slot: page.tobytes() for slot, page in pages.items()}


def read_into_sentinels(store: NvmeStore, slot_ids: list[int]) -> tuple[list[bool], list[np.ndarray]]:
    """Read into pages pre-filled with 0xAB so a partial or wrong copy would show."""
    dests = [np.full(store.page_bytes, 0xAB, dtype=np.uint8) for _ in slot_ids]
    return store.read_slots(slot_ids, [memoryview(d) for d in dests]), dests


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        old = f.read(1)
        f.seek(offset)
        f.write(bytes([old[0] ^ 0x01]))


def test_nvme_round_trip_direct_io(nvme_dir, caplog):
    with NvmeStore.create(nvme_dir, PAGE_BYTES, num_slots=32, backend="posix", threads=4) as store:
        assert isinstance(store, NvmeIO)
        assert store.name == store.backend == "posix"
        assert store.direct_io == odirect_works(nvme_dir)
        assert store.slot_bytes == 45_056 == 11 * SLOT_ALIGN  # align_up(41,472 + 40, 4096)
        assert os.path.getsize(store.path) == 32 * store.slot_bytes
        assert mode_of(store.path) == 0o600 and mode_of(nvme_dir) == 0o700
        slots = [31, 0, 7, 8, 9, 20, 3, 12]
        expected = write_patterns(store, slots)
        ok, dests = read_into_sentinels(store, slots[::-1])
        assert ok == [True] * len(slots)
        assert [d.tobytes() for d in dests] == [expected[s] for s in slots[::-1]]
    assert "O_DIRECT" not in caplog.text


def test_nvme_odirect_available_on_some_disk(tmp_path):
    """The O_DIRECT path itself is exercised where the temp dir's file system allows it."""
    directory = tmp_path / "nvme"
    directory.mkdir(mode=0o700)
    if not odirect_works(directory):
        pytest.skip(f"{tmp_path} refuses O_DIRECT")
    with NvmeStore.create(directory, PAGE_BYTES, 4, backend="posix") as store:
        assert store.direct_io
        assert fcntl.fcntl(store._file.fileno(), fcntl.F_GETFL) & os.O_DIRECT
        expected = write_patterns(store, [2])
        ok, dests = read_into_sentinels(store, [2])
        assert ok == [True] and dests[0].tobytes() == expected[2]


@pytest.mark.parametrize("where", ["open", "first_read"])
def test_nvme_buffered_fallback_when_odirect_refused(tmp_path, monkeypatch, caplog, where):
    real_open, real_preadv = os.open, os.preadv
    calls = {"preadv": 0}

    def open_refusing_direct(path, flags, *args, **kwargs):
        if where == "open" and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    def preadv_refusing_first(fd, buffers, offset):
        calls["preadv"] += 1
        if where == "first_read" and calls["preadv"] == 1:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(nvme_mod.os, "open", open_refusing_direct)
    monkeypatch.setattr(nvme_mod.os, "preadv", preadv_refusing_first)
    caplog.set_level(logging.WARNING, logger="hiradix.tiers.nvme")
    with NvmeStore.create(tmp_path / "nvme", PAGE_BYTES, 4, backend="posix") as store:
        assert not store.direct_io
        expected = write_patterns(store, [0, 3])
        ok, dests = read_into_sentinels(store, [3, 0])
        assert ok == [True, True]
        assert [d.tobytes() for d in dests] == [expected[3], expected[0]]
    warnings = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize(
    "offset_in_slot, reason",
    [
        (0, "checksum mismatch"),  # first payload byte
        (PAGE_BYTES - 1, "checksum mismatch"),  # last payload byte
        (PAGE_BYTES + 2, "bad magic"),  # inside the magic
        (PAGE_BYTES + TRAILER.size - 1, "checksum mismatch"),  # inside the stored digest
        (PAGE_BYTES + 8, "format version"),
    ],
)
def test_nvme_flipped_byte_is_a_miss(tmp_path, caplog, offset_in_slot, reason):
    with NvmeStore.create(tmp_path / "nvme", PAGE_BYTES, 6) as store:
        expected = write_patterns(store, [1, 2, 4])
        flip_byte(store.path, 2 * store.slot_bytes + offset_in_slot)
        ok, dests = read_into_sentinels(store, [1, 2, 4])
        assert ok == [True, False, True]
        assert dests[0].tobytes() == expected[1] and dests[2].tobytes() == expected[4]
        assert (dests[1] == 0xAB).all()  # the failed slot's destination is untouched
    assert "slot 2" in caplog.text and reason in caplog.text


def test_nvme_truncated_file_is_a_miss(tmp_path, caplog):
    with NvmeStore.create(tmp_path / "nvme", PAGE_BYTES, 6) as store:
        expected = write_patterns(store, [0, 1, 2, 5])
        os.truncate(store.path, 2 * store.slot_bytes + store.slot_bytes // 2)  # slot 2 half gone, 5 gone
        ok, dests = read_into_sentinels(store, [0, 1, 2, 5])
        assert ok == [True, True, False, False]
        assert dests[0].tobytes() == expected[0] and dests[1].tobytes() == expected[1]
        assert (dests[2] == 0xAB).all() and (dests[3] == 0xAB).all()
    assert "short read" in caplog.text
    caplog.clear()
    with NvmeStore.open(store.path, PAGE_BYTES, 6) as reopened:  # attach accepts it, with a warning
        assert "missing slots" in caplog.text
        ok, _ = read_into_sentinels(reopened, [1, 2])
        assert ok == [True, False]


def test_nvme_never_written_and_misplaced_slots_are_misses(tmp_path, caplog):
    with NvmeStore.create(tmp_path / "nvme", PAGE_BYTES, 4) as store:
        write_patterns(store, [1])
        with open(store.path, "r+b") as f:  # copy slot 1's image over slot 3
            f.seek(store.slot_bytes)
            image = f.read(store.slot_bytes)
            f.seek(3 * store.slot_bytes)
            f.write(image)
        ok, dests = read_into_sentinels(store, [0, 3, 1])
        assert ok == [False, False, True]
        assert (dests[0] == 0xAB).all() and (dests[1] == 0xAB).all()
    assert "bad magic" in caplog.text and "trailer names slot 1" in caplog.text


def test_nvme_bad_arguments_raise_and_write_nothing(tmp_path):
    with NvmeStore.create(tmp_path / "nvme", PAGE_BYTES, 4) as store:
        page = memoryview(page_pattern(0))
        with pytest.raises(ValueError, match="out of range"):
            store.write_slots([0, 4], [page, page])
        with pytest.raises(ValueError, match="out of range"):
            store.write_slots([-1], [page])
        with pytest.raises(ValueError, match="repeat"):
            store.write_slots([1, 1], [page, page])
        with pytest.raises(ValueError, match="bytes"):
            store.write_slots([2], [page[:-1]])
        with pytest.raises(ValueError, match="2 slot ids but 1 pages"):
            store.write_slots([2, 3], [page])
        with pytest.raises(ValueError, match="read-only"):
            store.read_slots([0], [memoryview(bytes(PAGE_BYTES))])
        ok, _ = read_into_sentinels(store, [0, 1, 2])
        assert ok == [False, False, False]  # none of the rejected writes reached the file


def test_nvme_store_attached_by_second_handle(tmp_path):
    with NvmeStore.create(tmp_path / "nvme", PAGE_BYTES, 4, threads=2) as writer:
        expected = write_patterns(writer, [3, 1])
        with NvmeStore.open(writer.path, PAGE_BYTES, 4, backend="posix", threads=1) as reader:
            ok, dests = read_into_sentinels(reader, [1, 3])
            assert ok == [True, True] and [d.tobytes() for d in dests] == [expected[1], expected[3]]
        with pytest.raises(FileNotFoundError):
            NvmeStore.open(tmp_path / "missing.kv", PAGE_BYTES, 4)


def test_nvme_dram_round_trip(tmp_path):
    """DRAM page -> NVMe slot -> another DRAM page, through DramPool.page_view (the worker's path)."""
    with DramPool.create(LAYOUT, 4, tmp_path / "dram") as pool, NvmeStore.create(tmp_path / "nvme", PAGE_BYTES, 8) as store:
        gen = torch.Generator().manual_seed(3)
        pool.tensor[:2].copy_(torch.randn(pool.tensor[:2].shape, generator=gen).bfloat16())
        assert store.write_slots([5, 6], [pool.page_view(0), pool.page_view(1)]) == [True, True]
        assert store.read_slots([6, 5], [pool.page_view(2), pool.page_view(3)]) == [True, True]
        assert torch.equal(pool.tensor[2], pool.tensor[1]) and torch.equal(pool.tensor[3], pool.tensor[0])


def test_nvme_backend_selection(tmp_path):
    with pytest.raises(ValueError, match="auto, posix, kvikio"):
        NvmeStore.create(tmp_path / "a", PAGE_BYTES, 2, backend="spdk")
    reason = kvikio_unusable_reason()
    if reason is not None:
        with NvmeStore.create(tmp_path / "b", PAGE_BYTES, 2, backend="auto") as store:
            assert store.name == "posix"  # auto falls back where KvikIO cannot run
        with pytest.raises(RuntimeError, match="kvikio"):
            NvmeStore.create(tmp_path / "c", PAGE_BYTES, 2, backend="kvikio")


@pytest.mark.gpu
@pytest.mark.skipif(
    kvikio_unusable_reason() is not None,
    reason=f"KvikIO backend needs kvikio-cu13 (pip install '.[gpu]') and a CUDA driver/device: {kvikio_unusable_reason()}",
)
def test_nvme_kvikio_round_trip_and_corruption(tmp_path):
    with NvmeStore.create(tmp_path / "nvme", PAGE_BYTES, 8, backend="kvikio") as store:
        assert store.name == "kvikio"
        expected = write_patterns(store, [0, 5, 7])
        ok, dests = read_into_sentinels(store, [7, 5, 0])
        assert ok == [True, True, True]
        assert [d.tobytes() for d in dests] == [expected[7], expected[5], expected[0]]
        flip_byte(store.path, 5 * store.slot_bytes + 100)
        ok, dests = read_into_sentinels(store, [5])
        assert ok == [False] and (dests[0] == 0xAB).all()


def test_nvme_dir_lock_refuses_a_second_server(tmp_path):
    from hiradix.tiers.files import lock_dir as _lock_nvme_dir

    fd = _lock_nvme_dir(tmp_path / "hiradix-rank0")
    try:
        with pytest.raises(RuntimeError, match="in use by another server"):
            _lock_nvme_dir(tmp_path / "hiradix-rank0")
    finally:
        os.close(fd)
    os.close(_lock_nvme_dir(tmp_path / "hiradix-rank0"))  # free again once released
