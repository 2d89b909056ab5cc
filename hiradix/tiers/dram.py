"""The DRAM tier: one shared-memory file mapped by the scheduler and by the I/O worker.

The scheduler process creates ``<directory>/dram.kv`` (by default on ``/dev/shm``, tmpfs) and
maps it ``MAP_SHARED``; the I/O worker process attaches the same file, so a page moves between
DRAM and NVMe without crossing the ZMQ socket: only page ids do. The role of SGLang's
``MHATokenToKVPoolHost`` with ``allocator_type="shm"`` (``pool_host/mha.py``,
``storage/mmap/mmap_allocator.py``), but file-backed so a second process finds it by path.

Security: the KV of other users' prompts lives here, so the directory must be private
(``0700``, owned by this user, not a symlink) and the file is created ``0600``.

Data movement only; which pages are free is :class:`hiradix.core.allocator.PageAllocator`'s.
"""

from __future__ import annotations

import logging
import mmap
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from hiradix.tiers.files import ensure_private_dir
from hiradix.tiers.pinned import cuda_host_register, cuda_host_unregister
from hiradix.tiers.store.base import buffer_address

if TYPE_CHECKING:  # torch only where a tensor view is asked for (the I/O worker never asks)
    import torch

    from hiradix.dataplane.layout import KVLayout

logger = logging.getLogger(__name__)

DRAM_FILE_NAME = "dram.kv"


def num_pages_for_bytes(dram_bytes: int, layout: KVLayout, page_bytes: int | None = None) -> int:
    """Whole pages that fit in a DRAM budget (rounded down).

    Args:
        dram_bytes: DRAM budget in bytes (``--hiradix-dram-gb`` x 1e9).
        layout: the page layout (``layout.page_bytes`` per page).
        page_bytes: bytes per DRAM page when it holds encoded pages (DRAM as a cold tier,
            ``PageCodec.encoded_bytes``); None: ``layout.page_bytes``.

    Raises:
        ValueError: the budget holds no page at all.
    """
    size = _page_bytes(layout, page_bytes)
    num_pages = int(dram_bytes) // size
    if num_pages < 1:
        raise ValueError(f"DRAM budget {dram_bytes} bytes holds no page of {size} bytes")
    return num_pages


def _page_bytes(layout: KVLayout | None, page_bytes: int | None) -> int:
    """Bytes per page: ``page_bytes`` if given, else the layout's (one of the two is needed)."""
    if page_bytes:
        return page_bytes
    if layout is None:
        raise ValueError("a DRAM pool of opaque pages (layout None) needs page_bytes")
    return layout.page_bytes


class DramPool:
    """``num_pages`` KV pages in a shared mapping, viewed as one tensor.

    Build with :meth:`create` (owner process) or :meth:`attach` (other processes). The I/O
    worker attaches with ``layout=None``: it moves whole pages as bytes and never imports torch.

    Attributes:
        path: the backing file.
        layout: page layout (of the KV the pages hold); None: opaque pages of ``page_bytes``.
        num_pages: capacity in pages.
        page_bytes: bytes per page: ``layout.page_bytes``, or the encoded size when the pool holds
            encoded pages (DRAM as a cold tier, :mod:`hiradix.dataplane.kv_codec`).
        encoded: whether the pool holds encoded pages (``page_bytes != layout.page_bytes``).
        tensor: ``layout.dram_shape(num_pages)`` of ``layout.dtype``, a view of the mapping
            (writes are seen by every process that maps the file); uint8 ``(num_pages,
            page_bytes)`` for encoded or opaque pages. Made (and torch imported) on first use;
            None once closed.
        address: the mapping's first byte (for a transfer engine's memory registration).
        cuda_pinned: whether :meth:`pin_for_cuda` registered the mapping with CUDA.
        pin_failure: why :meth:`pin_for_cuda` failed, or None.
    """

    def __init__(self, path: Path, layout: KVLayout | None, num_pages: int, mapping: mmap.mmap, created_dir: bool,
                 page_bytes: int | None = None):
        """Use :meth:`create` or :meth:`attach`; this wraps an existing mapping."""
        self.page_bytes = _page_bytes(layout, page_bytes)
        assert len(mapping) == num_pages * self.page_bytes, "mapping size != num_pages * page_bytes"
        self.path = Path(path)
        self.layout = layout
        self.num_pages = num_pages
        self._mmap: mmap.mmap | None = mapping
        self._view = memoryview(mapping)
        self._created_dir = created_dir
        self._memfd = -1  # the anonymous pool's file descriptor (create_anonymous), kept open
        self._tensor: torch.Tensor | None = None  # made by `tensor` on first use
        self._pinned_ptr = 0  # start of the range registered with CUDA; 0 when pageable
        self.pin_failure: str | None = None  # why pin_for_cuda failed (it is not tried again)

    @property
    def encoded(self) -> bool:
        """Whether the pages are encoded (another size than the layout's page)."""
        return self.layout is not None and self.page_bytes != self.layout.page_bytes

    @property
    def tensor(self) -> torch.Tensor | None:
        """The mapping as one tensor (see the class doc); None once closed."""
        if self._tensor is None and self._mmap is not None:
            import torch  # noqa: PLC0415 - only the scheduler's processes view the pool as a tensor

            if self.layout is None or self.encoded:
                self._tensor = torch.frombuffer(self._mmap, dtype=torch.uint8).view(self.num_pages, self.page_bytes)
            else:
                self._tensor = torch.frombuffer(self._mmap, dtype=self.layout.dtype).view(self.layout.dram_shape(self.num_pages))
        return self._tensor

    @property
    def address(self) -> int:
        """Address of the mapping's first byte (the pool stays mapped while this object is open)."""
        return buffer_address(self._view)

    @property
    def dram_bytes(self) -> int:
        """Size of the mapping in bytes (``num_pages * page_bytes``)."""
        return self.num_pages * self.page_bytes

    @property
    def cuda_pinned(self) -> bool:
        """Whether the mapping is registered with CUDA (page-locked, DMA-able)."""
        return self._pinned_ptr != 0

    def pin_for_cuda(self) -> bool:
        """Page-lock the whole mapping for CUDA (``cudaHostRegister``); idempotent.

        Only this process's view is registered (the I/O worker maps the same pages and needs no
        CUDA). Undone by :meth:`close`, before the mapping is unmapped. A failure (no CUDA, the
        driver refused, not enough lockable memory) leaves the pool pageable, with one warning:
        copies stay correct, only slower (see ``hiradix.dataplane.device_copy``).

        Returns:
            True when the mapping is pinned.
        """
        if self._pinned_ptr or self._mmap is None or self.pin_failure is not None:
            return self._pinned_ptr != 0
        ptr = self.tensor.data_ptr()
        reason = cuda_host_register(ptr, self.dram_bytes)
        if reason is not None:
            self.pin_failure = reason
            logger.warning("DRAM tier %s stays pageable (%d bytes not pinned): %s; DRAM <-> HBM copies "
                           "are staged by the CPU", self.path, self.dram_bytes, reason)
            return False
        self._pinned_ptr = ptr
        logger.info("DRAM tier %s: %d bytes pinned for CUDA", self.path, self.dram_bytes)
        return True

    def _unpin(self) -> None:
        """Undo :meth:`pin_for_cuda` (before the mapping goes away)."""
        if not self._pinned_ptr:
            return
        ptr, self._pinned_ptr = self._pinned_ptr, 0
        reason = cuda_host_unregister(ptr)
        if reason is not None:
            logger.warning("DRAM tier %s: %s", self.path, reason)

    @classmethod
    def create_anonymous(cls, layout: KVLayout, num_pages: int, page_bytes: int | None = None) -> DramPool:
        """Create the pool in an anonymous memory file (``memfd_create``), reserved and mapped.

        Nothing is left behind when the owner exits, even when it is killed: the memory goes
        when the last process unmaps it. Other processes of this user attach through
        ``path`` = ``/proc/<pid>/fd/<fd>`` while the owner keeps the pool open.

        Raises:
            ValueError: ``num_pages < 1``.
            OSError: not enough memory for ``num_pages * page_bytes`` bytes.
        """
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        page_bytes = _page_bytes(layout, page_bytes)
        size_bytes = num_pages * page_bytes
        fd = os.memfd_create("hiradix-dram", os.MFD_CLOEXEC)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size_bytes)
            try:
                os.posix_fallocate(fd, 0, size_bytes)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot reserve {size_bytes} bytes for the DRAM tier: {exc.strerror}") from exc
            mapping = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        pool = cls(Path(f"/proc/{os.getpid()}/fd/{fd}"), layout, num_pages, mapping, created_dir=False,
                   page_bytes=page_bytes)
        pool._memfd = fd
        logger.info("DRAM tier: %d pages x %d bytes in anonymous memory %s", num_pages, page_bytes, pool.path)
        return pool

    @classmethod
    def create(cls, layout: KVLayout, num_pages: int, directory: Path, page_bytes: int | None = None) -> DramPool:
        """Create (or replace) ``directory/dram.kv``, reserve its memory, and map it.

        The file is ``posix_fallocate``d so a tmpfs that is too small fails here, with
        ``ENOSPC``, instead of with ``SIGBUS`` at the first touch of a page.

        Args:
            layout: page layout.
            num_pages: capacity in pages (``>= 1``); see :func:`num_pages_for_bytes`.
            directory: private directory (created 0700 if missing), e.g. :func:`default_shm_dir`.
            page_bytes: bytes per page of an encoded pool (DRAM as a cold tier); None: ``layout.page_bytes``.

        Raises:
            ValueError: ``num_pages < 1``.
            PermissionError: ``directory`` is not private (see :func:`ensure_private_dir`).
            OSError: the file system cannot hold ``num_pages * page_bytes`` bytes.
        """
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        directory, created_dir = ensure_private_dir(Path(directory))
        path = directory / DRAM_FILE_NAME
        page_bytes = _page_bytes(layout, page_bytes)
        size_bytes = num_pages * page_bytes
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)
            try:
                os.posix_fallocate(fd, 0, size_bytes)
            except OSError as exc:
                os.unlink(path)
                raise OSError(exc.errno, f"cannot reserve {size_bytes} bytes for the DRAM tier in {directory}: {exc.strerror}") from exc
            mapping = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        logger.info("DRAM tier: %d pages x %d bytes at %s", num_pages, page_bytes, path)
        return cls(path, layout, num_pages, mapping, created_dir, page_bytes=page_bytes)

    @classmethod
    def attach(cls, path: Path, layout: KVLayout | None, num_pages: int, page_bytes: int | None = None) -> DramPool:
        """Map an existing pool file (in the I/O worker process); ``page_bytes`` as in :meth:`create`.

        With ``layout=None`` the pool holds opaque pages of ``page_bytes`` (required then), the
        pages of a page-major layout: :meth:`page_view` works, :meth:`layer_page_view` does not.

        Raises:
            FileNotFoundError: no such file.
            PermissionError: the file is group/world accessible or owned by another user.
            ValueError: its size is not ``num_pages * page_bytes``.
        """
        page_bytes = _page_bytes(layout, page_bytes)
        path = Path(path)
        # /proc/<pid>/fd/<n> (an anonymous pool) is a magic link: it must be followed.
        follow = 0 if path.parts[:2] == ("/", "proc") else os.O_NOFOLLOW
        fd = os.open(path, os.O_RDWR | follow | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise PermissionError(f"{path}: mode {stat.S_IMODE(st.st_mode):04o} uid {st.st_uid}; expected 0600, ours")
            size_bytes = num_pages * page_bytes
            if st.st_size != size_bytes or size_bytes == 0:
                raise ValueError(f"{path} has {st.st_size} bytes, expected {num_pages} pages x {page_bytes}")
            mapping = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(path, layout, num_pages, mapping, created_dir=False, page_bytes=page_bytes)

    def _check_page(self, page_id: int) -> None:
        if not 0 <= page_id < self.num_pages:
            raise ValueError(f"page id {page_id} out of range [0, {self.num_pages})")

    def page_view(self, page_id: int) -> memoryview:
        """The ``page_bytes`` contiguous bytes of one page, all layers (page-major only).

        Raises:
            ValueError: ``page_id`` out of range, or a layer-major pool (a page is then
                ``num_layers`` extents; use :meth:`layer_page_view`).
        """
        if self.layout is not None and not self.layout.page_major:
            raise ValueError("page_view needs a page-major pool; use layer_page_view per layer")
        self._check_page(page_id)
        start = page_id * self.page_bytes
        return self._view[start : start + self.page_bytes]

    def layer_page_view(self, layer: int, page_id: int) -> memoryview:
        """The ``layout.layer_page_bytes`` contiguous bytes of one layer of one page.

        Holds K then V: ``[2, page_size, num_kv_heads, head_dim]`` of ``layout.dtype``.

        Raises:
            ValueError: ``layer`` or ``page_id`` out of range, or an encoded pool (no layer extents).
        """
        if self.layout is None or self.encoded:
            raise ValueError("an encoded or opaque DRAM pool has no per-layer extents; use page_view")
        self._check_page(page_id)
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.layout.num_layers})")
        if self.layout.page_major:
            index = page_id * self.layout.num_layers + layer
        else:
            index = layer * self.num_pages + page_id
        start = index * self.layout.layer_page_bytes
        return self._view[start : start + self.layout.layer_page_bytes]

    def close(self) -> None:
        """Drop this object's references to the mapping; idempotent.

        Views handed out earlier (``tensor``, ``page_view``) keep the mapping alive until they
        are collected; the memory is unmapped when the last one goes. A CUDA registration is
        undone first, so no mapping is ever unmapped while registered.
        """
        self._unpin()
        if self._memfd >= 0:
            os.close(self._memfd)
            self._memfd = -1
        if self._mmap is None:
            return
        mapping, self._mmap = self._mmap, None
        self._tensor = None
        try:
            self._view.release()
            mapping.close()
        except BufferError:
            logger.debug("DRAM pool %s: views still alive; unmapped when they are collected", self.path)

    def unlink(self) -> None:
        """Remove the backing file (and the directory if :meth:`create` made it and it is empty)."""
        if self.path.parts[:2] == ("/", "proc"):
            return  # anonymous: nothing to remove
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._created_dir:
            try:
                os.rmdir(self.path.parent)
            except OSError:
                pass

    def __enter__(self) -> DramPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DramPool({self.path}, pages={self.num_pages}, page_bytes={self.page_bytes})"
