"""CPU seconds a server's processes spent, by role, read from the OS (psutil) for any system alike.

A paired run sends each system its share of the requests in turn, so what a server's processes
burn between two samples around the workload is its cost for those requests, idle loops
included: SGLang's scheduler sleeps when it has nothing to do, so a scheduler that spins while a
request waits (for a read, for room) shows here. Roles, from the process titles SGLang sets
(``sglang::scheduler...``, ``sglang::detokenizer``) and hiradix's worker command line:
``scheduler`` (every TP rank's, summed), ``detokenizer``, ``io_worker`` (hiradix's I/O worker,
every rank), ``launcher`` (the HTTP server and tokenizer: the root process) and ``other``.
"""

from __future__ import annotations

from typing import Iterable

import psutil

ROLES = ("scheduler", "io_worker", "detokenizer", "launcher", "other")


def role_of(process: psutil.Process, root_pid: int) -> str:
    """The role of one of a server's processes (see the module doc)."""
    if process.pid == root_pid:
        return "launcher"
    try:
        title = " ".join(process.cmdline())
    except (psutil.AccessDenied, psutil.ZombieProcess):
        title = process.name()  # the title's first 15 characters
    if "sglang::schedul" in title:
        return "scheduler"
    if "sglang::detoken" in title:
        return "detokenizer"
    if "hiradix.io.worker" in title:
        return "io_worker"
    return "other"


def cpu_seconds_by_role(processes: Iterable[psutil.Process], root_pid: int) -> dict[str, float]:
    """User + system CPU seconds of ``processes`` (a server's launcher and its descendants), summed
    per role; a process that ended meanwhile counts as 0 (its seconds are gone with it)."""
    out = dict.fromkeys(ROLES, 0.0)
    for process in processes:
        try:
            times = process.cpu_times()
            out[role_of(process, root_pid)] += times.user + times.system
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return out


def cpu_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """``after - before`` per role (a process that started in between counts whole)."""
    return {role: after.get(role, 0.0) - before.get(role, 0.0) for role in ROLES}
