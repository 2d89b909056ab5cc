"""``python -m hiradix <command>`` (the ``hiradix`` console script): hiradix's command-line tools.

Commands:
    doctor: check a planned launch on this machine without loading the model (``hiradix.doctor.cli``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

USAGE = "usage: hiradix <command> [args]\ncommands:\n  doctor   check a planned launch: hiradix doctor -- <launch flags>\n"


def _doctor(args: list[str]) -> int:
    from hiradix.doctor.cli import main as doctor_main

    return doctor_main(args)


COMMANDS: dict[str, Callable[[list[str]], int]] = {"doctor": _doctor}


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default: ``sys.argv[1:]``) to a command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(USAGE)
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        sys.stderr.write(f"hiradix: unknown command {argv[0]!r}; commands: {', '.join(sorted(COMMANDS))}\n" + USAGE)
        return 2
    return command(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
