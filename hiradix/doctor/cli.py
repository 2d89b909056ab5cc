"""``hiradix doctor``: check a planned hiradix launch on this machine without loading the model.

Usage::

    hiradix doctor [--store-timeout-s S] [--verbose] -- --model-path M --enable-hiradix \\
        --hiradix-dram-gb 64 --hiradix-nvme-path /mnt/nvme/kv --hiradix-nvme-gb 2048 --tp-size 8 ...

(also ``python -m hiradix doctor``). Everything after ``--`` is what would follow
``python -m sglang.launch_server`` (that prefix, or ``sglang serve``, may be pasted too). One line
per check, then a summary; the exit status is 1 when any check is an error, 0 otherwise, 2 for a
usage error. What SGLang and hiradix print or log during the checks is kept out of the report
(``--verbose`` prints it after the report).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import sys
import traceback
from collections.abc import Iterator
from typing import TextIO

from hiradix.doctor.capacity import Machine, disk_check, ram_check
from hiradix.doctor.install import SETUP_FIX, plugin_check, sglang_check
from hiradix.doctor.plan import LaunchPlan
from hiradix.doctor.report import Check, Status, error, exit_status, render

LAUNCHER_PREFIXES = (("-m", "sglang.launch_server"), ("sglang", "serve"), ("sglang.launch_server",))


def launch_flags(words: list[str]) -> list[str]:
    """``words`` without a leading ``[python] -m sglang.launch_server`` or ``sglang serve``."""
    words = list(words)
    if words and "python" in words[0].rsplit("/", 1)[-1]:
        words = words[1:]
    for prefix in LAUNCHER_PREFIXES:
        if tuple(words[: len(prefix)]) == prefix:
            return words[len(prefix):]
    return words


@contextlib.contextmanager
def captured() -> Iterator[io.StringIO]:
    """Capture what is printed and logged (any logger) meanwhile."""
    sink = io.StringIO()
    handler = logging.StreamHandler(sink)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield sink
    finally:
        root.removeHandler(handler)


def machine_checks(plan: LaunchPlan, machine: Machine, store_timeout_s: float) -> list[Check]:
    """RAM, the NVMe directory (space, O_DIRECT, KvikIO, persisted pages) and the cluster store."""
    from hiradix.doctor.nvme_dir import kvikio_check, o_direct_check, path_check
    from hiradix.doctor.persisted import index_checks
    from hiradix.doctor.store import store_check

    config = plan.config
    checks = [ram_check(plan, machine)]
    if config.has_nvme_tier:
        path = path_check(config)
        checks.append(path)
        if path.status is Status.OK:
            disk = disk_check(plan, machine)
            checks += [disk] if disk is not None else []
            checks.append(o_direct_check(config.nvme_path, machine.o_direct(config.nvme_path)))
            checks.append(kvikio_check())
            checks += index_checks(plan)
    store = store_check(config, store_timeout_s)
    return checks + ([store] if store is not None else [])


def run_checks(flags: list[str], machine: Machine | None = None,
               store_timeout_s: float | None = None) -> tuple[list[Check], str, str]:
    """Every check of the launch ``flags``: ``(checks, note for the summary, captured output)``.

    Args:
        flags: what would follow ``python -m sglang.launch_server``.
        machine: where this machine's figures come from (default: the real ones).
        store_timeout_s: how long the store may take to answer (default: the launcher's).
    """
    machine = machine or Machine()
    checks, note = [sglang_check(), plugin_check()], ""
    with captured() as sink:
        try:
            from hiradix.sglang_plugin import doctor_flags
            from hiradix.sglang_plugin.refusals import STORE_PROBE_TIMEOUT_S
        except Exception as exc:  # noqa: BLE001 - any failure to import SGLang is the finding
            checks.append(error("flags", f"cannot judge the flags: SGLang does not import ({type(exc).__name__}: "
                                f"{exc})", SETUP_FIX))
            return checks, "the flags and the machine were not checked", sink.getvalue()
        try:
            found = doctor_flags.examine(launch_flags(flags))
            checks += found.checks
            if found.plan is None:
                note = "the machine checks need hiradix flags that validate"
            else:
                timeout = STORE_PROBE_TIMEOUT_S if store_timeout_s is None else store_timeout_s
                checks += machine_checks(found.plan, machine, timeout)
        except Exception as exc:  # noqa: BLE001 - a line, not a traceback; the traceback goes to --verbose
            traceback.print_exc()
            checks.append(error("doctor", f"a check failed unexpectedly: {type(exc).__name__}: {exc}",
                                "rerun with --verbose for the traceback, and report it"))
            note = "the checks after it did not run"
    return checks, note, sink.getvalue()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hiradix doctor", description="Check a planned hiradix launch on this machine, without loading the model.",
        usage="hiradix doctor [--store-timeout-s S] [--verbose] -- <flags of python -m sglang.launch_server>")
    parser.add_argument("--store-timeout-s", type=float, default=None,
                        help="How long the cluster store's master may take to answer (default: the launcher's, 10 s).")
    parser.add_argument("--verbose", action="store_true", help="Also print what SGLang and hiradix logged.")
    return parser


def main(argv: list[str] | None = None, out: TextIO = sys.stdout, machine: Machine | None = None) -> int:
    """Run ``hiradix doctor`` with ``argv`` (the words after ``doctor``); returns the exit status."""
    argv = list(sys.argv[2:] if argv is None else argv)
    if "--" in argv:
        own, flags = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    else:
        own, flags = (argv, []) if argv[:1] in (["-h"], ["--help"]) else ([], argv)
    if not flags:
        _parser().print_help(out)
        return 0 if own[:1] in (["-h"], ["--help"]) else 2
    try:
        options = _parser().parse_args(own)
    except SystemExit as exc:
        return int(exc.code or 2)
    checks, note, log = run_checks(flags, machine, options.store_timeout_s)
    out.write(render(checks, note))
    if options.verbose and log.strip():
        out.write("\n--- what SGLang and hiradix printed and logged during the checks ---\n" + log)
    return exit_status(checks)
