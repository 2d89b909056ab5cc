"""The harness's failure diagnostics (hiradix/testing/diagnose.py) and the flake hunt
(hiradix/testing/flake_hunt.py), on real processes: a stuck server's stacks in its start error, a
non-Python process's threads, a failed test's snapshot folder, N runs of a test that fails every
other time."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hiradix.testing import diagnose, flake_hunt
from hiradix.testing.server import ServerProcess, ServerStartError
from tests.helpers.e2e import fake_sglang

# A launcher that never answers /health: its main thread waits in a function whose name the stack shows.
STUCK_LAUNCH_SERVER = textwrap.dedent('''
    import subprocess, sys, time
    print("stuck sglang starting", flush=True)
    child = subprocess.Popen([sys.executable, "-c", "import time\\ndef child_waits_forever():\\n    time.sleep(600)\\nchild_waits_forever()"])
    def launcher_waits_forever():
        time.sleep(600)
    launcher_waits_forever()
''')


@pytest.fixture
def stuck_sglang(tmp_path):
    return fake_sglang(tmp_path, STUCK_LAUNCH_SERVER)


def test_a_readiness_timeout_reports_every_process_stack_and_the_log(stuck_sglang, tmp_path):
    server = ServerProcess("unused-model", env=stuck_sglang, log_path=tmp_path / "s.log", startup_timeout_s=4,
                           stop_grace_s=2)  # fmt: skip
    with pytest.raises(ServerStartError, match="not healthy after 4 s") as info:
        server.start()
    message = str(info.value)
    # the launcher's and its child's Python frames, read by py-spy before the stop
    assert "launcher_waits_forever" in message and "child_waits_forever" in message, message
    assert "stuck sglang starting" in message  # the log's tail
    # the summary at its head: each process's main thread with its innermost frames, the log's tail
    summary = diagnose.summary_of(message)
    assert summary != message and "MiB available" in summary, summary
    assert "MainThread (idle): launcher_waits_forever launch_server.py:" in summary, summary
    assert "MainThread (idle): child_waits_forever" in summary, summary
    assert "  | stuck sglang starting" in summary, summary
    assert server not in diagnose.watched()  # stopped, so no longer watched


class _Binary:
    """A non-Python process as a watched helper."""

    def __init__(self, log: Path):
        self.label, self.log_path = "sleep binary", log
        log.write_text("line one\nline two\n")
        self.popen = subprocess.Popen(["sleep", "60"])

    def pids(self) -> list[int]:
        return [self.popen.pid]


def test_a_non_python_process_shows_its_threads_and_a_failure_folder_keeps_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("HIRADIX_TEST_FAILURE_DIR", str(tmp_path / "failures"))
    binary = _Binary(tmp_path / "bin.log")
    diagnose.watch(binary)
    try:
        time.sleep(0.2)  # let it exec `sleep` (a Python child would show py-spy frames instead)
        text = diagnose.snapshot([binary])
        assert f"thread {binary.popen.pid} (sleep): state S" in text, text
        assert "line two" in text
        folder = diagnose.save_failure("tests/x.py::test_y[a b]-call", text, [binary])
        assert folder == tmp_path / "failures" / "tests_x.py_test_y_a_b_-call"
        assert (folder / "snapshot.txt").read_text() == text
        assert [p.read_text() for p in folder.glob("00-sleep_binary-bin.log")] == ["line one\nline two\n"]
    finally:
        diagnose.unwatch(binary)
        binary.popen.kill()
        binary.popen.wait()
    assert binary not in diagnose.watched()


FLAKY_TEST = textwrap.dedent('''
    from pathlib import Path
    COUNTER = Path(__file__).with_suffix(".count")

    def test_passes():
        assert True

    def test_fails_every_other_run():
        n = int(COUNTER.read_text()) if COUNTER.exists() else 0
        COUNTER.write_text(str(n + 1))
        assert n % 2 == 1, f"run number {n} failed"
''')


def test_flake_hunt_counts_the_runs_a_test_failed_in(tmp_path, capsys):
    test_file = tmp_path / "test_flaky.py"
    test_file.write_text(FLAKY_TEST)
    status = flake_hunt.main(["--runs", "3", "--keep-going", "--out", str(tmp_path / "out"), str(test_file)])
    assert status == 1
    summary = flake_hunt.summarize([])  # empty hunt: nothing failed
    assert summary == {"runs": 0, "passed_runs": 0, "failed_tests": {}, "per_run": []}
    import json

    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["runs"] == 3 and summary["passed_runs"] == 1
    (test_id, entry), = summary["failed_tests"].items()
    assert test_id.endswith("::test_fails_every_other_run") and entry["runs"] == [1, 3]
    assert "run number 0 failed" in entry["first_error"]
    assert [r["exit_status"] for r in summary["per_run"]] == [1, 0, 1]
    out = capsys.readouterr().out
    assert "1 of 3 runs passed" in out and "FAILED 2x (runs [1, 3])" in out
    # the worktree is gone
    listed = subprocess.run(["git", "worktree", "list"], cwd=flake_hunt.ROOT, capture_output=True, text=True).stdout
    assert "hiradix-flake-" not in listed


def test_flake_hunt_refuses_zero_runs_and_no_tests(capsys):
    with pytest.raises(SystemExit):
        flake_hunt.main(["--runs", "0", "tests/x.py"])
    with pytest.raises(SystemExit):
        flake_hunt.main(["--runs", "2"])
    assert "name the tests" in capsys.readouterr().err


# A test that says it runs, then waits; its fixture's teardown leaves a mark (as a server
# fixture's teardown stops its servers).
WAITING_TEST = textwrap.dedent('''
    import time
    from pathlib import Path
    import pytest

    HERE = Path(__file__).parent

    @pytest.fixture
    def marked():
        yield
        (HERE / "teardown-ran").write_text("yes")

    def test_waits(marked):
        (HERE / "started").write_text("yes")
        time.sleep(600)
''')


def test_a_stopped_flake_hunt_lets_pytest_tear_down_and_removes_its_worktree(tmp_path):
    test_file = tmp_path / "test_waiting.py"
    test_file.write_text(WAITING_TEST)
    hunt = subprocess.Popen([sys.executable, "-m", "hiradix.testing.flake_hunt", "--runs", "2", "--out",
                             str(tmp_path / "out"), str(test_file)], cwd=flake_hunt.ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "started").exists() and time.monotonic() < deadline and hunt.poll() is None:
            time.sleep(0.1)  # pytest starts in a fresh worktree (a few seconds)
        assert (tmp_path / "started").exists(), "the hunted test never started"
        hunt.send_signal(signal.SIGTERM)
        out, _ = hunt.communicate(timeout=60)
    finally:
        if hunt.poll() is None:
            hunt.kill()
    assert hunt.returncode == 143, out
    assert "stopped (SIGTERM)" in out, out
    assert (tmp_path / "teardown-ran").read_text() == "yes"  # pytest got SIGINT and tore down
    listed = subprocess.run(["git", "worktree", "list"], cwd=flake_hunt.ROOT, capture_output=True, text=True,
                            check=True).stdout  # fmt: skip
    assert "hiradix-flake-" not in listed
