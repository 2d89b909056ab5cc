"""MLA models end to end (issue 18, items 1-2): DeepSeek V2, V3 and a Kimi-K2-shaped model.

The tiny presets of ``scripts/make_model.py`` (MLA attention, MoE MLPs, random weights) run on
stock SGLang 0.5.23 with ``patches/p06_torch_native_mla_dispatch.py``, and under hiradix with a
KV layout of one latent row per token and layer (``KVLayout.rope_dim``: ``ckv`` then ``kpe``).
All servers of the module start at once and stay up for its tests (integrity checked every step):

| server      | model            | tiers                                           | tests                          |
|-------------|------------------|-------------------------------------------------|--------------------------------|
| stock-v2    | tiny-deepseek-v2 | HBM 32,768 tokens (never evicts)                 | reference outputs              |
| hiradix-v2a | tiny-deepseek-v2 | HBM 1,024, DRAM 0.001 GB, NVMe, cluster store    | churn, store, restart          |
| hiradix-v2b | tiny-deepseek-v2 | same, its own NVMe, the same store               | turns moved from v2a hit the store |
| stock-v3 / hiradix-v3 | tiny-deepseek-v3 | as stock-v2 / HBM 1,024, DRAM 0.001 GB, NVMe | churn               |
| stock-k2 / hiradix-k2 | tiny-kimi-k2     | as stock-v2 / HBM 1,024, DRAM 0.001 GB, NVMe | churn               |
| stock-v2tp2 / hiradix-v2tp2 | tiny-deepseek-v2, TP 2 | as stock-v2 / HBM 1,024, DRAM 0.001 GB, NVMe 24 pages, the store | one host copy per node (DRAM, NVMe), one store copy per page |
| hiradix-v2tp2r | tiny-deepseek-v2, TP 2 | HBM 1,024, DRAM 0.001 GB, NVMe 0.1 GB, no store | restart of the shared NVMe copy |

Working set: 12 sessions x 3 turns (~3.6k tokens) against ~2.6k tokens of HBM + DRAM, so
histories fall to NVMe and come back from it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hiradix.sglang_plugin.model_check import page_bytes_estimate
from hiradix.testing.mooncake import MooncakeCluster
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env, stop_all
from tests.helpers.e2e import (assert_same_outputs, chat, settled, dram_pools_mapped, metric, mla_models, run_sessions,
                                settle_transfers, tier_hits, user_turn)
from tests.helpers.store import logged_key_prefix, wait_until_stored

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
PRESETS = ("tiny-deepseek-v2", "tiny-deepseek-v3", "tiny-kimi-k2")
SESSIONS, TURNS, WORDS = 12, 3, 25
ROUTED_SESSIONS = 4  # sessions 100.. moved between v2a and v2b every turn
PAGE_TOKENS = 16
TP2_NVME_GB = "0.0003"  # 24 slots of 12 KiB: the TP 2 server's histories overflow NVMe into the store
SYSTEM = {"role": "system", "content": "You are a terse assistant."}


def hiradix_flags(nvme: Path, store: MooncakeCluster | None) -> list[str]:
    nvme.mkdir(parents=True, exist_ok=True)
    flags = ["--max-running-requests", "2", "--page-size", str(PAGE_TOKENS), "--enable-hiradix",
             "--hiradix-dram-gb", "0.001", "--hiradix-nvme-path", str(nvme), "--hiradix-nvme-gb", "0.1",
             "--hiradix-load-timeout-s", "5"]  # fmt: skip
    if store is not None:
        flags += ["--hiradix-store", "mooncake", "--hiradix-store-config", store.config_json()]
    return flags


def make_server(model: Path, log: Path, flags: list[str], hbm_tokens: int, tp_size: int = 1) -> ServerProcess:
    env = {**cpu_env(tp_size=tp_size), "HIRADIX_CHECK_INTEGRITY": "1"}
    tp = ["--tp-size", str(tp_size)] if tp_size > 1 else []
    return ServerProcess(model, extra_args=cpu_args(hbm_tokens) + tp + flags, env=env, log_path=log,
                         startup_timeout_s=600)


@pytest.fixture(scope="module")
def mla_servers(store, tmp_path_factory) -> dict[str, ServerProcess]:
    root = tmp_path_factory.mktemp("mla")
    models = mla_models(PRESETS, REPO_ROOT / "models")
    stock_flags = ["--max-running-requests", "2", "--page-size", str(PAGE_TOKENS)]
    servers: dict[str, ServerProcess] = {}
    for preset, short in zip(PRESETS, ("v2", "v3", "k2")):
        servers[f"stock-{short}"] = make_server(models[preset], root / f"stock-{short}.log", stock_flags, 32768)
        ends = ("a", "b") if short == "v2" else ("",)
        for end in ends:
            flags = hiradix_flags(root / f"nvme-{short}{end}", store if short == "v2" else None)
            servers[f"hiradix-{short}{end}"] = make_server(models[preset], root / f"hiradix-{short}{end}.log", flags, 1024)
    # TP 2: stock TP 2 (the reference: TP changes the float sums), and hiradix with HBM, DRAM, a
    # 24-page NVMe tier and the store, so histories come back from all three, through the one
    # host copy the two ranks share (rank 0 writes it, its objects and its NVMe slots).
    v2 = models[PRESETS[0]]
    servers["stock-v2tp2"] = make_server(v2, root / "stock-v2tp2.log", stock_flags, 32768, tp_size=2)
    tp2_flags = hiradix_flags(root / "nvme-v2tp2", store)
    tp2_flags[tp2_flags.index("--hiradix-nvme-gb") + 1] = TP2_NVME_GB
    servers["hiradix-v2tp2"] = make_server(v2, root / "hiradix-v2tp2.log", tp2_flags, 1024, tp_size=2)
    # The restart of the shared NVMe copy needs an NVMe tier with room: on the 24-page one, full
    # after the churn, DRAM drops the last local copy of a page the store holds, so a page below
    # it on NVMe waits for a parent that never comes down and a restart finds as few as 0 pages.
    servers["hiradix-v2tp2r"] = make_server(v2, root / "hiradix-v2tp2r.log", hiradix_flags(root / "nvme-v2tp2r", None),
                                            1024, tp_size=2)
    try:
        for server in servers.values():
            server.start(wait=False)
        for server in servers.values():
            server.wait_healthy()
        yield servers  # a test may replace a server (restart): the one in the dict is stopped
    finally:
        stop_all(servers.values())


@pytest.fixture(scope="module")
def stock_results(mla_servers) -> dict[str, list[list[dict]]]:
    """The churn workload on the three stock servers (reference outputs), once per module."""
    return {short: run_sessions(mla_servers[f"stock-{short}"].base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS)
            for short in ("v2", "v3", "k2")}  # fmt: skip


def assert_sane(server: ServerProcess) -> str:
    log = server.log_text()
    assert "Traceback" not in log and "IntegrityError" not in log, log[-4000:]
    return log


@pytest.mark.parametrize("preset, short, name", [(PRESETS[0], "v2", "v2a"), (PRESETS[1], "v3", "v3"),
                                                 (PRESETS[2], "k2", "k2")], ids=["deepseek-v2", "deepseek-v3", "kimi-k2"])
def test_every_tier_churning_gives_the_outputs_of_stock(mla_servers, stock_results, preset, short, name):
    server = mla_servers[f"hiradix-{name}"]
    got = run_sessions(server.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS)
    assert_same_outputs(got, stock_results[short])
    hits = tier_hits(got)
    assert hits["storage"] > 0, hits  # histories came back from NVMe (or the store)
    # ... through DRAM: pages went HBM -> DRAM -> NVMe and back NVMe -> DRAM -> HBM (whether a turn
    # finds its pages still in DRAM, "host" hits, depends on timing: a fresh clone had none for v3)
    for kind in ("BACKUP", "DEMOTE", "PROMOTE"):
        assert metric(server.base_url, "sglang:hiradix_moved_tokens_total", kind=kind) > 0, kind
    assert metric(server.base_url, "sglang:hiradix_prefetch_tokens_total", outcome="completed") > 0
    # One latent row per token and layer, no K/V split: the page the tiers hold is the launcher's estimate.
    config = json.loads((Path(server.model_path) / "config.json").read_text())
    page_bytes = page_bytes_estimate(config, PAGE_TOKENS, 1, "float32")
    assert page_bytes == config["num_hidden_layers"] * PAGE_TOKENS * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4
    log = assert_sane(server)
    assert re.search(rf"hiradix tiers: DRAM \d+ pages \({page_bytes} B each\)", log), log[-3000:]


def from_store(r: dict) -> int:
    m = re.search(r"mooncake=(\d+)", r["details"].get("storage_backend") or "")
    return int(m.group(1)) if m else 0


def test_turns_moved_to_the_other_server_hit_through_the_store(mla_servers, store_reader):
    a, b, stock = mla_servers["hiradix-v2a"], mla_servers["hiradix-v2b"], mla_servers["stock-v2"]
    key_prefix = logged_key_prefix(a.log_text())
    assert logged_key_prefix(b.log_text()) == key_prefix  # same model, layout and rank: one key space
    histories = [[SYSTEM] for _ in range(ROUTED_SESSIONS)]
    got: list[list[dict]] = [[] for _ in range(ROUTED_SESSIONS)]
    for t in range(TURNS):
        for s in range(ROUTED_SESSIONS):
            histories[s].append({"role": "user", "content": user_turn(100 + s, t, WORDS)})
            got[s].append(chat((a, b)[(s + t) % 2].base_url, histories[s], return_token_ids=True))
            histories[s].append({"role": "assistant", "content": got[s][-1]["text"]})
        # PUTs are asynchronous (write-through once a page is in DRAM): the next turn moves to the
        # other server once the store lists every whole page of this round's prompts, as a user's
        # think time would let it.
        for session in got:
            wait_until_stored(store_reader, key_prefix, session[-1]["prompt_ids"], PAGE_TOKENS)
    expected = run_sessions(stock.base_url, ROUTED_SESSIONS, TURNS, WORDS, first_session=100)
    assert_same_outputs(got, expected)
    first_cross = [session[1] for session in got]  # the other server never saw these sessions
    assert sum(map(from_store, first_cross)) >= sum(session[0]["prompt_tokens"] // 2 for session in got), first_cross
    for server in (a, b):
        assert metric(server.base_url, "sglang:hiradix_store_pages_total", op="put") > 0
        assert metric(server.base_url, "sglang:hiradix_store_pages_total", op="get") > 0
        assert_sane(server)


def test_restart_re_indexes_the_nvme_tier_of_latent_pages(mla_servers, tmp_path):
    old = mla_servers["hiradix-v2a"]
    prompt = [SYSTEM, {"role": "user", "content": user_turn(0, 0, WORDS)}]
    before = chat(old.base_url, prompt)
    settle_transfers(old.base_url)  # demotions in flight at a stop never reach the index
    nvme_tokens = metric(old.base_url, "sglang:hiradix_tier_used_tokens", tier="NVMe")
    old.stop()
    assert nvme_tokens > 0
    new = ServerProcess(old.model_path, extra_args=old.extra_args, env=old.env, log_path=tmp_path / "restarted.log")
    mla_servers["hiradix-v2a"] = new  # stopped by the module fixture
    new.start()
    restored = metric(new.base_url, "sglang:hiradix_nvme_restored_pages")
    after = chat(new.base_url, prompt)
    log = assert_sane(new)
    logged = re.search(r"same fingerprint; re-indexed (\d+) pages", log)
    assert logged and int(logged.group(1)) == restored > 0, log[-3000:]
    assert after["text"] == before["text"] and after["details"].get("device", 0) == 0
    assert after["cached"] >= PAGE_TOKENS, after  # from the re-indexed NVMe pages (or the store)


def test_tp2_ranks_share_one_host_copy_and_one_store_copy_and_match_stock_tp2(mla_servers, store):
    """MLA at TP 2: both ranks hold the same latent, so the node keeps one host copy: one DRAM pool
    that rank 0 writes and both ranks' schedulers map, one NVMe tier (rank 0's directory), and the
    store gets one object per page (rank 0 puts, its keys carry no rank); histories come back into
    both ranks' device pools from that one copy, with the outputs of stock TP 2."""
    stock, server = mla_servers["stock-v2tp2"], mla_servers["hiradix-v2tp2"]
    assert len(dram_pools_mapped(server)) == 1  # per-rank copies would be two memory files
    keys_before = store.key_count()
    expected = run_sessions(stock.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS, first_session=200)
    got = run_sessions(server.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS, first_session=200)
    assert_same_outputs(got, expected)
    hits = tier_hits(got)
    assert hits["storage"] > 0, hits  # histories came back from the store, on both ranks (same tokens)
    puts = {rank: metric(server.base_url, "sglang:hiradix_store_pages_total", op="put", tp_rank=str(rank)) for rank in (0, 1)}
    new_keys = store.key_count() - keys_before
    # One object per page, not one per rank (keys with the rank would make 2 x puts[0]); a page put
    # again after its record was dropped rewrites its object, so a few puts add no key.
    assert puts[0] > 0 and 0.9 * puts[0] <= new_keys <= puts[0], (puts, new_keys)
    gets = {rank: metric(server.base_url, "sglang:hiradix_store_pages_total", op="get", tp_rank=str(rank)) for rank in (0, 1)}
    assert gets[0] == gets[1] > 0, gets  # the ranks' books agree (rank 0 alone reads, into the shared pool)
    # the NVMe tier: rank 0's directory only, used by both ranks' books alike
    command = server.command()
    nvme_root = Path(command[command.index("--hiradix-nvme-path") + 1])
    assert sorted(p.name for p in nvme_root.iterdir()) == ["hiradix-rank0"]
    # both ranks' books moved the same pages (NVMe reads, PREFETCH, depend on timing: not required)
    moved = settled(lambda: {rank: [metric(server.base_url, "sglang:hiradix_moved_tokens_total", kind=k, tp_rank=str(rank))
                                    for k in ("BACKUP", "DEMOTE", "PREFETCH", "PROMOTE")] for rank in (0, 1)},
                    lambda m: m[0] == m[1])  # fmt: skip
    assert moved[0] == moved[1] and moved[0][1] > 0 and moved[0][3] > 0, moved
    log = assert_sane(server)
    assert "TP ranks disagree" not in log and "mapped by this rank" in log



def test_tp2_restart_re_indexes_the_shared_nvme_tier_on_both_ranks(mla_servers, tmp_path):
    """The node's one NVMe copy after a restart: rank 0 re-indexes its directory and hands the
    pages to rank 1, so both ranks' trees (and books) start with the same NVMe nodes: every page
    the durable index listed at the stop, which, with room on NVMe, is every page NVMe held."""
    old = mla_servers["hiradix-v2tp2r"]
    run_sessions(old.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS, first_session=300)  # histories reach NVMe
    prompt = [SYSTEM, {"role": "user", "content": user_turn(300, 0, WORDS)}]
    before = chat(old.base_url, prompt)
    settle_transfers(old.base_url, tp_rank="0")  # demotions in flight at a stop never reach the index
    nvme_tokens = metric(old.base_url, "sglang:hiradix_tier_used_tokens", tier="NVMe", tp_rank="0")
    durable = metric(old.base_url, "sglang:hiradix_nvme_durable_pages", tp_rank="0")
    old.stop()
    assert durable * PAGE_TOKENS == nvme_tokens > 0, (durable, nvme_tokens)  # no page waits for its parent
    listed = re.findall(r"TP0\] hiradix: stop: .*the durable index lists (\d+) pages", old.log_text())
    assert listed == [str(int(durable))], listed  # rank 0's stop line (rank 1 keeps no index)
    new = ServerProcess(old.model_path, extra_args=old.extra_args, env=old.env, log_path=tmp_path / "restarted.log",
                        startup_timeout_s=600)
    mla_servers["hiradix-v2tp2r"] = new  # stopped by the module fixture
    new.start()
    restored = [metric(new.base_url, "sglang:hiradix_nvme_restored_pages", tp_rank=str(r)) for r in (0, 1)]
    assert restored[0] == restored[1] == durable, (restored, durable)
    after = chat(new.base_url, prompt)
    assert after["text"] == before["text"] and after["cached"] >= PAGE_TOKENS, after
    log = assert_sane(new)
    assert "TP ranks disagree" not in log
