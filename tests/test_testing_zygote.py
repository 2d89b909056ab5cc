"""The launcher zygote (hiradix.testing.zygote): forked launchers exit as cold ones do, with their
own arguments and log, and launches whose import-time environment differs get a zygote of their
own. Real SGLang imports (one zygote start is ~15 s here), no server. (That a forked server takes
its own environment shows in the e2e tests: e.g. the PD pair's decode gives a stalled request up
after its SGLANG_DISAGGREGATION_WAITING_TIMEOUT, tests/e2e/test_e2e_pd_dp.py.)"""

from __future__ import annotations

import os

import psutil
import pytest

from hiradix.testing import zygote
from hiradix.testing.server import cpu_env, launch_env

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _close_zygotes():
    yield
    zygote.close_all()


def test_forked_launchers_exit_as_cold_ones_with_their_own_args_and_log(tmp_path):
    env = launch_env(cpu_env())
    help_run = zygote.launch(["--help"], env, tmp_path / "help.log")
    assert help_run.wait(timeout=120) == 0
    assert "--enable-hiradix" in (tmp_path / "help.log").read_text()  # SGLang's parser, with the plugin's flags
    refused = zygote.launch(["--model-path", str(tmp_path), "--no-such-flag"], env, tmp_path / "refused.log")
    assert refused.wait(timeout=120) == 2  # argparse's exit status, as a cold launcher's
    assert "error:" in (tmp_path / "refused.log").read_text()
    assert "RuntimeWarning" not in (tmp_path / "refused.log").read_text()  # runs as __main__, cleanly
    # the child runs in its own session, as a child of the zygote, not of this process
    child = zygote.launch(["--help"], env, tmp_path / "child.log")
    parent = psutil.Process(child.pid).parent()
    assert parent is not None and parent.pid != os.getpid()
    assert "hiradix.testing.zygote" in " ".join(parent.cmdline())
    assert child.wait(timeout=120) == 0
    (key,) = [k for k, z in zygote._ZYGOTES.items() if z.proc.pid == parent.pid]
    other = launch_env({**cpu_env(threads_per_rank=None)})  # OMP_NUM_THREADS unset: read at torch import
    other_run = zygote.launch(["--help"], other, tmp_path / "other.log")
    assert psutil.Process(other_run.pid).parent().pid != parent.pid
    assert other_run.wait(timeout=120) == 0
    assert len(zygote._ZYGOTES) >= 2 and key in zygote._ZYGOTES
