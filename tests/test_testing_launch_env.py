"""What a process started by the testing helpers inherits (hiradix/testing/server.py
``launch_env``): never the test process's Mooncake client settings.

A CI run failed a PD chat this way: the e2e cluster module's in-process store reader set
``MC_TCP_STATUS_TIMEOUT_SEC=2`` and ``MC_TCP_PROGRESS_TIMEOUT_SEC=2`` in the pytest process
(a Mooncake client sets its settings process-wide), the PD module's servers inherited them, and
SGLang's own KV transfer engine dropped a prefill-to-decode transfer that made no progress for
2 s on the loaded machine ("ClientSession: no transfer progress within 2s"), then refused the
decode server's session for every request until its probe recovered it."""

from __future__ import annotations

import os
import textwrap
import time

from hiradix.testing.server import ServerProcess, launch_env
from tests.helpers.e2e import fake_sglang

# A launcher that writes the Mooncake variables it got to its log, then waits to be stopped.
ENV_PRINTING_LAUNCH_SERVER = textwrap.dedent('''
    import json, os, time
    print("MC env:", json.dumps({k: v for k, v in sorted(os.environ.items()) if k.startswith("MC_")}), flush=True)
    time.sleep(600)
''')


def test_a_started_server_gets_only_the_mooncake_variables_passed_to_it(tmp_path, monkeypatch):
    # what an in-process store client leaves behind (hiradix.tiers.store.mooncake.mooncake_env)
    monkeypatch.setenv("MC_TCP_STATUS_TIMEOUT_SEC", "2")
    monkeypatch.setenv("MC_TCP_PROGRESS_TIMEOUT_SEC", "2")
    monkeypatch.setenv("HIRADIX_LAUNCH_ENV_MARK", "kept")
    assert "MC_TCP_STATUS_TIMEOUT_SEC" not in launch_env()
    assert launch_env({"MC_FORCE_TCP": "1"})["MC_FORCE_TCP"] == "1"  # passed on purpose: kept
    assert launch_env()["HIRADIX_LAUNCH_ENV_MARK"] == "kept"  # everything else is inherited

    env = {**fake_sglang(tmp_path, ENV_PRINTING_LAUNCH_SERVER), "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    server = ServerProcess("unused-model", env=env, log_path=tmp_path / "s.log", stop_grace_s=2)
    server.start(wait=False)
    try:
        deadline = time.monotonic() + 60
        while "MC env:" not in server.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)  # the fake launcher prints once, right after its interpreter starts
        line = next(x for x in server.log_path.read_text().splitlines() if x.startswith("MC env:"))
    finally:
        server.stop()
    assert line == 'MC env: {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}', line
    assert os.environ["MC_TCP_STATUS_TIMEOUT_SEC"] == "2"  # the test process's own setting untouched


def test_launch_env_never_passes_on_the_launchers_config_channel(monkeypatch):
    """A HIRADIX_CONFIG left in the test process (by a test that ran the launcher's hook in-process)
    must not reach a server or a zygote: it would install hiradix's scheduler hooks in a stock one."""
    from hiradix.config import ENV_VAR
    from hiradix.testing.server import LAUNCHER_CONFIG_ENV

    assert LAUNCHER_CONFIG_ENV == ENV_VAR
    monkeypatch.setenv(ENV_VAR, '{"policy": "lru"}')
    assert ENV_VAR not in launch_env()
    assert launch_env({ENV_VAR: "given"})[ENV_VAR] == "given"  # passed on purpose: kept
