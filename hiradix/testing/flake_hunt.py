"""Rerun tests N times on a fresh tree and summarize every failure with its process dumps.

Usage (``scripts/flake-hunt`` runs this with the project's venv)::

    scripts/flake-hunt tests/e2e/test_e2e_pd_dp.py --runs 10
    scripts/flake-hunt tests/e2e/test_e2e_mla.py -k restart --runs 5 --out runs/flake-mla

The tree is a detached ``git worktree`` of the current checkout *with its uncommitted changes*
(``git stash create``), so what runs is what is here now, but no build output, model or cache
left in this checkout leaks into it. The project's venv is shared (``PYTHONPATH`` puts the tree's
``hiradix`` ahead of the editable install). Each run is ``pytest TESTS -x`` with its own
``HIRADIX_TEST_FAILURE_DIR`` (``tests/conftest.py`` saves the stacks and logs of the processes a
failed test started there) and a JUnit XML report; the summary (printed, and ``summary.json``)
gives per run its exit status, seconds and failed tests, and per failed test how often it failed,
its first error line and the folders with its dumps. Exit status: 0 when every run passed, 1
otherwise. The worktree is removed at the end; the output folder stays.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RunResult:
    """One pytest run of the hunt."""

    index: int  # 1-based
    exit_status: int
    duration_s: float
    failed: dict[str, str] = field(default_factory=dict)  # test id -> first line of its error
    failure_dirs: list[str] = field(default_factory=list)  # snapshot folders of this run


def failures_in_junit(path: Path) -> dict[str, str]:
    """Failed or errored test cases of a JUnit XML report: ``{"file::name": first message line}``."""
    if not path.is_file():
        return {}
    found = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        for kind in ("failure", "error"):
            bad = case.find(kind)
            if bad is not None:
                test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
                message = (bad.get("message") or bad.text or kind).strip().splitlines()
                found[test_id] = (message[0] if message else kind)[:300]
                break
    return found


def summarize(runs: list[RunResult]) -> dict:
    """Runs passed, and per failed test its count, first error and dump folders."""
    tests: dict[str, dict] = {}
    for run in runs:
        for test_id, message in run.failed.items():
            entry = tests.setdefault(test_id, {"failures": 0, "runs": [], "first_error": message})
            entry["failures"] += 1
            entry["runs"].append(run.index)
    return {"runs": len(runs), "passed_runs": sum(r.exit_status == 0 for r in runs),
            "failed_tests": tests, "per_run": [asdict(r) for r in runs]}  # fmt: skip


def make_tree(target: Path) -> str:
    """A detached worktree of this checkout with its uncommitted changes at ``target``; its commit."""
    # an identity of its own: `stash create` writes a (dangling) commit, also where git has none set
    identity = ["-c", "user.name=flake-hunt", "-c", "user.email=flake-hunt@localhost"]
    commit = subprocess.run(["git", *identity, "stash", "create"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()  # fmt: skip
    commit = commit or "HEAD"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(target), commit], cwd=ROOT, check=True)
    return commit


def run_once(index: int, tree: Path, out: Path, pytest_args: list[str], timeout_s: int) -> RunResult:
    """One ``pytest -x`` in ``tree``, its log, report and failure dumps under ``out/run-<index>``."""
    run_dir = out / f"run-{index:02d}"
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1",
           "HIRADIX_TEST_FAILURE_DIR": str(run_dir / "failures")}  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-x", "-ra", "-p", "no:cacheprovider", f"--timeout={timeout_s}",
           f"--junitxml={run_dir / 'junit.xml'}", *pytest_args]  # fmt: skip
    t0 = time.monotonic()
    with open(run_dir / "pytest.log", "wb") as log:
        status = _run_pytest(cmd, tree, env, log)
    failures = run_dir / "failures"
    dirs = sorted(str(p) for p in failures.iterdir()) if failures.is_dir() else []
    return RunResult(index, status, round(time.monotonic() - t0, 1), failures_in_junit(run_dir / "junit.xml"), dirs)


TEARDOWN_WAIT_S = 180.0  # how long a stopped hunt waits for its pytest's fixtures to stop their servers


class HuntStopped(Exception):
    """SIGTERM reached the hunt (its pytest was interrupted, its worktree is removed)."""


def _run_pytest(cmd: list[str], tree: Path, env: dict[str, str], log) -> int:
    """Run one pytest; its exit status. On SIGTERM pass it on as SIGINT (pytest then runs its
    fixtures' teardown, which stops the servers it started by PID), give it
    ``TEARDOWN_WAIT_S`` to end (then SIGKILL), and raise :class:`HuntStopped`."""
    proc = subprocess.Popen(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    stopped_at: list[float] = []

    def on_sigterm(*_: object) -> None:
        stopped_at.append(time.monotonic())
        proc.send_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        while True:
            try:
                status = proc.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if stopped_at and time.monotonic() - stopped_at[0] > TEARDOWN_WAIT_S:
                    proc.kill()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if stopped_at:
        raise HuntStopped()
    return status


def print_summary(summary: dict, out: Path) -> None:
    print(f"[flake-hunt] {summary['passed_runs']} of {summary['runs']} runs passed; output in {out}")
    for run in summary["per_run"]:
        print(f"[flake-hunt]   run {run['index']}: exit {run['exit_status']}, {run['duration_s']:.0f} s, "
              f"{len(run['failed'])} failed")  # fmt: skip
    for test_id, entry in summary["failed_tests"].items():
        print(f"[flake-hunt] FAILED {entry['failures']}x (runs {entry['runs']}): {test_id}\n"
              f"[flake-hunt]     {entry['first_error']}")  # fmt: skip
    for run in summary["per_run"]:
        for folder in run["failure_dirs"]:
            print(f"[flake-hunt]   stacks and logs: {folder}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="how many times to run the tests (default 10)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default runs/flake-<time>)")
    parser.add_argument("--timeout-s", type=int, default=600, help="pytest-timeout per test, in seconds")
    parser.add_argument("--keep-going", action="store_true", help="run all N even after a failed run")
    args, pytest_args = parser.parse_known_args(argv)
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got {args.runs}")
    if not pytest_args:
        parser.error("name the tests to hunt in, e.g. tests/e2e/test_e2e_pd_dp.py")
    out = (args.out or ROOT / "runs" / time.strftime("flake-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    tree = Path(tempfile.mkdtemp(prefix="hiradix-flake-")) / "tree"
    commit = make_tree(tree)
    print(f"[flake-hunt] {args.runs} runs of pytest {' '.join(pytest_args)} in {tree} (commit {commit[:12]})")
    runs: list[RunResult] = []
    try:
        for index in range(1, args.runs + 1):
            runs.append(run_once(index, tree, out, pytest_args, args.timeout_s))
            print(f"[flake-hunt] run {index}: exit {runs[-1].exit_status} in {runs[-1].duration_s:.0f} s", flush=True)
            if runs[-1].exit_status != 0 and not args.keep_going:
                break
    except HuntStopped:
        print("[flake-hunt] stopped (SIGTERM): the running pytest was interrupted and has stopped", flush=True)
        return 143
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    summary = summarize(runs)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary, out)
    return 0 if summary["passed_runs"] == summary["runs"] == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
