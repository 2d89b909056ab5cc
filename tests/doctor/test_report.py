"""The report's lines and exit status, the command-line entry (``python -m hiradix``), and the pure probes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from hiradix.doctor.cli import launch_flags
from hiradix.doctor.install import pinned_sglang
from hiradix.doctor.nvme_dir import fs_type, kvikio_check
from hiradix.doctor.report import Check, Status, error, exit_status, ok, render, warning
from tests.doctor.helpers import doctor_main


def test_lines_and_exit_status():
    checks = [ok("sglang", "SGLang 0.5.23"), warning("o_direct", "tmpfs refuses it", "use ext4"),
              error("disk", "needs 512 GB,  100 GB free", "lower --hiradix-nvme-gb")]
    text = render(checks, "a note")
    assert text.splitlines() == [
        "ok       sglang           SGLang 0.5.23",
        "warning  o_direct         tmpfs refuses it | fix: use ext4",
        "error    disk             needs 512 GB, 100 GB free | fix: lower --hiradix-nvme-gb",
        "hiradix doctor: 1 ok, 1 warning, 1 error (exit status 1); a note",
    ]
    assert exit_status(checks[:2]) == 0 and exit_status(checks) == 1
    with pytest.raises(ValueError, match="needs a fix"):
        Check(Status.ERROR, "disk", "too small")


@pytest.mark.parametrize("words", [
    ["python", "-m", "sglang.launch_server", "--model-path", "M"],
    [".venv/bin/python3", "-m", "sglang.launch_server", "--model-path", "M"],
    ["sglang", "serve", "--model-path", "M"],
    ["--model-path", "M"],
])  # fmt: skip
def test_a_pasted_launch_command_is_accepted(words):
    assert launch_flags(words) == ["--model-path", "M"]


def test_the_pin_is_pyprojects():
    assert pinned_sglang() == "0.5.23"


def test_fs_type_and_kvikio(tmp_path):
    mounts = [line.split() for line in Path("/proc/self/mounts").read_text().splitlines()]
    assert fs_type(tmp_path) in {parts[2] for parts in mounts}
    assert fs_type(Path("/proc/self")) == "proc"
    line = kvikio_check()
    if importlib.util.find_spec("kvikio") is None:
        assert line.status is Status.OK and line.detail.startswith("KvikIO is not installed: the NVMe tier uses the POSIX path")
    else:
        assert line.detail.startswith("KvikIO")


def test_usage_errors_exit_2():
    rc, text = doctor_main([])
    assert rc == 2 and "usage: hiradix doctor" in text
    rc, text = doctor_main(["--help"])
    assert rc == 0 and "--store-timeout-s" in text


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hiradix", *args], check=False, capture_output=True, text=True, timeout=60)


def test_python_m_hiradix_dispatches():
    assert _run().returncode == 2
    unknown = _run("nope")
    assert unknown.returncode == 2 and "unknown command 'nope'" in unknown.stderr
    helped = _run("doctor", "--help")
    assert helped.returncode == 0 and "hiradix doctor" in helped.stdout


def test_an_unexpected_failure_is_a_line_not_a_traceback(monkeypatch):
    from hiradix.sglang_plugin import doctor_flags

    def broken(argv):
        raise RuntimeError("boom")

    monkeypatch.setattr(doctor_flags, "examine", broken)
    rc, text = doctor_main(["--verbose", "--", "--model-path", "M", "--enable-hiradix"])
    assert rc == 1
    assert "error    doctor           a check failed unexpectedly: RuntimeError: boom" in text
    assert "Traceback (most recent call last)" in text.split("--- what SGLang and hiradix printed")[1]
