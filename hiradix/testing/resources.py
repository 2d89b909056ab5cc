"""What a server's process tree holds, measured so that a soak can prove it all comes back.

A `TreeUsage` sums, over a set of processes (a server's launcher and its descendants, see
`ServerProcess.descendants`), what leaks show up in: resident memory split as the kernel
reports it (`/proc/<pid>/status`: `RssAnon` private heap, `RssShmem` shared memory such as
the DRAM tier, `RssFile` mapped files), open file descriptors, socket descriptors, and the
`/dev/shm` entries the processes have open or mapped. `dir_modes` lists the files under a
directory with their permission bits (NVMe tier directory, worker socket directory).

Linux only (reads `/proc`). Processes that exit while being read are skipped.

Example:
    >>> usage = tree_usage([psutil.Process(server.pid), *server.descendants()])
    >>> usage.num_fds, usage.rss_anon_bytes
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path
from typing import Iterable

import msgspec
import psutil

SHM_ROOT = Path("/dev/shm")


class TreeUsage(msgspec.Struct, frozen=True):
    """Resources held by a set of processes, summed (bytes and counts).

    Attributes:
        processes: `{pid: name}` of the live, non-zombie processes measured.
        rss_bytes: Resident memory (`VmRSS`), bytes.
        rss_anon_bytes: Private anonymous resident memory (`RssAnon`), bytes: heaps, tensors.
        rss_shmem_bytes: Resident shared memory (`RssShmem`), bytes: e.g. the DRAM tier,
            counted once per process that touched it.
        num_fds: Open file descriptors.
        num_sockets: File descriptors that are sockets (TCP, Unix, ZMQ ipc).
        shm_paths: Sorted `/dev/shm` paths open or mapped by the processes.
        fd_kinds: `{"<process role> <kind>": count}` of the open fds (see `fd_kinds`), so that
            a changed count can be named (which process, which kind of fd or peer).
    """

    processes: dict[int, str]
    rss_bytes: int
    rss_anon_bytes: int
    rss_shmem_bytes: int
    num_fds: int
    num_sockets: int
    shm_paths: list[str]
    fd_kinds: dict[str, int] = {}

    @property
    def num_processes(self) -> int:
        """How many processes were measured."""
        return len(self.processes)


def _status_kib(pid: int) -> dict[str, int]:
    """`VmRSS`, `RssAnon`, `RssShmem` of `/proc/<pid>/status`, in KiB (0 if absent)."""
    values = {"VmRSS": 0, "RssAnon": 0, "RssShmem": 0}
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in values:
                values[key] = int(rest.split()[0])
    return values


def _fd_targets(pid: int) -> dict[int, str]:
    """`{fd: link target}` of `/proc/<pid>/fd/*` (`socket:[123]`, `/dev/shm/x`, ...)."""
    base = f"/proc/{pid}/fd"
    targets = {}
    for name in os.listdir(base):
        try:
            targets[int(name)] = os.readlink(f"{base}/{name}")
        except FileNotFoundError:  # closed while listing
            continue
    return targets


def _shm_maps(pid: int) -> set[str]:
    """`/dev/shm` paths mapped by `pid` (from `/proc/<pid>/maps`, " (deleted)" stripped)."""
    found = set()
    prefix = str(SHM_ROOT) + "/"
    with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split(maxsplit=5)  # address perms offset dev inode [path]
            path = parts[5].strip() if len(parts) == 6 else ""
            if path.startswith(prefix):
                found.add(path.removesuffix(" (deleted)"))
    return found


def process_role(process: psutil.Process) -> str:
    """A name for a process that survives its restart: the process name, or for a Python
    process the module it runs (`-m x`) or its script's file name."""
    name = process.name()
    if not name.startswith("python"):
        return name
    args = process.cmdline()[1:]
    if "-m" in args[:-1]:
        return args[args.index("-m") + 1]
    script = next((a for a in args if not a.startswith("-")), "")
    return os.path.basename(script) or name


def _socket_kinds(process: psutil.Process) -> dict[int, str]:
    """`{fd: kind}` of the process's sockets psutil can place: "unix", "tcp listen",
    "tcp in" (accepted on one of its listening ports), "tcp out :<peer port>" (a connection it
    made, named by the listening port it reached), "udp"; other kinds go by family."""
    conns = process.net_connections(kind="all")
    listening = {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr}
    kinds = {}
    for c in conns:
        if c.family == socket.AF_UNIX:
            kind = "unix"
        elif c.type == socket.SOCK_DGRAM:
            kind = "udp"
        elif c.status == psutil.CONN_LISTEN:
            kind = "tcp listen"
        elif c.laddr and c.laddr.port in listening:
            kind = "tcp in"
        else:
            kind = f"tcp out :{c.raddr.port}" if c.raddr else f"tcp {c.status.lower()}"
        kinds[c.fd] = kind
    return kinds


def fd_kinds(process: psutil.Process, targets: dict[int, str]) -> dict[str, int]:
    """`{"<role> <kind>": count}` of the process's open fds `targets` (`_fd_targets`; role:
    `process_role`; kinds: the socket kinds of `_socket_kinds`, "socket other", "pipe",
    "anon_inode:<name>", "file <path>")."""
    role, counts = process_role(process), {}
    sockets = _socket_kinds(process)
    for fd, target in targets.items():
        if target.startswith("socket:"):
            kind = sockets.get(fd, "socket other")
        elif target.startswith("pipe:"):
            kind = "pipe"
        elif target.startswith("anon_inode:"):
            kind = target
        else:
            kind = "file " + target.removesuffix(" (deleted)")
        key = f"{role} {kind}"
        counts[key] = counts.get(key, 0) + 1
    return counts


def tree_usage(processes: Iterable[psutil.Process]) -> TreeUsage:
    """Measure a set of processes now (see `TreeUsage`).

    Args:
        processes: The processes; zombies and processes that exit meanwhile are skipped.

    Returns:
        The sums.

    Raises:
        PermissionError: A process belongs to another user (its `/proc` files are closed).
    """
    names: dict[int, str] = {}
    rss = anon = shmem = fds = sockets = 0
    shm: set[str] = set()
    kinds: dict[str, int] = {}
    prefix = str(SHM_ROOT) + "/"
    for process in processes:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            kib = _status_kib(process.pid)
            targets = _fd_targets(process.pid)
            mapped = _shm_maps(process.pid)
            names[process.pid] = process.name()
            for key, count in fd_kinds(process, targets).items():
                kinds[key] = kinds.get(key, 0) + count
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
            continue
        rss += kib["VmRSS"] * 1024
        anon += kib["RssAnon"] * 1024
        shmem += kib["RssShmem"] * 1024
        fds += len(targets)
        sockets += sum(t.startswith("socket:") for t in targets.values())
        shm |= mapped | {t.removesuffix(" (deleted)") for t in targets.values() if t.startswith(prefix)}
    return TreeUsage(dict(sorted(names.items())), rss, anon, shmem, fds, sockets, sorted(shm), dict(sorted(kinds.items())))


def dir_modes(root: str | os.PathLike) -> dict[str, str]:
    """Every entry under `root` (and `root` itself as "."), with its type and mode bits.

    Symlinks are listed, not followed.

    Args:
        root: A directory.

    Returns:
        `{relative path: "<type> <octal mode>"}`, e.g. `{".": "dir 0700", "nvme.kv": "file 0600",
        "sock/ab-1.jobs": "socket 0755"}`; empty if `root` does not exist.
    """
    root = Path(root)
    if not os.path.lexists(root):
        return {}
    found = {".": _describe(root)}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            try:
                found[str(path.relative_to(root))] = _describe(path)
            except FileNotFoundError:  # removed while walking
                continue
    return dict(sorted(found.items()))


def _describe(path: Path) -> str:
    st = os.lstat(path)
    kinds = ((stat.S_ISLNK, "symlink"), (stat.S_ISDIR, "dir"), (stat.S_ISREG, "file"), (stat.S_ISSOCK, "socket"))
    kind = next((name for test, name in kinds if test(st.st_mode)), "other")
    return f"{kind} {stat.S_IMODE(st.st_mode):04o}"


def private_mode_problems(modes: dict[str, str]) -> list[str]:
    """Entries of a `dir_modes` listing that others could reach.

    Directories must be 0700, regular files 0600 (or stricter: no group/other bit set);
    symlinks and other kinds are problems too. Sockets are judged by their directory
    (connecting needs search permission on it), so they are not listed.

    Returns:
        One line per problem, e.g. `"nvme.kv: file 0644 (group/other bits set)"`.
    """
    problems = []
    for rel, description in modes.items():
        kind, mode_text = description.split()
        mode = int(mode_text, 8)
        if kind == "socket":
            continue
        if kind not in ("dir", "file"):
            problems.append(f"{rel}: {description} (unexpected kind)")
        elif mode & 0o077:
            problems.append(f"{rel}: {description} (group/other bits set)")
    return problems
