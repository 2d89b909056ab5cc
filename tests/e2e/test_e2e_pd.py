"""PD disaggregation, prefill side (issue 18, item 4): hiradix on the prefill server behind SGLang's router.

| process  | what                                                                                          |
|----------|-----------------------------------------------------------------------------------------------|
| prefill  | SGLang + hiradix, `--disaggregation-mode prefill`, `mooncake_tcp`, HBM 1,024 tokens, DRAM 0.002 GB, NVMe, integrity checked every step |
| decode   | stock SGLang, `--disaggregation-mode decode`, `mooncake_tcp`, the prefill server's page size (16)   |
| router   | `smg launch --pd-disaggregation --prefill URL BOOTSTRAP --decode URL` (PyPI smg 1.13.0)        |

On this CPU path both servers need `--disable-overlap-schedule` and stock SGLang needs
`patches/p07_pd_prefill_host_indices_cpu.py` (its prefill side otherwise dies at the first KV
send, `pin_memory=True`). Multi-turn chats through the router give the greedy outputs of a
single stock server (the session's `stock_outputs`), and the prefill server's histories come
back from its DRAM and NVMe tiers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hiradix.testing.router import RouterProcess
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env, pick_free_port
from tests.helpers.e2e import WORDS, assert_same_outputs, metric, run_sessions

pytestmark = pytest.mark.e2e

SESSIONS, TURNS = 8, 3
# `--served-model-name default`: the router picks PD workers by model id, and the chats name "default".
PD_FLAGS = ["--page-size", "16", "--disaggregation-transfer-backend", "mooncake_tcp", "--disable-overlap-schedule",
            "--max-running-requests", "2", "--served-model-name", "default"]  # fmt: skip


@pytest.fixture(scope="module")
def pd(tiny_model: Path, tmp_path_factory):
    """Prefill (hiradix), decode (stock) and the router, started together; stopped by PID."""
    tmp = tmp_path_factory.mktemp("pd")
    nvme = tmp / "nvme"
    nvme.mkdir()
    bootstrap = pick_free_port()
    env = {**cpu_env(), "NO_PROXY": "127.0.0.1,localhost", "HIRADIX_CHECK_INTEGRITY": "1"}
    prefill = ServerProcess(tiny_model, extra_args=cpu_args(1024) + PD_FLAGS + [
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap),
        "--enable-hiradix", "--hiradix-dram-gb", "0.002", "--hiradix-nvme-path", str(nvme), "--hiradix-nvme-gb", "0.1",
        "--hiradix-load-timeout-s", "5"], env=env, log_path=tmp / "prefill.log")  # fmt: skip
    decode = ServerProcess(tiny_model, extra_args=cpu_args(32768) + PD_FLAGS + ["--disaggregation-mode", "decode"],
                           env=env, log_path=tmp / "decode.log")  # fmt: skip
    router = RouterProcess(tmp / "router.log", prefill=[(prefill.base_url, bootstrap)], decode=[decode.base_url])
    try:
        for server in (prefill, decode):
            server.start(wait=False)
        for server in (prefill, decode):
            server.wait_healthy()
        router.start()
        yield prefill, decode, router
    finally:
        router.stop()
        for server in (prefill, decode):
            server.stop()


def test_chats_through_the_pd_router_match_one_stock_server_and_hit_the_tiers(pd, stock_outputs):
    prefill, decode, router = pd
    got = run_sessions(router.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS)
    assert_same_outputs(got, [session[:TURNS] for session in stock_outputs[:SESSIONS]])
    # the prefill server's histories came back from DRAM (promotions) and from NVMe (reads)
    assert metric(prefill.base_url, "sglang:hiradix_moved_tokens_total", kind="PROMOTE") > 0
    assert metric(prefill.base_url, "sglang:hiradix_prefetch_tokens_total", outcome="completed") > 0
    reused = sum(r["cached"] for session in got for r in session[1:])
    assert reused >= sum(session[0]["prompt_tokens"] // 2 for session in got), reused  # later turns hit
    log = prefill.log_text()
    assert "Traceback" not in log and "IntegrityError" not in log, log[-4000:]
    assert "Traceback" not in decode.log_text()
