"""Ending the process group a test started a process in (its own session), by PID."""

from __future__ import annotations

import os
import signal
import time
from typing import Protocol

import psutil


class Started(Protocol):
    """A process started in a session of its own (``subprocess.Popen``, a zygote's child)."""

    pid: int

    def poll(self) -> int | None: ...


def kill_group(proc: Started) -> None:
    """SIGKILL what is left of ``proc``'s process group: ``proc`` itself while it runs, and any
    process it started that stayed in its group.

    Once ``proc`` is reaped its pid may belong to a new, unrelated process (and its group), so
    after that only members of its group created before that pid was reused (before now if it
    was not) are killed, by PID.
    """
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # not reaped yet: the group id is still ours
        except (ProcessLookupError, PermissionError):
            pass
        return
    try:  # the old group's members were all created before proc died, so before a reuse
        cutoff = psutil.Process(proc.pid).create_time()
    except psutil.Error:
        cutoff = time.time()
    for member in psutil.process_iter(["pid", "create_time"]):
        try:
            if member.pid != os.getpid() and os.getpgid(member.pid) == proc.pid and member.info["create_time"] < cutoff:
                member.kill()
        except (ProcessLookupError, psutil.Error, PermissionError):
            continue
