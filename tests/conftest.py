"""Shared fixtures: the venv's interpreter, a CPU launch environment, the tiny model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from hiradix.testing.server import cpu_args

REPO_ROOT = Path(__file__).resolve().parent.parent

# Flags that let `sglang.launch_server` run on a CPU-only machine (hiradix.testing.server.cpu_args).
CPU_SERVER_FLAGS: tuple[str, ...] = tuple(cpu_args(4096))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def venv_python() -> str:
    """The interpreter that has SGLang and hiradix installed (.venv, else this one)."""
    candidate = REPO_ROOT / ".venv" / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable


@pytest.fixture(scope="session")
def cpu_flags() -> list[str]:
    """`CPU_SERVER_FLAGS` as a fresh list."""
    return list(CPU_SERVER_FLAGS)


@pytest.fixture
def cpu_env() -> dict[str, str]:
    """Environment for a CPU SGLang process: no stale HIRADIX_CONFIG, no plugin whitelist."""
    env = dict(os.environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("HIRADIX_CONFIG", None)
    env.pop("SGLANG_PLUGINS", None)
    return env


@pytest.fixture(scope="session")
def tiny_model(venv_python: str) -> Path:
    """models/tiny, built by scripts/make_model.py if missing (idempotent, a few seconds)."""
    import subprocess

    path = REPO_ROOT / "models" / "tiny"
    subprocess.run(
        [venv_python, str(REPO_ROOT / "scripts" / "make_model.py"), "--preset", "tiny", "--out", str(path)],
        check=True,
    )
    return path


@pytest.fixture(scope="session")
def stock_outputs(tiny_model: Path, tmp_path_factory) -> list[list[dict]]:
    """Greedy outputs of stock SGLang on the e2e workload (``tests.helpers.e2e``): 20 sessions
    x 4 turns, an HBM pool that keeps everything, a queue (2 running). Once per session."""
    from tests.helpers.e2e import SESSIONS, TURNS, WORDS, run_sessions, start

    log = tmp_path_factory.mktemp("stock") / "stock.log"
    with start(tiny_model, log, 32768, ["--max-running-requests", "2"]) as stock:
        return run_sessions(stock.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS)
