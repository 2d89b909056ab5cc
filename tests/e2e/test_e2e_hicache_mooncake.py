"""Stock SGLang HiCache + Mooncake Store on CPU: the cross-server baseline of the cluster tier.

Two stock HiCache servers (A, B; models/tiny; ``--hicache-storage-backend mooncake``, direct
I/O, the ``page_first_direct`` host layout that needs patches/p05 here) share one store from
:class:`hiradix.testing.mooncake.MooncakeCluster` (a master + a holder on loopback). Both
servers and the store are shared by the module and stopped by PID.

| step                                                  | expected                                       |
|-------------------------------------------------------|------------------------------------------------|
| prompt P (40 pages) to A                              | A backs P's pages up to the store (L3)         |
| P to B, which has never seen it                       | B's ``storage`` hits cover all of P's full pages; same greedy tokens as A |
| prompt Q to B, then Q + B's answer + a new turn to A  | A's ``storage`` hits cover Q's pages; same tokens as B gives for it |
"""

from __future__ import annotations

import json
import random
import urllib.request

import pytest

from hiradix.testing.mooncake import hicache_mooncake_args, hicache_mooncake_env
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env, stop_all
from tests.helpers.e2e import metric, wait_backed_up
from tests.helpers.store import requires_mooncake

pytestmark = [pytest.mark.e2e, requires_mooncake]

PAGE_TOKENS = 16
PROMPT_PAGES = 40
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def servers(tiny_model, store, tmp_path_factory):
    """Servers A and B, started together (each ~30 s on this machine)."""
    config = store.config()
    logs = tmp_path_factory.mktemp("hicache-mooncake")
    args = cpu_args(4096) + hicache_mooncake_args(config) + ["--page-size", str(PAGE_TOKENS)]
    env = {**cpu_env(), **hicache_mooncake_env(config)}
    pair = [ServerProcess(tiny_model, extra_args=args, env=env, log_path=logs / f"{name}.log") for name in "ab"]
    try:
        for server in pair:
            server.start(wait=False)
        for server in pair:
            server.wait_healthy()
        yield pair
    finally:
        stop_all(pair)


def generate(server: ServerProcess, ids: list[int]) -> tuple[list[int], dict]:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}}
    req = urllib.request.Request(f"{server.base_url}/generate", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.load(resp)
    return out["output_ids"], out["meta_info"]


def storage_hits(meta: dict) -> int:
    return int((meta.get("cached_tokens_details") or {}).get("storage", 0) or 0)


def test_b_reads_the_prompt_a_stored_and_answers_the_same(servers, store):
    a, b = servers
    rng = random.Random(11)
    prompt = [rng.randrange(10, 4000) for _ in range(PROMPT_PAGES * PAGE_TOKENS)]
    before = metric(a.base_url, "sglang:backuped_tokens_total")
    out_a, meta_a = generate(a, prompt)
    assert storage_hits(meta_a) == 0 and meta_a["cached_tokens"] == 0
    wait_backed_up(a, before + PROMPT_PAGES * PAGE_TOKENS)
    assert store.key_count() >= 2 * PROMPT_PAGES  # a K and a V object per page (SGLang's MHA keys)

    out_b, meta_b = generate(b, prompt)
    details = meta_b.get("cached_tokens_details") or {}
    print(f"B on A's prompt: {details}, cached {meta_b['cached_tokens']} of {len(prompt)}")
    assert out_b == out_a
    # every full page of the prompt but the last (a request always computes its last token)
    assert storage_hits(meta_b) >= (PROMPT_PAGES - 1) * PAGE_TOKENS, details
    assert details.get("storage_backend") == "MooncakeStore"


def test_the_next_turn_on_the_other_server_hits_the_store(servers):
    a, b = servers
    rng = random.Random(12)
    turn1 = [rng.randrange(10, 4000) for _ in range(PROMPT_PAGES * PAGE_TOKENS)]
    before = metric(b.base_url, "sglang:backuped_tokens_total")
    answer, _ = generate(b, turn1)
    wait_backed_up(b, before + PROMPT_PAGES * PAGE_TOKENS)
    turn2 = turn1 + answer + [rng.randrange(10, 4000) for _ in range(5 * PAGE_TOKENS)]

    out_a, meta_a = generate(a, turn2)
    out_b, _ = generate(b, turn2)  # B computes it from its own cache
    print(f"A on B's turn 2: {meta_a.get('cached_tokens_details')}")
    assert storage_hits(meta_a) >= PROMPT_PAGES * PAGE_TOKENS
    assert out_a == out_b
