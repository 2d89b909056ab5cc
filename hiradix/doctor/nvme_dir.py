"""The NVMe directory: it exists and is writable, its file system takes ``O_DIRECT``, and which
I/O path the server will use there (KvikIO / GPUDirect Storage, or POSIX).

What the server does (:mod:`hiradix.tiers.nvme`): it opens the slot file with ``O_DIRECT`` and
falls back to buffered I/O, logging one warning, where the file system refuses it; it uses KvikIO
where ``import kvikio`` works and a CUDA device exists, else the POSIX path.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import tempfile
from pathlib import Path

from hiradix.config import HiRadixConfig
from hiradix.doctor.report import Check, error, ok, warning
from hiradix.tiers.nvme import SLOT_ALIGN

PROBE_PREFIX = ".hiradix-doctor-"


def _unescape(field: str) -> str:
    """A /proc/mounts field with its octal escapes (``\\040`` = space) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def fs_type(path: Path) -> str | None:
    """The type of the file system ``path`` is on (``ext4``, ``tmpfs``), from ``/proc/self/mounts``."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    target = str(path.resolve())
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = _unescape(parts[1])
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, parts[2]
    return kind


def probe_o_direct(directory: Path) -> str | None:
    """Why ``directory``'s file system refuses ``O_DIRECT`` I/O, or None when it takes it.

    Opens a new temporary file there with ``O_DIRECT``, writes and reads one ``SLOT_ALIGN``-byte
    aligned block (some file systems accept the flag at open and fail at I/O), removes the file.

    Raises:
        OSError: the file cannot be created (the directory is not writable), or I/O failed
            otherwise than by refusing ``O_DIRECT``.
    """
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return "this platform has no O_DIRECT"
    handle, name = tempfile.mkstemp(dir=directory, prefix=PROBE_PREFIX)
    os.close(handle)
    block = mmap.mmap(-1, SLOT_ALIGN)  # page-aligned, as the server's bounce buffers
    try:
        fd = os.open(name, os.O_RDWR | flag | os.O_CLOEXEC)
        try:
            written = os.pwritev(fd, [block], 0)
            read = os.preadv(fd, [block], 0)
        finally:
            os.close(fd)
        if written != SLOT_ALIGN or read != SLOT_ALIGN:
            return f"an aligned {SLOT_ALIGN}-byte block moved only {min(written, read)} bytes"
        return None
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return exc.strerror or str(exc)
        raise
    finally:
        block.close()
        os.unlink(name)


def _is_writable(path: Path) -> str | None:
    try:
        with tempfile.TemporaryFile(dir=path, prefix=PROBE_PREFIX):
            return None
    except OSError as exc:
        return exc.strerror or str(exc)


def path_check(config: HiRadixConfig) -> Check:
    """``--hiradix-nvme-path`` is an existing, writable directory (the launcher refuses one that is not)."""
    path = config.nvme_path
    if not path.exists():
        parent = next((p for p in path.parents if p.exists()), Path(path.anchor))
        return error("nvme-path", f"--hiradix-nvme-path {path} does not exist (nearest existing parent: {parent})",
                     f"mkdir -p {path} (the server does not create it: a typo must not fill another disk)")
    if not path.is_dir():
        return error("nvme-path", f"--hiradix-nvme-path {path} is not a directory", "give a directory")
    why = _is_writable(path)
    if why is not None:
        return error("nvme-path", f"--hiradix-nvme-path {path} is not writable by this user: {why}",
                     f"chown/chmod {path} for the user that runs the server")
    kind = fs_type(path)
    return ok("nvme-path", f"{path} is a writable directory" + (f" on {kind}" if kind else ""))


def o_direct_check(path: Path, reason: str | None) -> Check:
    """The outcome of the ``O_DIRECT`` probe of ``path`` (``reason``: why it was refused, or None)."""
    kind = fs_type(path) or "this file system"
    if reason is None:
        return ok("o_direct", f"{kind} takes O_DIRECT: an aligned {SLOT_ALIGN}-byte write and read bypassed the page cache")
    return warning("o_direct", f"{kind} refuses O_DIRECT ({reason}): the server falls back to buffered I/O "
                   "(hiradix.tiers.nvme logs one warning): NVMe pages then also fill the page cache (RAM), "
                   "and reads and writes are slower", "put --hiradix-nvme-path on a local NVMe file system "
                   "that takes O_DIRECT (ext4, xfs)")


def kvikio_check() -> Check:
    """Which NVMe path the I/O worker will take: KvikIO (GPUDirect Storage or its compatibility
    mode) where ``import kvikio`` works and a CUDA device exists, else POSIX."""
    import importlib.util

    if importlib.util.find_spec("kvikio") is None:
        return ok("kvikio", "KvikIO is not installed: the NVMe tier uses the POSIX path (O_DIRECT, "
                  "pread/pwrite through host bounce buffers); on a GPU machine pip install hiradix[gpu] adds it")
    from hiradix.tiers.nvme_device import gds_status

    reason, compat = gds_status()
    if reason is not None:
        return warning("kvikio", f"KvikIO is installed but unusable ({reason}): the POSIX path is used",
                       "nothing to do on a machine without CUDA; else check the CUDA driver (libcuda.so.1)")
    if compat is None:
        return ok("kvikio", "KvikIO is usable (whether GPUDirect Storage is present could not be asked)")
    if compat:
        return ok("kvikio", "KvikIO in compatibility mode (no GPUDirect Storage here): its POSIX thread pool is used")
    return ok("kvikio", "KvikIO with GPUDirect Storage is usable")
