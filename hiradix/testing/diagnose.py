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
    """Stacks of every process (default: every watched one) and the tails of their logs, as text:
    a short summary first (:func:`summarize`), then every stack and log tail in full."""
    processes = watched() if processes is None else list(processes)
    dumps = [(process, [(pid, describe(pid), stack_of(pid)) for pid in process.pids()]) for process in processes]
    parts = [f"=== hiradix process snapshot, {time.strftime('%Y-%m-%d %H:%M:%S')}, {len(processes)} started here ===",
             summarize(dumps), SUMMARY_END]  # fmt: skip
    for process, pids in dumps:
        parts.append(f"\n##### {process.label} (log {process.log_path})")
        for _pid, description, stack in pids:
            parts.append(f"--- {description}\n{stack}")
        parts.append(f"--- last {num_lines} lines of {process.log_path}:\n{log_tail(process.log_path, num_lines)}")
    return "\n".join(parts)


SUMMARY_END = "=== end of summary; every stack and log tail in full below ==="
SUMMARY_FRAMES = 3  # innermost Python frames per thread in the summary
SUMMARY_LOG_LINES = 5  # last lines of each log in the summary, each cut to SUMMARY_LINE_CHARS
SUMMARY_LINE_CHARS = 240
_THREAD = re.compile(r'^Thread (\d+) \(([^)]*)\)(?:: "(.*)")?')
_PY_FRAME = re.compile(r"^\s+(\S+) \(([^()]*\.py|<[^<>]*>):(\d+)\)")  # a Python frame, not a native one


def summarize(dumps: list[tuple[Watched, list[tuple[int, str, str]]]]) -> str:
    """One block per process, short enough to read in a CI log's tail: the machine's free memory and
    load, then per PID its state, RSS and CPU seconds, per thread that is busy (plus every main
    thread) its innermost Python frames, innermost first, and the last lines of its log."""
    memory = psutil.virtual_memory()
    lines = [f"machine: {memory.available / 2**20:,.0f} MiB of {memory.total / 2**20:,.0f} MiB available, "
             f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]  # fmt: skip
    for process, pids in dumps:
        lines.append(f"{process.label}:")
        for pid, _description, stack in pids:
            lines.append(f"  {_usage(pid)}")
            lines.extend(f"    {thread}" for thread in busy_threads(stack, pid))
        for line in problem_lines(process.log_path):
            lines.append(f"  ! {line[:SUMMARY_LINE_CHARS]}")
        for line in log_tail(process.log_path, SUMMARY_LOG_LINES).splitlines():
            lines.append(f"  | {line[:SUMMARY_LINE_CHARS]}")
    return "\n".join(lines)


# A log line that reports trouble: glog's warning and error lines (Mooncake), Python's
# tracebacks and exceptions, failed or timed-out work.
# (hiradix's own counters, "failed={...}" and "0 failed)", are not trouble.)
_PROBLEM = re.compile(r"^[EWF]\d{4} |Traceback|Error|Exception|[Ff]ailed(?![=)])|[Tt]imed out|not alive|rejection|WARN")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STAMP = re.compile(r"^\[[^]]*\] |^([EWF])\d{4} [\d:.]+ +\d+ ")  # SGLang's "[time] ", glog's "E1206 08:17:42.3 5299 "


def problem_lines(path: Path, count: int = SUMMARY_LOG_LINES) -> list[str]:
    """The last ``count`` distinct lines of a log that report trouble (:data:`_PROBLEM`), oldest
    first, each with how often it came; a launch's ``server_args=`` line is left out."""
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return []
    seen: dict[str, int] = {}  # line without its time stamp -> times seen, in order of last sight
    for line in _ANSI.sub("", text).splitlines():
        if _PROBLEM.search(line) and "server_args=" not in line:
            key = _STAMP.sub(r"\1 ", line).strip()
            seen[key] = seen.pop(key, 0) + 1
    return [f"{line} (x{times})" if times > 1 else line for line, times in list(seen.items())[-count:]]


def summary_of(snapshot_text: str) -> str:
    """The summary at the head of a :func:`snapshot` (all of it if it has none)."""
    return snapshot_text.split(SUMMARY_END, 1)[0].rstrip()


def _usage(pid: int) -> str:
    try:
        process = psutil.Process(pid)
        with process.oneshot():
            cpu = process.cpu_times()
            return (f"pid {pid} {process.name()} [{process.status()}] rss {process.memory_info().rss / 2**20:,.0f} MiB, "
                    f"cpu {cpu.user + cpu.system:.1f} s")  # fmt: skip
    except psutil.Error as exc:
        return f"pid {pid}: {exc.__class__.__name__}"


def busy_threads(stack: str, pid: int, frames: int = SUMMARY_FRAMES) -> list[str]:
    """``name (state): f1 file:line < f2 < ...`` for each thread of process ``pid``'s py-spy dump
    that is not idle, and for its main thread (py-spy leaves a lone thread unnamed; its id is the
    PID); [] for a dump that is not py-spy's (a ``/proc`` thread list)."""
    threads: list[tuple[str, bool, list[str]]] = []
    for line in stack.splitlines():
        head = _THREAD.match(line)
        if head:
            name = head.group(3) or ("MainThread" if head.group(1) == str(pid) else head.group(1))
            threads.append((f"{name} ({head.group(2)})", head.group(2) != "idle" or name == "MainThread", []))
            continue
        frame = _PY_FRAME.match(line)
        if frame and threads and len(threads[-1][2]) < frames:
            threads[-1][2].append(f"{frame.group(1)} {os.path.basename(frame.group(2))}:{frame.group(3)}")
    return [f"{title}: {' < '.join(calls) or '(no Python frames)'}" for title, shown, calls in threads if shown]


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
