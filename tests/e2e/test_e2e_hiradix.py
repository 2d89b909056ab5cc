"""End to end: real `sglang.launch_server` processes on the tiny model, hiradix vs stock.

* Foundation: 5 sessions x 4 turns through /v1/chat/completions at temperature 0 (float32):
  outputs token-identical to stock SGLang, cached_tokens > 0 from turn 2, hiradix in the log.
* Tiers: an HBM pool far smaller than the working set, a small DRAM tier and an NVMe tier;
  20 sessions x 4 turns interleaved so histories fall to NVMe; from turn 2 hits come from
  DRAM and NVMe (per-request cached_tokens_details), outputs identical to a stock server
  whose HBM holds everything; with each policy (`lru`, `lookahead`, `predictive`).
* Faults (a slow disk, a crashing worker, ENOSPC, bad reads, a truncated file): see
  tests/e2e/test_e2e_faults.py.

Servers are stopped by PID (whole process group) also when an assertion fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.request
from pathlib import Path

import psutil
import pytest

from hiradix.testing.server import stop_all
from tests.helpers.e2e import (
    SESSIONS,
    TURNS,
    WORDS,
    assert_same_outputs,
    chat,
    metric,
    run_sessions,
    start,
    tier_hits,
    tiered_flags,
    user_turn,
)

pytestmark = pytest.mark.e2e

# stock_outputs: tests/conftest.py (one stock run per session, shared by the e2e modules)


def test_foundation_sessions_match_stock(hiradix_server, stock_outputs):
    """5 sessions x 4 turns, HBM-sized so nothing is evicted: hiradix == stock RadixAttention."""
    got = run_sessions(hiradix_server.base_url, 5, TURNS, WORDS)
    assert "hiradix: TieredRadixCache in use" in hiradix_server.log_text()
    assert_same_outputs(got, stock_outputs[:5])
    for s in range(5):
        for t in range(1, TURNS):
            assert got[s][t]["cached"] > 0, (s, t, got[s][t])


def test_the_next_turn_reuses_the_partial_last_page_as_stock_does_at_page_size_one(hiradix_server, stock_server):
    """Default ``--hiradix-partial-page on`` at page size 16: the first turn's partly filled last
    page stays in HBM, so the second turn computes only what stock SGLang at page size 1 (the
    session's stock server) computes: the same cached tokens, not a multiple of 16, and the same
    outputs."""
    got = {}
    for name, server in (("stock", stock_server), ("hiradix", hiradix_server)):
        history = [{"role": "user", "content": user_turn(900, 0, WORDS)}]
        first = chat(server.base_url, history, return_token_ids=True)
        history += [{"role": "assistant", "content": first["text"]},
                    {"role": "user", "content": user_turn(900, 1, WORDS)}]
        got[name] = (first, chat(server.base_url, history, return_token_ids=True))
    (stock_first, stock_second), (first, second) = got["stock"], got["hiradix"]
    assert (first["text"], second["text"]) == (stock_first["text"], stock_second["text"])
    assert second["prompt_ids"] == stock_second["prompt_ids"]
    # The first turn's KV: its prompt and every answer token but the last (never fed back).
    kv = first["prompt_ids"] + first["output_ids"][:-1]
    shared = next((i for i, (a, b) in enumerate(zip(kv, second["prompt_ids"])) if a != b), min(len(kv), len(second["prompt_ids"])))
    assert second["cached"] == stock_second["cached"] == shared, (second["cached"], stock_second["cached"], shared)
    assert shared % 16, shared  # this prompt's shared part ends inside a page (else nothing to show)
    assert metric(hiradix_server.base_url, "sglang:hiradix_partial_page_tokens_total") >= shared % 16


def test_a_prompt_diverging_inside_a_cached_page_reuses_its_leading_rows_as_stock_does_at_page_size_one(
        hiradix_server, stock_server):
    """Copy-on-write of a tree page (default ``--hiradix-partial-page on``): a second prompt that
    leaves the first one inside a whole page gets that page's leading rows copied into a page of
    its own; it caches what stock at page size 1 caches, with stock's outputs."""
    first_text = user_turn(901, 0, WORDS)
    second_text = first_text.rsplit(" ", 3)[0] + " something else entirely"
    got = {}
    for name, server in (("stock", stock_server), ("hiradix", hiradix_server)):
        a = chat(server.base_url, [{"role": "user", "content": first_text}], return_token_ids=True)
        b = chat(server.base_url, [{"role": "user", "content": second_text}], return_token_ids=True)
        got[name] = (a, b)
    (stock_a, stock_b), (a, b) = got["stock"], got["hiradix"]
    assert (a["text"], b["text"]) == (stock_a["text"], stock_b["text"])
    shared = next(i for i, (x, y) in enumerate(zip(a["prompt_ids"], b["prompt_ids"])) if x != y)
    assert shared < len(a["prompt_ids"]) // 16 * 16 and shared % 16, shared  # inside a whole page of the first
    reused = metric(hiradix_server.base_url, "sglang:hiradix_partial_page_tokens_total")
    assert b["cached"] == stock_b["cached"] == shared, (b["cached"], stock_b["cached"], shared)
    assert reused >= shared % 16


def generate_ids(base_url: str, input_ids: list[int], max_new_tokens: int) -> tuple[list[int], int]:
    """Greedy ``/generate`` on token ids: (output ids, cached tokens)."""
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                        "ignore_eos": True}}
    req = urllib.request.Request(f"{base_url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.loads(resp.read())
    return out["output_ids"], out["meta_info"]["cached_tokens"]


def test_short_prompts_and_regenerated_answers_cache_what_stock_does_at_page_size_one(hiradix_server, stock_server):
    """A break-it review's gaps: a continuation shorter than a page (the whole-page match is empty)
    and a regenerated answer (it shares only the start of the kept last page, which then stays
    for the original conversation) cache what stock at page size 1 caches; outputs are stock's."""
    got = {}
    for name, server in (("stock", stock_server), ("hiradix", hiradix_server)):
        first, _ = generate_ids(server.base_url, [7, 31], 4)  # 5 tokens of KV: less than a page
        short = generate_ids(server.base_url, [7, 31] + first + [10], 2)
        prompt = list(range(100, 121))  # 21 tokens: a whole page and a partial one
        answer, _ = generate_ids(server.base_url, prompt, 5)
        regen = generate_ids(server.base_url, prompt + [5, 6, 8], 2)  # shares 21 of its tokens only
        original = generate_ids(server.base_url, prompt + answer + [9, 9, 9, 9], 2)
        got[name] = [first, short, answer, regen, original]
    assert got["hiradix"] == got["stock"], got
    cached = [got["stock"][i][1] for i in (1, 3, 4)]
    assert cached == [5, 21, 25], cached  # the first turn's KV, the prompt, the prompt + 4 answer tokens


def spawned_children(server) -> bool:
    """Whether the server's launcher started its processes with multiprocessing's ``spawn``: only
    ``spawn`` (and ``forkserver``) start a ``multiprocessing.resource_tracker`` child; ``fork`` does not."""
    return any("multiprocessing.resource_tracker" in " ".join(child.cmdline()) for child in server.descendants())


def launcher_parent(server) -> str:
    """The command line of the process that started the server's launcher."""
    return " ".join(psutil.Process(server.pid).parent().cmdline())


def test_session_servers_spawn_and_fixture_servers_fork_their_processes(hiradix_server, tiered_runs):
    """The session's servers start as users start them: a cold launcher (a child of this test
    process) with SGLang's own start method (``spawn``). The other test servers' launchers are
    forked from the zygote (hiradix.testing.zygote) and fork their processes
    (patches/p09_cpu_fork_start_method.py); their scheduler and detokenizer serve the same (the
    tiered runs match stock: the tests below)."""
    assert spawned_children(hiradix_server)
    assert psutil.Process(hiradix_server.pid).parent().pid == os.getpid()
    assert [tiered_runs[policy + "_spawned"] for policy in ("lru", "lookahead", "predictive")] == [False] * 3
    parents = [tiered_runs[policy + "_launcher_parent"] for policy in ("lru", "lookahead", "predictive")]
    assert all("hiradix.testing.zygote" in parent for parent in parents), parents


@pytest.fixture(scope="module")
def tiered_runs(tiny_model: Path, tmp_path_factory) -> dict[str, list[list[dict]]]:
    """The same queued workload on hiradix `lru`, `lookahead` and `predictive`, HBM << working set.
    The three servers start together; the workloads run one server at a time."""
    runs = {}
    with contextlib.ExitStack() as stack:
        servers = {}
        stack.callback(lambda: stop_all(servers.values()))
        for policy in ("lru", "lookahead", "predictive"):
            tmp = tmp_path_factory.mktemp(policy)
            servers[policy] = start(tiny_model, tmp / "server.log", 2048, tiered_flags(tmp / "nvme", policy))
            servers[policy].start(wait=False)
        for policy, srv in servers.items():
            srv.wait_healthy()
            runs[policy] = run_sessions(srv.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS)
            runs[policy + "_prefetch_started"] = metric(srv.base_url, "sglang:hiradix_prefetch_tokens_total", outcome="started")
            for read in ("ahead", "at_admission"):
                runs[f"{policy}_storage_{read}"] = metric(srv.base_url, "sglang:hiradix_storage_hit_tokens_total", read=read)
            runs[policy + "_moved"] = {kind: metric(srv.base_url, "sglang:hiradix_moved_bytes_total", kind=kind)
                                       for kind in ("BACKUP", "PROMOTE", "DEMOTE", "PREFETCH")}
            runs[policy + "_log"] = srv.log_text()
            runs[policy + "_spawned"] = spawned_children(srv)
            runs[policy + "_launcher_parent"] = launcher_parent(srv)
    return runs


def test_tiers_histories_return_from_dram_and_nvme(tiered_runs, stock_outputs):
    """Issue 3: from turn 2 hits come from DRAM and NVMe; outputs equal stock with a big HBM."""
    got = tiered_runs["lru"]
    assert_same_outputs(got, stock_outputs)
    hits = tier_hits(got)
    assert hits["host"] > 0, hits
    assert hits["storage"] > 0, hits


def test_lookahead_serves_more_hits_from_dram_than_lru(tiered_runs, stock_outputs):
    """Issue 4: with a queue, the look-ahead window prefetches and protects queued prefixes:
    more hits are ready in DRAM at admission (DRAM residents, plus NVMe pages it read ahead)."""
    assert_same_outputs(tiered_runs["lookahead"], stock_outputs)
    share = {}
    for name in ("lookahead", "lru"):
        h = tier_hits(tiered_runs[name])
        share[name] = (h["host"] + tiered_runs[f"{name}_storage_ahead"]) / max(1, sum(h.values()))
    assert share["lookahead"] > share["lru"], share
    assert tiered_runs["lookahead_prefetch_started"] > 0 and tiered_runs["lookahead_storage_ahead"] > 0
    assert tiered_runs["lru_storage_ahead"] == 0  # lru never reads ahead


def test_storage_counts_every_token_read_from_nvme(tiered_runs):
    """Issue 14: NVMe hits are SGLang's `storage` whether the look-ahead read them early or the
    request waited: the per-request storage tokens add up to both kinds of NVMe hit."""
    for name in ("lookahead", "lru", "predictive"):
        per_request = sum(r["details"].get("storage", 0) or 0 for session in tiered_runs[name] for r in session)
        counted = tiered_runs[f"{name}_storage_ahead"] + tiered_runs[f"{name}_storage_at_admission"]
        assert per_request == counted > 0, (name, per_request, counted)


def test_predictive_policy_matches_stock_with_every_tier_churning(tiered_runs, stock_outputs):
    """Issue 12: `--hiradix-policy predictive` in the server keeps greedy outputs token-identical
    to stock while HBM, DRAM and NVMe all take and give back KV."""
    got = tiered_runs["predictive"]
    assert "policy=predictive" in tiered_runs["predictive_log"]
    assert_same_outputs(got, stock_outputs)
    moved = tiered_runs["predictive_moved"]
    assert all(moved[kind] > 0 for kind in ("BACKUP", "PROMOTE", "DEMOTE", "PREFETCH")), moved
    hits = tier_hits(got)
    assert hits["host"] > 0 and sum(hits.values()) > 0, hits
