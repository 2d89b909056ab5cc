"""One check's outcome, and the report ``hiradix doctor`` prints: a line per check, then a summary.

A line reads ``<status> <name> <what was found>[ | fix: <what to do>]``, e.g.::

    error    disk           --hiradix-nvme-gb 4000 per TP rank x 8 ranks = 32000 GB on this node; ... | fix: ...

The exit status is 1 when any check is an error, else 0 (warnings do not fail a launch).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

NAME_WIDTH = 16  # characters of the name column (longer names push the text right)


class Status(enum.Enum):
    """How a check came out: ``ok``; ``warning`` (the server starts, but not as one would want);
    ``error`` (the launcher refuses these flags, or the server cannot serve them)."""

    OK = "ok"
    WARNING = "warning"
    ERROR = "error"


@dataclass(frozen=True, slots=True)
class Check:
    """One check's outcome.

    Attributes:
        status: ok, warning or error.
        name: what was checked, short (``sglang``, ``disk``, or the flag at fault: ``--pp-size``).
        detail: what was found, one line, with the figures.
        fix: what to do about it (empty for ok).
    """

    status: Status
    name: str
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        if self.status is not Status.OK and not self.fix:
            raise ValueError(f"a {self.status.value} check needs a fix: {self.name}: {self.detail}")

    def line(self) -> str:
        """The check as one line of the report."""
        text = " ".join(self.detail.split())
        fix = f" | fix: {' '.join(self.fix.split())}" if self.fix else ""
        return f"{self.status.value:<9}{self.name:<{NAME_WIDTH}} {text}{fix}"


def ok(name: str, detail: str) -> Check:
    """An ok check."""
    return Check(Status.OK, name, detail)


def warning(name: str, detail: str, fix: str) -> Check:
    """A warning: the server starts, but not as one would want."""
    return Check(Status.WARNING, name, detail, fix)


def error(name: str, detail: str, fix: str) -> Check:
    """An error: the launcher refuses these flags, or the server cannot serve them."""
    return Check(Status.ERROR, name, detail, fix)


def exit_status(checks: Iterable[Check]) -> int:
    """1 when any check is an error, else 0."""
    return int(any(c.status is Status.ERROR for c in checks))


def summary(checks: list[Check], note: str = "") -> str:
    """The last line: counts per status and the exit status."""
    counts = Counter(c.status for c in checks)
    parts = [f"{counts[s]} {s.value}{'' if counts[s] == 1 or s is Status.OK else 's'}" for s in Status]
    tail = f"; {note}" if note else ""
    return f"hiradix doctor: {', '.join(parts)} (exit status {exit_status(checks)}){tail}"


def render(checks: list[Check], note: str = "") -> str:
    """The whole report: one line per check, then :func:`summary`."""
    return "\n".join([c.line() for c in checks] + [summary(checks, note)]) + "\n"
