"""Compressed cold tiers end to end (``--hiradix-cold-format``; issue 21).

Real servers of the tiny model (random weights, float32) with small HBM and DRAM, NVMe and one
loopback Mooncake Store; the cold tiers hold fp8 pages. fp8 changes KV values, so outputs are not
guaranteed identical to stock (the README says so): the tests check that every request is
answered, that histories really come back through the compressed tiers, and that the answer
computed from decoded fp8 KV stays close to stock's (output logprobs).

| server   | tiers                                             | tests                                  |
|----------|---------------------------------------------------|----------------------------------------|
| stock    | HBM 32,768 tokens                                 | reference                              |
| fp8      | HBM 2,048, DRAM 0.004 GB, NVMe + store in fp8     | churn, a history read back from NVMe, restart as int4 |
| fp8tp2   | the same at TP 2 (each rank its own heads; DRAM 0.002 GB: half-size pages) | churn         |
| fp8dram  | as fp8 with `--hiradix-cold-tiers dram`: DRAM holds fp8 pages (encoded and decoded on the KV device) | churn, a history promoted from DRAM, DRAM capacity |
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from hiradix.testing.mooncake import MooncakeCluster
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env, stop_all
from tests.helpers.e2e import flush_tiers, generate_with_logprobs, metric, run_sessions, tier_hits

pytestmark = pytest.mark.e2e

SESSIONS, TURNS, WORDS, PAGE = 10, 3, 40, 16


def cold_flags(root: Path, name: str, store: MooncakeCluster, fmt: str = "fp8", dram_gb: str = "0.004") -> list[str]:
    nvme = root / f"nvme-{name}"
    nvme.mkdir(parents=True, exist_ok=True)
    return ["--page-size", str(PAGE), "--max-running-requests", "2", "--enable-hiradix",
            "--hiradix-dram-gb", dram_gb, "--hiradix-nvme-path", str(nvme), "--hiradix-nvme-gb", "0.1",
            "--hiradix-store", "mooncake", "--hiradix-store-config", store.config_json(),
            "--hiradix-cold-format", fmt]  # fmt: skip


@pytest.fixture(scope="module")
def servers(tiny_model, store, tmp_path_factory) -> dict[str, ServerProcess]:
    root = tmp_path_factory.mktemp("cold")
    found = {
        "stock": ServerProcess(tiny_model, extra_args=cpu_args(32768) + ["--page-size", str(PAGE)], env=cpu_env(),
                               log_path=root / "stock.log"),
        "fp8": ServerProcess(tiny_model, extra_args=cpu_args(2048) + cold_flags(root, "fp8", store),
                             env={**cpu_env(), "HIRADIX_CHECK_INTEGRITY": "1"}, log_path=root / "fp8.log"),
        "fp8dram": ServerProcess(tiny_model, extra_args=cpu_args(2048) + cold_flags(root, "dram", store) + [
            "--hiradix-cold-tiers", "dram"], env={**cpu_env(), "HIRADIX_CHECK_INTEGRITY": "1"}, log_path=root / "dram.log"),
        "fp8tp2": ServerProcess(tiny_model, extra_args=cpu_args(2048) + cold_flags(root, "tp2", store, dram_gb="0.002") + ["--tp-size", "2"],
                                env={**cpu_env(tp_size=2), "HIRADIX_CHECK_INTEGRITY": "1"}, log_path=root / "tp2.log",
                                startup_timeout_s=600),
    }
    try:
        for server in found.values():
            server.start(wait=False)
        for server in found.values():
            server.wait_healthy()
        yield found
    finally:
        stop_all(found.values())


def generate(base_url: str, input_ids: list[int]) -> dict:
    return generate_with_logprobs(base_url, input_ids, 8)


def read_back_close_to_stock(server: ServerProcess, stock: ServerProcess, seed: int, pushes: int) -> dict:
    """Send a 600-token prompt, then ``pushes`` other 500-token prompts, then the prompt + 8 tokens
    again; returns that last answer of ``server`` after asserting its output logprobs are within 0.5
    nats of ``stock``'s."""
    rng = random.Random(seed)
    prompt = [rng.randrange(10, 4000) for _ in range(600)]
    generate(server.base_url, prompt)
    for _ in range(pushes):
        generate(server.base_url, [rng.randrange(10, 4000) for _ in range(500)])
    again = prompt + [rng.randrange(10, 4000) for _ in range(8)]
    got, ref = generate(server.base_url, again), generate(stock.base_url, again)
    worst = max(abs(a - b) for a, b in zip(got["logprobs"], ref["logprobs"]))
    assert worst < 0.5, (got["logprobs"], ref["logprobs"])
    return got


@pytest.mark.parametrize("name, tiers", [("fp8", "nvme, store"), ("fp8tp2", "nvme, store"),
                                         ("fp8dram", "dram, nvme, store")])
def test_churn_through_fp8_tiers_answers_every_request(servers, name, tiers):
    server = servers[name]
    got = run_sessions(server.base_url, SESSIONS, TURNS, WORDS, parallel=2)
    assert all(len(session) == TURNS and all(r["completion_tokens"] > 0 for r in session) for session in got)
    assert tier_hits(got)["storage"] > 0  # histories came back from NVMe or the store, decoded from fp8
    assert metric(server.base_url, "sglang:hiradix_store_pages_total", op="put") > 0
    log = server.log_text()
    assert "Traceback" not in log and "IntegrityError" not in log, log[-3000:]
    assert f"fp8 pages in {tiers}" in log, log[-3000:]


def test_a_history_read_back_from_fp8_stays_close_to_stock(servers):
    """A 600-token prompt leaves HBM and DRAM for NVMe (fp8); asked again with 8 more tokens it
    hits from storage, and its answer's logprobs stay within 0.5 nats of stock's."""
    # 8 other prompts push it out of HBM (2,048 tokens) and DRAM (~122 pages)
    got = read_back_close_to_stock(servers["fp8"], servers["stock"], seed=5, pushes=8)
    assert got["details"].get("storage", 0) >= 512, got  # read back through the compressed tiers


def test_a_history_promoted_from_fp8_dram_stays_close_to_stock_and_dram_holds_more_pages(servers):
    """DRAM as a cold tier: a 600-token prompt leaves HBM (2,048 tokens) for DRAM, where it is held
    as fp8 pages; asked again it is promoted (decoded on the device, here the CPU) and its answer's
    logprobs stay within 0.5 nats of stock's. The same 0.004 GB hold ~4x the pages of the exact
    float32 DRAM of the `fp8` server."""
    dram = servers["fp8dram"]
    # The churn test left DRAM short (under a quarter free): a page demoted to NVMe would then leave
    # DRAM at once (Placement.after_demote). From empty tiers, 2,000 more tokens push the prompt
    # out of HBM, not out of DRAM (~490 fp8 pages).
    flush_tiers(dram.base_url)
    got = read_back_close_to_stock(dram, servers["stock"], seed=7, pushes=4)
    assert got["details"].get("host", 0) >= 512, got  # promoted from the encoded DRAM tier
    assert metric(dram.base_url, "sglang:hiradix_moved_tokens_total", kind="PROMOTE") >= 512
    sizes = {}
    for name in ("fp8", "fp8dram"):
        m = re.search(r"hiradix tiers: DRAM (\d+) pages \((\d+) B each\)", servers[name].log_text())
        assert m, servers[name].log_text()[-3000:]
        sizes[name] = (int(m.group(1)), int(m.group(2)))
    assert sizes["fp8dram"][0] >= 3.5 * sizes["fp8"][0], sizes  # float32 pages -> fp8: ~3.98x
    assert sizes["fp8dram"][0] * sizes["fp8dram"][1] <= 4_000_000, sizes  # within the same DRAM bytes
    assert "Traceback" not in dram.log_text()


def test_restart_with_another_format_reuses_no_page(servers, tmp_path):
    """The NVMe tier was written in fp8; restarted with int4 the index's fingerprint differs, so
    nothing is re-indexed (no fp8 page is read as int4), and the server answers as before."""
    old = servers["fp8"]
    old.stop()
    args = list(old.extra_args)
    args[args.index("--hiradix-cold-format") + 1] = "int4"
    new = ServerProcess(old.model_path, extra_args=args, env=old.env, log_path=tmp_path / "int4.log")
    servers["fp8"] = new  # stopped by the module fixture
    new.start()
    assert metric(new.base_url, "sglang:hiradix_nvme_restored_pages") == 0
    log = new.log_text()
    assert re.search(r"NVMe index .* was written for another setup .*page_format", log), log[-3000:]
    got = run_sessions(new.base_url, 2, 2, WORDS)
    assert all(r["completion_tokens"] > 0 for session in got for r in session)
