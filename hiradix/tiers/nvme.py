"""The NVMe tier: one pre-allocated file of fixed-size slots, aligned direct I/O, a checksum per slot.

Slot ``s`` occupies bytes ``[s * slot_bytes, (s + 1) * slot_bytes)`` of ``<directory>/nvme.kv``::

    | payload (page_bytes) | trailer (40 B) | zero padding to a multiple of SLOT_ALIGN |

The trailer (:data:`TRAILER`, little-endian) holds a magic, the format version, the payload
length, the slot id and ``xxhash.xxh3_64`` of the payload. A read copies a slot into the caller's
page only when all of them check out; otherwise that slot is a miss (``False``, logged), so a
flipped bit, a torn or never-written slot, a truncated file or a slot written by another layout
is recomputed, never served as wrong KV. The role of SGLang's ``HiCacheFile``
(``mem_cache/hicache_storage.py``), but one pre-allocated file addressed by slot id (the tree
records the slot), not one file per page hash.

Two backends implement the block I/O under :class:`NvmeStore`:

- ``posix``: ``O_DIRECT`` + ``os.preadv``/``os.pwritev`` from page-aligned anonymous-``mmap``
  bounce buffers on a ``ThreadPoolExecutor``; buffered I/O (one warning) where the file system
  refuses ``O_DIRECT``.
- ``kvikio``: KvikIO's ``CuFile`` (GPUDirect Storage where available, its POSIX compatibility
  mode otherwise); imported lazily, only where ``import kvikio`` works and a CUDA device exists.
  These reads and writes go through host bounce buffers (the DRAM tier is host memory).

:meth:`NvmeStore.read_slots_to_device` reads slots into device memory instead (NVMe -> HBM,
:mod:`hiradix.tiers.nvme_device`: KvikIO where GPUDirect Storage is present, POSIX otherwise);
``scripts/gpu_check`` uses it; the serving path does not (yet).

Data movement only; which slots are free is :class:`hiradix.core.allocator.PageAllocator`'s.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import stat
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from hiradix.tiers.checksum import TRAILER, pack_trailer, verify_slot  # noqa: F401 - re-exported
from hiradix.tiers.files import ensure_private_dir

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SLOT_ALIGN = 4096  # bytes; O_DIRECT offset, length and buffer alignment (>= logical block size)
NVME_FILE_NAME = "nvme.kv"
BACKENDS = ("auto", "posix", "kvikio")
COALESCE_BYTES = 4 << 20  # longest single read/write of consecutive slots


def align_up(num_bytes: int, alignment: int = SLOT_ALIGN) -> int:
    """Smallest multiple of ``alignment`` that is ``>= num_bytes``."""
    return -(-num_bytes // alignment) * alignment


def slot_bytes_for(page_bytes: int) -> int:
    """Bytes of one slot holding a ``page_bytes`` payload and its trailer, 4096-aligned."""
    return align_up(page_bytes + TRAILER.size)


@runtime_checkable
class NvmeIO(Protocol):
    """Batched slot I/O: the one interface the I/O worker uses (both backends implement it)."""

    name: str

    def write_slots(self, slot_ids: list[int], pages: list[memoryview]) -> list[bool]:
        """Write ``pages[i]`` (``page_bytes`` each) into ``slot_ids[i]``; ``False`` = failed."""
        ...

    def read_slots(self, slot_ids: list[int], pages: list[memoryview]) -> list[bool]:
        """Read and verify ``slot_ids[i]`` into ``pages[i]``; ``False`` = miss, ``pages[i]`` untouched."""
        ...

    def close(self) -> None:
        """Wait for nothing further and release the file and threads."""
        ...


class _PosixFile:
    """Block I/O on one file with ``O_DIRECT`` (buffered where the file system refuses it)."""

    name = "posix"

    def __init__(self, path: Path, warn_fallback: bool = True):
        self.direct_io = True  # False after falling back to buffered I/O
        self._fd = -1  # the open file; -1 once closed
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC)
            self._probe()
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                self.close()
                raise
            self.close()
            log = logger.warning if warn_fallback else logger.info
            log("%s: file system refuses O_DIRECT (%s); using buffered I/O", path, exc)
            self.direct_io = False
            self._fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)

    def _probe(self) -> None:
        """Read one aligned block: some file systems accept ``O_DIRECT`` at open, fail at I/O."""
        probe = mmap.mmap(-1, SLOT_ALIGN)
        try:
            os.preadv(self._fd, [probe], 0)
        finally:
            probe.close()

    def fileno(self) -> int:
        return self._fd

    def pwrite(self, buf: memoryview, offset: int) -> int:
        """Write all of ``buf`` at ``offset``; returns bytes written."""
        done = 0
        while done < len(buf):
            n = os.pwritev(self._fd, [buf[done:]], offset + done)
            if n <= 0:
                break
            done += n
        return done

    def pread(self, buf: memoryview, offset: int) -> int:
        """Fill ``buf`` from ``offset``; returns bytes read (short at end of file)."""
        done = 0
        while done < len(buf):
            n = os.preadv(self._fd, [buf[done:]], offset + done)
            if n <= 0:
                break
            done += n
        return done

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _KvikioFile:
    """Block I/O through KvikIO's ``CuFile`` (GDS or KvikIO's own POSIX thread pool)."""

    name = "kvikio"
    direct_io = True  # KvikIO decides per request (GDS / its O_DIRECT handle, else its buffered one)

    def __init__(self, path: Path):
        import kvikio  # noqa: PLC0415 - optional GPU extra, needs libcuda.so.1

        self._file = kvikio.CuFile(path, "r+")

    def pwrite(self, buf: memoryview, offset: int) -> int:
        return int(self._file.pwrite(np.frombuffer(buf, dtype=np.uint8), len(buf), offset).get())

    def pread(self, buf: memoryview, offset: int) -> int:
        return int(self._file.pread(np.frombuffer(buf, dtype=np.uint8), len(buf), offset).get())

    def close(self) -> None:
        self._file.close()


def kvikio_unusable_reason() -> str | None:
    """Why the ``kvikio`` backend cannot be used here, or ``None`` if it can."""
    try:
        import kvikio  # noqa: F401, PLC0415
    except Exception as exc:  # ImportError, or OSError when libcuda.so.1 is missing
        return f"import kvikio failed: {exc}"
    try:
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():
            return "no CUDA device"
    except Exception as exc:
        return f"CUDA probe failed: {exc}"
    return None


def _open_backend(path: Path, backend: str, warn_fallback: bool = True) -> _PosixFile | _KvikioFile:
    if backend not in BACKENDS:
        raise ValueError(f"unknown NVMe backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "posix":
        return _PosixFile(path, warn_fallback)
    reason = kvikio_unusable_reason()
    if reason is None:
        return _KvikioFile(path)
    if backend == "kvikio":
        raise RuntimeError(f"NVMe backend 'kvikio' is not usable here: {reason}")
    logger.info("NVMe backend: posix (kvikio not usable: %s)", reason)
    return _PosixFile(path, warn_fallback)


class NvmeStore:
    """``num_slots`` fixed-size page slots in one file; implements :class:`NvmeIO`.

    Build with :meth:`create` (pre-allocates) or :meth:`open` (attaches, e.g. in the I/O worker).
    ``write_slots``/``read_slots`` are thread-safe (callers must not write a slot that another
    call is reading or writing); the slots of one call run in parallel on ``threads`` threads.
    Consecutive slot ids are coalesced into runs of up to ``run_slots`` (``COALESCE_BYTES`` of
    slots, split so every thread gets one), each moved by one call through one of ``threads``
    page-aligned bounce buffers; each slot of a run is still verified on its own.

    Attributes:
        path: the slot file.
        page_bytes: payload bytes per slot (``KVLayout.page_bytes``).
        slot_bytes: ``align_up(page_bytes + TRAILER.size, SLOT_ALIGN)``.
        num_slots: capacity in slots.
        name: backend name, ``"posix"`` or ``"kvikio"`` (also as ``backend``).
        direct_io: whether the posix backend bypasses the page cache (``O_DIRECT``).
    """

    def __init__(self, path: Path, page_bytes: int, num_slots: int, file: _PosixFile | _KvikioFile, threads: int):
        """Use :meth:`create` or :meth:`open`."""
        if page_bytes < 1 or num_slots < 1 or threads < 1:
            raise ValueError(f"page_bytes {page_bytes}, num_slots {num_slots}, threads {threads} must be >= 1")
        self.path = Path(path)
        self.page_bytes = page_bytes
        self.slot_bytes = slot_bytes_for(page_bytes)
        self.num_slots = num_slots
        self.name = file.name
        self.direct_io = file.direct_io
        self._file = file
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hiradix-nvme")
        # Page-aligned anonymous mappings, zero-filled; one per thread in flight. MAP_POPULATE
        # faults each buffer in at once, so its pages are physically contiguous runs rather
        # than 4 KiB pieces scattered by concurrent first touches: a 2 MiB O_DIRECT read is
        # then ~1 block request instead of ~4 (bench/micro/tier_io.py: store reads 0.46 -> 0.88 of raw).
        self._bounce: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        # A run of consecutive slots moves in one call of up to COALESCE_BYTES (fewer syscalls,
        # thread hand-offs and block requests per byte for small pages).
        self.run_slots = max(1, COALESCE_BYTES // self.slot_bytes)
        self.threads = threads
        self._bounce_all = [mmap.mmap(-1, self.run_slots * self.slot_bytes, flags=flags) for _ in range(threads)]
        for buf in self._bounce_all:
            self._bounce.put(buf)
        self._device_reader = None  # nvme_device.DeviceSlotReader, made by read_slots_to_device

    @property
    def backend(self) -> str:
        """Backend name (same as ``name``)."""
        return self.name

    def wrap_file(self, wrap: Callable[[_PosixFile | _KvikioFile], _PosixFile | _KvikioFile]) -> None:
        """Test seam (fault injection, :mod:`hiradix.io.faults`): replace the block-I/O object
        with ``wrap(current)``, which offers the same ``pread``/``pwrite``/``close``. Call it
        before any I/O."""
        self._file = wrap(self._file)

    @classmethod
    def create(
        cls, directory: Path, page_bytes: int, num_slots: int, backend: str = "auto", threads: int = 4,
        keep: bool = False,
    ) -> NvmeStore:
        """Create (or replace) ``directory/nvme.kv`` with mode 0600 and pre-allocate all slots.

        With ``keep``, an existing file keeps its slots (restart persistence: the NVMe index
        vouched for them); it is only grown or cut to ``num_slots``.

        Args:
            directory: private directory (created 0700 if missing) on the NVMe file system.
            page_bytes: payload bytes per slot.
            num_slots: capacity in slots.
            backend: ``"auto"`` (kvikio if usable, else posix), ``"posix"`` or ``"kvikio"``.
            threads: I/O threads (and bounce buffers of ``slot_bytes``).

        Raises:
            ValueError: unknown backend or a non-positive size.
            PermissionError: ``directory`` is not private (see ``ensure_private_dir``).
            RuntimeError: ``backend="kvikio"`` where KvikIO is not usable.
            OSError: the file system cannot hold ``num_slots * slot_bytes`` bytes.
        """
        if page_bytes < 1 or num_slots < 1:
            raise ValueError(f"page_bytes {page_bytes} and num_slots {num_slots} must be >= 1")
        if backend not in BACKENDS:
            raise ValueError(f"unknown NVMe backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        directory, _ = ensure_private_dir(Path(directory))
        path = directory / NVME_FILE_NAME
        size_bytes = num_slots * slot_bytes_for(page_bytes)
        truncate = 0 if keep else os.O_TRUNC
        fd = os.open(path, os.O_RDWR | os.O_CREAT | truncate | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            if os.fstat(fd).st_size > size_bytes:
                os.ftruncate(fd, size_bytes)
            os.posix_fallocate(fd, 0, size_bytes)
        finally:
            os.close(fd)
        store = cls(path, page_bytes, num_slots, _open_backend(path, backend), threads)
        logger.info("NVMe tier: %d slots x %d bytes at %s (%s, direct_io=%s)",
                    num_slots, store.slot_bytes, path, store.name, store.direct_io)
        return store

    @classmethod
    def open(
        cls, path: Path, page_bytes: int, num_slots: int, backend: str = "auto", threads: int = 4,
        warn_fallback: bool = True,
    ) -> NvmeStore:
        """Attach an existing slot file (e.g. from the I/O worker process).

        A file shorter than ``num_slots * slot_bytes`` is accepted with a warning: reads of the
        missing slots are misses. ``warn_fallback=False`` logs a buffered-I/O fallback at INFO
        (the I/O worker: the scheduler already warned when it created the file).

        Raises:
            FileNotFoundError: no such file.
            PermissionError: the file is group/world accessible or owned by another user.
            ValueError, RuntimeError: as for :meth:`create`.
        """
        path = Path(path)
        st = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PermissionError(f"{path}: mode {stat.S_IMODE(st.st_mode):04o} uid {st.st_uid}; expected a 0600 file of ours")
        expected = num_slots * slot_bytes_for(page_bytes)
        if st.st_size < expected:
            logger.warning("%s: %d bytes, expected %d; missing slots will read as misses", path, st.st_size, expected)
        return cls(path, page_bytes, num_slots, _open_backend(path, backend, warn_fallback), threads)

    def _check_args(self, slot_ids: Sequence[int], pages: Sequence[memoryview], writing: bool) -> list[int]:
        if len(slot_ids) != len(pages):
            raise ValueError(f"{len(slot_ids)} slot ids but {len(pages)} pages")
        ids = [int(slot_id) for slot_id in slot_ids]
        for slot_id, page in zip(ids, pages):
            if not 0 <= slot_id < self.num_slots:
                raise ValueError(f"slot {slot_id} out of range [0, {self.num_slots})")
            view = memoryview(page)
            if view.nbytes != self.page_bytes or not view.c_contiguous:
                raise ValueError(f"page for slot {slot_id}: {view.nbytes} bytes, expected {self.page_bytes} contiguous")
            if not writing and view.readonly:
                raise ValueError(f"page for slot {slot_id} is read-only")
        if writing and len(set(ids)) != len(ids):
            raise ValueError(f"slot ids repeat in one write: {ids}")
        return ids

    def _runs(self, ids: list[int]) -> list[list[int]]:
        """Indices into ``ids`` grouped into runs of consecutive slot ids, at most
        ``run_slots`` long and short enough that every thread gets a run."""
        longest = max(1, min(self.run_slots, -(-len(ids) // self.threads)))
        runs: list[list[int]] = []
        for i, slot_id in enumerate(ids):
            run = runs[-1] if runs else None
            if run and len(run) < longest and ids[run[-1]] + 1 == slot_id:
                run.append(i)
            else:
                runs.append([i])
        return runs

    def _run(self, task: Callable[[list[int], list[memoryview]], list[str | None]], ids: list[int],
             pages: Sequence[memoryview], verb: str) -> list[bool]:
        runs = self._runs(ids)
        per_run = self._executor.map(task, [[ids[i] for i in run] for run in runs], [[pages[i] for i in run] for run in runs])
        reasons: list[str | None] = [None] * len(ids)
        for run, run_reasons in zip(runs, per_run):
            for i, reason in zip(run, run_reasons):
                reasons[i] = reason
        failed = [f"slot {slot_id}: {reason}" for slot_id, reason in zip(ids, reasons) if reason]
        if failed:
            logger.warning("NVMe %s: %d of %d slots failed in %s: %s", verb, len(failed), len(ids), self.path, "; ".join(failed))
        return [reason is None for reason in reasons]

    def write_slots(self, slot_ids: list[int], pages: list[memoryview]) -> list[bool]:
        """Write ``pages[i]`` with its trailer into slot ``slot_ids[i]``, in parallel.

        Args:
            slot_ids: distinct slot ids in ``[0, num_slots)``.
            pages: buffers of exactly ``page_bytes`` contiguous bytes (e.g. ``DramPool.page_view``).

        Returns:
            Per slot, ``True`` when the whole slot reached the file (I/O errors are logged as ``False``).

        Raises:
            ValueError: a slot out of range, repeated, or a page of the wrong size (nothing written).
        """
        ids = self._check_args(slot_ids, pages, writing=True)
        return self._run(self._write_run, ids, pages, "write")

    def read_slots(self, slot_ids: list[int], pages: list[memoryview]) -> list[bool]:
        """Read slot ``slot_ids[i]``, verify its trailer, and only then copy it into ``pages[i]``.

        Args:
            slot_ids: slot ids in ``[0, num_slots)``.
            pages: writable buffers of exactly ``page_bytes`` contiguous bytes.

        Returns:
            Per slot, ``True`` when ``pages[i]`` now holds the slot's payload; ``False`` (a miss,
            logged) on a short read, an I/O error, a bad magic/version/length/slot id or a
            checksum mismatch, and then ``pages[i]`` is unchanged.

        Raises:
            ValueError: a slot out of range, or a page of the wrong size or read-only.
        """
        ids = self._check_args(slot_ids, pages, writing=False)
        return self._run(self._read_run, ids, pages, "read")

    def _write_run(self, slot_ids: list[int], pages: list[memoryview]) -> list[str | None]:
        """Write consecutive slots with their trailers in one call."""
        buf = self._bounce.get()
        size = len(slot_ids) * self.slot_bytes
        try:
            image = np.frombuffer(buf, dtype=np.uint8, count=size)
            for k, (slot_id, page) in enumerate(zip(slot_ids, pages)):
                base = k * self.slot_bytes
                payload = image[base : base + self.page_bytes]
                payload[:] = np.frombuffer(page, dtype=np.uint8)
                image[base + self.page_bytes : base + self.page_bytes + TRAILER.size] = np.frombuffer(
                    pack_trailer(payload, slot_id), dtype=np.uint8
                )
            written = self._file.pwrite(memoryview(buf)[:size], slot_ids[0] * self.slot_bytes)
            return [None if written >= (k + 1) * self.slot_bytes else f"short write ({written} of {size} bytes)"
                    for k in range(len(slot_ids))]
        except OSError as exc:
            return [f"write error: {exc}"] * len(slot_ids)
        finally:
            self._bounce.put(buf)

    def _read_run(self, slot_ids: list[int], pages: list[memoryview]) -> list[str | None]:
        """Read consecutive slots in one call; verify each, copy out only the good ones."""
        buf = self._bounce.get()
        size = len(slot_ids) * self.slot_bytes
        try:
            got = self._file.pread(memoryview(buf)[:size], slot_ids[0] * self.slot_bytes)
            image = np.frombuffer(buf, dtype=np.uint8, count=size)
            reasons: list[str | None] = []
            for k, (slot_id, page) in enumerate(zip(slot_ids, pages)):
                if got < (k + 1) * self.slot_bytes:
                    reasons.append(f"short read ({got} of {size} bytes; file truncated?)")
                    continue
                slot = image[k * self.slot_bytes : (k + 1) * self.slot_bytes]
                reason = verify_slot(slot, self.page_bytes, slot_id)
                if reason is None:
                    np.frombuffer(page, dtype=np.uint8)[:] = slot[: self.page_bytes]
                reasons.append(reason)
            return reasons
        except OSError as exc:
            return [f"read error: {exc}"] * len(slot_ids)
        finally:
            self._bounce.put(buf)

    def read_slots_to_device(self, slot_ids: list[int], dst: torch.Tensor, path: str | None = None) -> list[bool]:
        """Read and verify slots into the rows of a device tensor (NVMe -> HBM).

        Args:
            slot_ids: slot ids in ``[0, num_slots)``.
            dst: uint8 ``(len(slot_ids), page_bytes)`` with contiguous rows, on a CUDA device
                (a CPU tensor runs the POSIX path).
            path: ``"kvikio"`` or ``"posix"`` to force one; None: KvikIO where GPUDirect
                Storage is present, else POSIX (:func:`hiradix.tiers.nvme_device.choose_device_read_path`).
                Fixed by the first call (the reader is kept until :meth:`close`).

        Returns:
            Per slot, True when ``dst[i]`` holds the verified payload; False (a miss) leaves
            ``dst[i]`` unchanged.

        Raises:
            ValueError: a slot out of range, or ``dst`` of the wrong shape, dtype or device.
            RuntimeError: ``path="kvikio"`` where KvikIO is not usable.
        """
        from hiradix.tiers.nvme_device import DeviceSlotReader  # noqa: PLC0415 - torch only when used

        reader = self._device_reader
        if reader is None or reader.device != dst.device or (path is not None and reader.path != path):
            if reader is not None:
                reader.close()
            reader = self._device_reader = DeviceSlotReader(self, dst.device, path)
        return reader.read(slot_ids, dst)

    def close(self) -> None:
        """Finish queued I/O, stop the threads, close the file; idempotent."""
        if self._device_reader is not None:
            self._device_reader.close()
            self._device_reader = None
        if self._file is None:
            return
        self._executor.shutdown(wait=True)
        self._file.close()
        self._file = None  # type: ignore[assignment]
        for buf in self._bounce_all:
            buf.close()
        self._bounce_all = []

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NvmeStore({self.path}, slots={self.num_slots}, slot_bytes={self.slot_bytes}, backend={self.name})"
