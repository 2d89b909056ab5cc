"""What a stuck test leaves behind: the stacks and log tails of every process it started.

Every process the testing helpers start (:class:`~hiradix.testing.server.ServerProcess` with its
scheduler, detokenizer and I/O worker children, :class:`~hiradix.testing.router.RouterProcess`, the
Mooncake master and holders of :class:`~hiradix.testing.mooncake.MooncakeCluster`) is registered
here while it runs (:func:`watch` / :func:`unwatch`). When a readiness wait or a test times out,
:func:`snapshot` gives, per watched process and each of its descendants:

* the Python stacks of every thread from ``py-spy dump`` (with ``--native`` frames where py-spy can
  unwind them; a plain dump otherwise), or for a non-Python binary (the router, the Mooncake
  master) each thread's state and kernel wait channel from ``/proc``;
* the last lines of its log.

:func:`save_failure` writes such a snapshot and a copy of the logs under :func:`failure_dir`
(``HIRADIX_TEST_FAILURE_DIR``, default ``<tmp>/hiradix-test-failures``), which ``.ci/run`` prints.
Nothing here stops or signals a process: a dump only reads it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable, Protocol

import psutil

DUMP_TIMEOUT_S = 20.0  # one py-spy dump (native unwinding of a big process can take seconds)
LOG_TAIL_LINES = 60


class Watched(Protocol):
    """What a started helper process offers to a dump."""

    label: str  # e.g. "sglang :23017", "smg router", "mooncake_master"
    log_path: Path  # its stdout/stderr

    def pids(self) -> list[int]:
        """The PIDs it started that are alive now (the launcher first, then its descendants)."""


_WATCHED: dict[int, Watched] = {}
_LOCK = threading.Lock()


def watch(process: Watched) -> None:
    """Register a started process (kept until :func:`unwatch`)."""
    with _LOCK:
        _WATCHED[id(process)] = process


def unwatch(process: Watched) -> None:
    """Forget a stopped process; no-op if it was not watched."""
    with _LOCK:
        _WATCHED.pop(id(process), None)


def watched() -> list[Watched]:
    """The processes registered now, oldest first."""
    with _LOCK:
        return list(_WATCHED.values())


def py_spy_binary() -> str | None:
    """The ``py-spy`` of this interpreter's environment (a dev dependency), else one on PATH."""
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy")


def stack_of(pid: int, timeout_s: float = DUMP_TIMEOUT_S) -> str:
    """Every thread's stack of one process: py-spy (native frames where it can), else ``/proc``."""
    spy = py_spy_binary()
    if spy is not None and _is_python(pid):
        errors = []
        for extra in (["--native"], []):
            try:
                out = subprocess.run([spy, "dump", "--pid", str(pid), *extra], capture_output=True, text=True,
                                     timeout=timeout_s)  # fmt: skip
            except subprocess.TimeoutExpired:
                errors.append(f"py-spy dump {' '.join(extra)} timed out after {timeout_s:g} s")
                continue
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout
            errors.append(f"py-spy dump {' '.join(extra)} exit {out.returncode}: {out.stderr.strip()[-300:]}")
        return "\n".join(errors) + "\n" + threads_of(pid)
    return threads_of(pid)


def threads_of(pid: int) -> str:
    """Each thread's name, state and kernel wait channel (``/proc/PID/task``): what a non-Python
    process (or one py-spy cannot read) is doing."""
    lines = []
    try:
        tasks = sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda p: int(p.name))
    except OSError as exc:
        return f"pid {pid}: {exc}\n"
    for task in tasks:
        try:
            stat = task.joinpath("stat").read_text()
            wchan = task.joinpath("wchan").read_text().strip() or "-"
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        state = stat.rsplit(")", 1)[1].split()[0]
        lines.append(f"  thread {task.name} ({name}): state {state}, wchan {wchan}")
    return "\n".join(lines) + "\n"


def _is_python(pid: int) -> bool:
    try:
        exe = os.path.basename(psutil.Process(pid).exe())
    except (psutil.Error, OSError):
        return False
    return exe.startswith("python")


def describe(pid: int) -> str:
    """``pid name: command line`` (cut to 200 characters), or why it cannot be read."""
    try:
        process = psutil.Process(pid)
        return f"pid {pid} {process.name()} [{process.status()}]: {' '.join(process.cmdline())[:200]}"
    except psutil.Error as exc:
        return f"pid {pid}: {exc.__class__.__name__}"


def log_tail(path: Path, num_lines: int = LOG_TAIL_LINES) -> str:
    """The last ``num_lines`` lines of a log ('' if it cannot be read)."""
    try:
        return "\n".join(path.read_bytes().decode("utf-8", errors="replace").splitlines()[-num_lines:])
    except OSError:
        return ""


def snapshot(processes: Iterable[Watched] | None = None, num_lines: int = LOG_TAIL_LINES) -> str:
    """Stacks of every process (default: every watched one) and the tails of their logs, as text."""
    processes = watched() if processes is None else list(processes)
    parts = [f"=== hiradix process snapshot, {time.strftime('%Y-%m-%d %H:%M:%S')}, {len(processes)} started here ==="]
    for process in processes:
        parts.append(f"\n##### {process.label} (log {process.log_path})")
        for pid in process.pids():
            parts.append(f"--- {describe(pid)}\n{stack_of(pid)}")
        parts.append(f"--- last {num_lines} lines of {process.log_path}:\n{log_tail(process.log_path, num_lines)}")
    return "\n".join(parts)


def failure_dir() -> Path:
    """Where failure snapshots and logs go: ``HIRADIX_TEST_FAILURE_DIR``, else
    ``<tmp>/hiradix-test-failures``."""
    return Path(os.environ.get("HIRADIX_TEST_FAILURE_DIR") or Path(tempfile.gettempdir()) / "hiradix-test-failures")


def save_failure(name: str, text: str, processes: Iterable[Watched] | None = None) -> Path:
    """Write ``text`` (a snapshot) and a copy of each process's whole log under
    ``failure_dir()/<name>/``; returns that directory."""
    processes = watched() if processes is None else list(processes)
    target = failure_dir() / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:150]
    target.mkdir(parents=True, exist_ok=True)
    (target / "snapshot.txt").write_text(text)
    for index, process in enumerate(processes):
        log = Path(process.log_path)
        if log.is_file():
            label = re.sub(r"[^A-Za-z0-9_.-]+", "_", process.label)
            shutil.copyfile(log, target / f"{index:02d}-{label}-{log.name}")
    return target
