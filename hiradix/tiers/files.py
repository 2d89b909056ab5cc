"""File helpers of the storage media: private directories, stale socket directories, directory locks.

Security: the DRAM tier and the I/O worker's sockets carry the KV of other users' prompts, so
their directories must be private (``0700``, owned by this user, not a symlink).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import tempfile
from pathlib import Path


def default_shm_dir() -> Path:
    """Per-process private directory on ``/dev/shm`` (tmpfs), or the temp dir where there is none.

    Returns:
        ``/dev/shm/hiradix-<uid>-<pid>`` (not created here; :meth:`DramPool.create` does).
    """
    base = Path("/dev/shm")
    if not base.is_dir():
        base = Path(tempfile.gettempdir())
    return base / f"hiradix-{os.geteuid()}-{os.getpid()}"


def ensure_private_dir(directory: Path) -> tuple[Path, bool]:
    """Create ``directory`` with mode 0700 if missing; refuse it if others can reach it.

    Returns:
        ``(directory, created)``: ``created`` is True when this call made it.

    Raises:
        PermissionError: it is a symlink, not a directory, owned by another user, or
            group/world accessible (any bit of ``0o077`` set).
    """
    directory = Path(directory)
    created = False
    if not os.path.lexists(directory):
        directory.mkdir(mode=0o700, parents=True)
        created = True
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{directory} must be a real directory (not a symlink)")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{directory} is owned by uid {st.st_uid}, not by this user")
    if st.st_mode & 0o077:
        raise PermissionError(
            f"{directory} has mode {stat.S_IMODE(st.st_mode):04o}; it must be private (0700)"
        )
    return directory, created


def remove_stale_dirs(own_dir: Path) -> None:
    """Remove socket directories left by killed scheduler processes of this user.

    ``default_shm_dir()`` names them ``hiradix-<uid>-<pid>[-rank<r>]``; a SIGKILLed or
    SIGTERMed scheduler cannot clean up (the DRAM pool itself is anonymous memory and never
    leaks), so each new one removes those whose pid is gone.
    """
    prefix = own_dir.name.split("-")[:2]  # ["hiradix", "<uid>"]
    for path in own_dir.parent.glob("-".join(prefix) + "-*"):
        parts = path.name.split("-")
        if len(parts) < 3 or not parts[2].isdigit() or path.is_symlink() or not path.is_dir():
            continue
        try:
            os.kill(int(parts[2]), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            continue


def lock_dir(nvme_dir: Path) -> int:
    """Hold an exclusive lock on ``nvme_dir`` (made private) for the process lifetime; returns the fd.

    Two servers given the same ``--hiradix-nvme-path`` would otherwise truncate each other's
    slot file. The lock goes with the process (also when it is killed); close the fd to drop it.

    Raises:
        RuntimeError: another live process holds the directory.
    """
    ensure_private_dir(nvme_dir)
    fd = os.open(nvme_dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(
            f"hiradix: {nvme_dir} is in use by another server; give each server its own --hiradix-nvme-path"
        ) from None
    return fd
