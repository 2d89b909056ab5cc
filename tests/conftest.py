"""Shared fixtures: the venv's interpreter, a CPU launch environment, the tiny model."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from hiradix.testing.server import cpu_args

REPO_ROOT = Path(__file__).resolve().parent.parent

# Servers the tests start fork their scheduler and detokenizer processes instead of spawning them
# (patches/p09_cpu_fork_start_method.py: ~23 s less CPU per server start on this machine, and the
# suite starts ~50). `session_servers` below keep SGLang's own `spawn`, the start method users get.
# Set HIRADIX_MP_START_METHOD=spawn to run the whole suite with spawn.
os.environ.setdefault("HIRADIX_MP_START_METHOD", "fork")
# Their launchers are forked from one that imported SGLang once (hiradix.testing.zygote: ~10 s of
# CPU less per start). HIRADIX_TEST_ZYGOTE=0 starts every launcher cold.
os.environ.setdefault("HIRADIX_TEST_ZYGOTE", "1")

# Flags that let `sglang.launch_server` run on a CPU-only machine (hiradix.testing.server.cpu_args).
CPU_SERVER_FLAGS: tuple[str, ...] = tuple(cpu_args(4096))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def venv_python() -> str:
    """The interpreter that has SGLang and hiradix installed (.venv, else this one)."""
    return _venv_python()


@pytest.fixture(autouse=True)
def _launcher_config_env_restored():
    """Every test leaves ``HIRADIX_CONFIG`` as it found it.

    The launcher's hook (``flags.after_from_cli_args``) hands the configuration to the scheduler
    processes through that variable, so a test that runs it in-process sets it in the test
    process; ``monkeypatch.delenv(..., raising=False)`` of an absent variable records nothing to
    undo, and the value outlived such tests. A zygote started after that imported SGLang with it
    and installed hiradix's scheduler hooks in every stock server it forked (a stock server of
    tests/e2e/test_e2e_swa_pool.py logged "hiradix: prompts up to 0 tokens are admitted" and was
    killed, only when an in-process refusal test ran before it)."""
    from hiradix.config import ENV_VAR

    before = os.environ.get(ENV_VAR)
    yield
    if before is None:
        os.environ.pop(ENV_VAR, None)
    else:
        os.environ[ENV_VAR] = before


@pytest.fixture(scope="session")
def cpu_flags() -> list[str]:
    """`CPU_SERVER_FLAGS` as a fresh list."""
    return list(CPU_SERVER_FLAGS)


@pytest.fixture
def cpu_env() -> dict[str, str]:
    """Environment for a CPU SGLang process (the test servers' own, so their launchers fork from
    the same zygote): no stale HIRADIX_CONFIG, no plugin whitelist."""
    from hiradix.testing.server import cpu_env as server_cpu_env, launch_env

    env = launch_env(server_cpu_env())
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("HIRADIX_CONFIG", None)
    env.pop("SGLANG_PLUGINS", None)
    return env


def _build_tiny_model(python: str) -> Path:
    """models/tiny, built by scripts/make_model.py if missing (idempotent, a few seconds)."""
    import subprocess

    path = REPO_ROOT / "models" / "tiny"
    subprocess.run([python, str(REPO_ROOT / "scripts" / "make_model.py"), "--preset", "tiny", "--out", str(path)],
                   check=True)  # fmt: skip
    return path


def _venv_python() -> str:
    candidate = REPO_ROOT / ".venv" / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


@pytest.fixture(scope="session")
def tiny_model(venv_python: str) -> Path:
    """models/tiny, built by scripts/make_model.py if missing (idempotent, a few seconds)."""
    return _build_tiny_model(venv_python)


# The session's shared servers (`session_servers`), started when collection ends if a selected
# test uses them, so their cold start (~45 s on 2 cores) overlaps the tests that start no
# server, which run first (pytest_collection_modifyitems). Stopped by the fixture, or at the
# session's end if no test reached it.
_SESSION_SERVERS: dict = {}


def _start_session_servers(tiny_model: Path, tmp_path_factory) -> None:
    """Start ``stock`` and ``hiradix`` as `session_servers` describes them (not waiting)."""
    from hiradix.testing.server import ServerProcess, cpu_args, cpu_env

    tmp = tmp_path_factory.mktemp("session_servers")
    nvme = tmp / "nvme"
    nvme.mkdir()
    env = {**cpu_env(), "HIRADIX_MP_START_METHOD": "spawn", "HIRADIX_TEST_ZYGOTE": "0"}  # cold launchers
    _SESSION_SERVERS.update({
        "stock": ServerProcess(tiny_model, extra_args=cpu_args(32768) + ["--max-running-requests", "2"],
                               env=env, log_path=tmp / "stock.log"),
        "hiradix": ServerProcess(tiny_model, extra_args=cpu_args(8192) + [
            "--enable-hiradix", "--hiradix-dram-gb", "0.5", "--hiradix-nvme-path", str(nvme),
            "--hiradix-nvme-gb", "0.25"], env=env, log_path=tmp / "hiradix.log"),
    })  # fmt: skip
    for server in _SESSION_SERVERS.values():
        server.start(wait=False)


def pytest_collection_modifyitems(session, config, items):
    """Tests that start no server (unmarked) run first, then the e2e ones; each keeps its order."""
    items.sort(key=lambda item: item.get_closest_marker("e2e") is not None)


def pytest_collection_finish(session):
    """Start the session's shared servers now (not waiting) when a selected test uses them."""
    if session.config.option.collectonly or not any("session_servers" in getattr(item, "fixturenames", ())
                                                    for item in session.items):
        return
    _start_session_servers(_build_tiny_model(_venv_python()), session.config._tmp_path_factory)


@pytest.fixture(scope="session")
def session_servers(tiny_model: Path, tmp_path_factory):
    """The two servers most e2e tests share, started together once per session (stopped by
    PID at its end, also on failure): ``stock`` (stock RadixAttention, HBM 32,768 tokens: it
    never evicts here; 2 running, so requests queue) and ``hiradix`` (hiradix defaults, HBM
    8,192 tokens, DRAM 0.5 GB, an NVMe tier of 0.25 GB), both started as users start them: a
    cold launcher with SGLang's own ``spawn`` start method (the other test servers fork: see
    ``HIRADIX_MP_START_METHOD`` and ``HIRADIX_TEST_ZYGOTE`` above). They start when collection
    ends (`pytest_collection_finish`); this waits until both are healthy. Tests that need
    other flags start their own; tests that use these must not change what another test reads
    (no flush, no fault switches)."""
    from hiradix.testing.server import stop_all

    if not _SESSION_SERVERS:  # not started at collection's end (a plugin added the test later)
        _start_session_servers(tiny_model, tmp_path_factory)
    try:
        for server in _SESSION_SERVERS.values():
            server.wait_healthy()
        yield _SESSION_SERVERS
    finally:
        stop_all(_SESSION_SERVERS.values())


@pytest.fixture(scope="session")
def stock_server(session_servers):
    """Stock SGLang on models/tiny for the session (see `session_servers`)."""
    return session_servers["stock"]


@pytest.fixture(scope="session")
def hiradix_server(session_servers):
    """SGLang + hiradix (defaults, NVMe tier) on models/tiny for the session (see `session_servers`)."""
    return session_servers["hiradix"]


@pytest.fixture(scope="session")
def stock_outputs(stock_server) -> list[list[dict]]:
    """Greedy outputs of stock SGLang on the e2e workload (``tests.helpers.e2e``): 20 sessions
    x 4 turns, an HBM pool that keeps everything, a queue (2 running). Once per session."""
    from tests.helpers.e2e import SESSIONS, TURNS, WORDS, run_sessions

    return run_sessions(stock_server.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test (its call or its setup) while processes the testing helpers started are alive
    (servers with their schedulers, detokenizers and I/O workers, routers, Mooncake processes)
    gets a summary of their stacks (py-spy) and log tails in its report, and the whole snapshot
    with a copy of their logs under ``hiradix.testing.diagnose.failure_dir()`` (``.ci/run`` prints
    the summaries at its end). Runs before the fixtures'
    teardown stops them; a readiness wait that times out inside a fixture puts its own snapshot in
    its error (``ServerProcess.wait_healthy``)."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or report.when == "teardown":
        return
    from hiradix.testing import diagnose

    processes = diagnose.watched()
    if not processes:
        return
    text = diagnose.snapshot(processes)
    target = diagnose.save_failure(f"{item.nodeid}-{report.when}", text, processes)
    report.sections.append(("hiradix: the processes this test started (summary)", diagnose.summary_of(text)))
    report.sections.append(("hiradix: every stack and whole logs", f"{target}/snapshot.txt and the logs beside it"))


# Wall seconds per test file (its tests' setup, call and teardown, module fixtures included),
# listed at the end of the run: where the suite's time goes, by module (issue 30's 20 minutes).
_FILE_WALL_S: dict[str, float] = {}
SLOWEST_FILES = 15


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    started = time.monotonic()
    yield
    path = item.nodeid.split("::", 1)[0]
    _FILE_WALL_S[path] = _FILE_WALL_S.get(path, 0.0) + time.monotonic() - started


def pytest_terminal_summary(terminalreporter):
    if not _FILE_WALL_S:
        return
    total_s = sum(_FILE_WALL_S.values())
    terminalreporter.section(f"slowest {SLOWEST_FILES} test files (wall seconds, of {total_s:,.0f} s in tests)")
    for path, took_s in sorted(_FILE_WALL_S.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES]:
        terminalreporter.write_line(f"{took_s:8.1f} s  {path}")


def pytest_sessionfinish(session, exitstatus):
    """Stop the shared servers if no test reached their fixture (an early stop, ``-x``), then end
    the launcher zygotes (after every fixture stopped its servers)."""
    from hiradix.testing import zygote
    from hiradix.testing.server import stop_all

    stop_all(_SESSION_SERVERS.values())
    zygote.close_all()
