"""Sliding-window hybrids on SGLang's hybrid SWA pool, torch-native backend (issue 33, part 2).

``models/tiny-mellum-swa`` (scripts/make_model.py --preset tiny-mellum-swa, scripts/mellum_arch.py): SGLang 0.5.23's
``MellumForCausalLM``, 4 layers, 3 of them sliding with a 32-token window, random weights. SGLang
serves it from ``SWAKVPool`` (a full pool and a smaller SWA pool, slots translated through
``full_to_swa_index_mapping``, SWA slots freed once out of the window, the SWA radix tree keeping
tombstones). Stock torch-native read the SWA pool with full-pool locations (an IndexError once
they pass the SWA pool's size, wrong outputs before); patches/p12_torch_native_swa_pool.py
translates them. Two stock servers, started together for the module:

| server | pool                                                            |
|--------|-----------------------------------------------------------------|
| pool   | hybrid SWA: full 2,048 tokens, SWA 1,638 (the default 0.8 ratio) |
| full   | ``--disable-hybrid-swa-memory``: one 2,048-token pool keeps every token |

Both must give token-identical greedy outputs (the sliding layers mask to the window either way),
and both must agree with HF transformers' Mellum, whose outputs change without the window.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hiradix.testing.server import ServerProcess, stop_all
from tests.helpers.e2e import assert_log_clean, run_sessions, start

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
WINDOW = 32  # config.sliding_window: keys a query sees, itself included
POOL_TOKENS, SWA_POOL_TOKENS = 2048, 1638  # --max-total-tokens; SGLang's SWA share (0.8)
PROMPT_TOKENS, NEW_TOKENS = 300, 24


@pytest.fixture(scope="module")
def swa_model() -> Path:
    """models/tiny-mellum-swa, built if missing (idempotent; ~10 s, 0.1 s when it exists)."""
    out = REPO_ROOT / "models" / "tiny-mellum-swa"
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "make_model.py"), "--preset", "tiny-mellum-swa", "--out", str(out)],
                   check=True, capture_output=True, timeout=600)  # fmt: skip
    return out


@pytest.fixture(scope="module")
def servers(swa_model, tmp_path_factory) -> dict[str, ServerProcess]:
    root = tmp_path_factory.mktemp("swa_pool")
    servers = {"pool": start(swa_model, root / "pool.log", POOL_TOKENS, []),
               "full": start(swa_model, root / "full.log", POOL_TOKENS, ["--disable-hybrid-swa-memory"])}
    try:
        for server in servers.values():
            server.start(wait=False)
        for server in servers.values():
            server.wait_healthy()
        yield servers
    finally:
        stop_all(servers.values())


def generate(server: ServerProcess, ids: list[int], new_tokens: int = NEW_TOKENS) -> tuple[list[int], int]:
    """Greedy /generate of token ids: the output ids and the cached prompt tokens."""
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    req = urllib.request.Request(f"{server.base_url}/generate", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.load(resp)
    return out["output_ids"], out["meta_info"]["cached_tokens"]


def on_both(servers: dict[str, ServerProcess], requests: list[list[int]]) -> dict[str, list[tuple[list[int], int]]]:
    """The requests in order on each server (the two servers side by side)."""
    with ThreadPoolExecutor(max_workers=len(servers)) as ex:
        runs = {name: ex.submit(lambda s: [generate(s, ids) for ids in requests], server)
                for name, server in servers.items()}  # fmt: skip
        return {name: run.result() for name, run in runs.items()}


def prompt(seed: int, n: int = PROMPT_TOKENS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def assert_sane(server: ServerProcess) -> str:
    return assert_log_clean(server, "IndexError")


def test_the_servers_use_the_pools_they_should(servers):
    pool, full = assert_sane(servers["pool"]), assert_sane(servers["full"])
    assert f"swa size: {SWA_POOL_TOKENS}, full size: {POOL_TOKENS}" in pool, pool[-3000:]
    assert "hybrid_swa=True" in pool and "hybrid_swa=False" in full
    assert "SWAKVPool" not in full


def test_prompts_longer_than_the_window_give_the_outputs_of_the_full_pool(servers):
    """Ten 300-token prompts (3,240 tokens with their outputs: full-pool slots pass the SWA pool's
    1,638 and the pool evicts), then the last two again (radix hits)."""
    requests = [prompt(seed) for seed in range(10)]
    requests += requests[-2:]
    assert len(requests) * (PROMPT_TOKENS + NEW_TOKENS) > POOL_TOKENS > SWA_POOL_TOKENS
    got = on_both(servers, requests)
    assert [o for o, _ in got["pool"]] == [o for o, _ in got["full"]]
    assert len({tuple(o) for o, _ in got["pool"][:10]}) == 10  # the prompts decide the outputs
    assert all(c >= PROMPT_TOKENS - 1 for _, c in got["pool"][10:]), got["pool"][10:]  # hits from the tree
    assert_sane(servers["pool"])


def test_a_prefix_ending_in_tombstones_gives_the_outputs_of_the_full_pool(servers):
    """A prompt, then its first 200 tokens + 60 new ones, then its first 20 + 60 new: the full server
    hits 200 and 20 tokens; the pool server freed the SWA slots of those prefixes while it decoded
    the first prompt (tombstones in its tree), so its match stops where a whole window of SWA KV
    is live (here: nothing) and it recomputes; outputs agree all the same."""
    base = prompt(1000)
    tail = prompt(1001, 60)
    requests = [base, base[:200] + tail, base[:20] + tail]
    got = on_both(servers, requests)
    assert [o for o, _ in got["pool"]] == [o for o, _ in got["full"]]
    pool_cached, full_cached = [c for _, c in got["pool"]], [c for _, c in got["full"]]
    assert full_cached[1:] == [200, 20], full_cached
    assert all(p <= f for p, f in zip(pool_cached, full_cached)), (pool_cached, full_cached)
    assert pool_cached[1] < full_cached[1], (pool_cached, full_cached)  # the pool did free out-of-window SWA
    assert_sane(servers["pool"])


def test_multi_turn_chats_give_the_outputs_of_the_full_pool(servers):
    """Four chats of four turns (histories of ~400 tokens, many windows long), two at a time:
    every turn after the first hits the radix cache on both servers."""
    with ThreadPoolExecutor(max_workers=2) as ex:
        runs = {name: ex.submit(run_sessions, server.base_url, 4, 4, 25, 2) for name, server in servers.items()}
        got = {name: run.result() for name, run in runs.items()}
    for pool_session, full_session in zip(got["pool"], got["full"]):
        assert [r["text"] for r in pool_session] == [r["text"] for r in full_session]
        assert all(r["cached"] > 0 for r in pool_session[1:]), [r["cached"] for r in pool_session]
        assert all(r["cached"] > 0 for r in full_session[1:]), [r["cached"] for r in full_session]
        assert pool_session[-1]["prompt_tokens"] > 8 * WINDOW
    assert_sane(servers["pool"])


def test_the_window_is_applied_as_hf_transformers_applies_it(servers, swa_model):
    """The pool server's greedy outputs are HF transformers' Mellum's with its 32-token window (each
    output token is HF's argmax after the prompt and the outputs before it: one forward pass per
    prompt), and HF's argmaxes change once the window covers the whole context (the window matters)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(swa_model, dtype=torch.float32).eval()

    def hf_next_tokens(ids: list[int], n_new: int, window: int) -> list[int]:
        model.config.sliding_window = window
        for layer in model.model.layers:  # the per-layer copy HF's attention reads
            if layer.self_attn.sliding_window is not None:
                layer.self_attn.sliding_window = window
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
        return logits[len(ids) - n_new - 1 : len(ids) - 1].argmax(-1).tolist()

    changed = 0
    for seed in (2000, 2001):
        ids = prompt(seed)
        got, _ = generate(servers["pool"], ids)
        assert hf_next_tokens(ids + got, len(got), WINDOW) == got, seed
        changed += hf_next_tokens(ids + got, len(got), 100_000) != got
    assert changed > 0
