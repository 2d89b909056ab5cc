"""End to end: no prompt can hang the scheduler at the pool limit (issue 14).

One hiradix server per page size (1 and 16), each with a 512-token device pool, shared by
the tests of this module. They start from the README's launch command plus only the CPU
settings (no ``--enable-metrics`` / ``--enable-cache-report``: hiradix turns them on).

Before the fix, a prompt just under SGLang's own limit (506 tokens for this pool) was neither
admitted nor refused at page size 16: its page-rounded size plus one reserved page never fit
the pool, so it stayed at the head of the queue and every request behind it timed out.
Now hiradix computes the largest admissible prompt ``L`` (:mod:`hiradix.sglang_plugin.admission`)
and SGLang's own length check refuses longer ones up front:

* a prompt of exactly ``L`` tokens is served (HTTP 200, at least one generated token), and so
  is a short request sent with it;
* ``L + 1`` tokens get HTTP 400 with SGLang's message, at once, and a 4-token request sent
  right behind it is answered;
* ``L`` is the closed form of the pool: ``C - 2 x page_size`` for pages of 16 (480: the prompt's
  pages, one page of rounding reserve, one to decode into), SGLang's own ``C - 7`` for page
  size 1 (505).

The same servers check the README's promises about observability: ``/metrics`` serves every
hiradix series from the start, and a chat response carries per-tier ``cached_tokens_details``.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hiradix.runtime.metrics import SERIES
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env, stop_all
from tests.helpers.e2e import chat

pytestmark = pytest.mark.e2e

POOL_TOKENS = 512
REPORT_FLAGS = ("--enable-cache-report", "--enable-metrics")  # what hiradix must turn on itself
ANSWER_TIMEOUT_S = 60.0  # a hung scheduler never answers; a served request takes < 1 s here
EXPECTED_LIMIT = {1: POOL_TOKENS - 7, 16: POOL_TOKENS - 2 * 16}


def readme_cpu_args(max_total_tokens: int) -> list[str]:
    """The CPU settings only: the README's command does not give the report flags."""
    return [a for a in cpu_args(max_total_tokens) if a not in REPORT_FLAGS]


@pytest.fixture(scope="module")
def servers(tiny_model: Path, tmp_path_factory) -> dict[int, ServerProcess]:
    """One server per page size, started together, stopped at the end of the module."""
    with contextlib.ExitStack() as stack:
        found = {}
        stack.callback(lambda: stop_all(found.values()))
        for page_size in (1, 16):
            tmp = tmp_path_factory.mktemp(f"page{page_size}")
            args = readme_cpu_args(POOL_TOKENS) + ["--page-size", str(page_size), "--enable-hiradix",
                                                   "--hiradix-dram-gb", "0.01"]
            found[page_size] = ServerProcess(tiny_model, extra_args=args, env=cpu_env(), log_path=tmp / "server.log")
            found[page_size].start(wait=False)
        for srv in found.values():
            srv.wait_healthy()
        yield found


@pytest.fixture(params=[1, 16], ids=["page1", "page16"])
def server(request, servers):
    return servers[request.param], request.param


def generate(base_url: str, num_tokens: int, max_new_tokens: int = 4, seed: int = 0) -> tuple[int, dict, float]:
    """POST /generate with ``num_tokens`` prompt token ids; returns (HTTP status, body, seconds)."""
    ids = [10 + (seed * 7919 + i * 31) % 4000 for i in range(num_tokens)]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    req = urllib.request.Request(f"{base_url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    sent = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=ANSWER_TIMEOUT_S) as resp:
            return resp.status, json.loads(resp.read()), time.monotonic() - sent
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}"), time.monotonic() - sent


def logged_limit(srv: ServerProcess) -> int:
    found = re.findall(r"hiradix: prompts up to (\d+) tokens are admitted", srv.log_text())
    assert len(found) == 1, srv.log_tail()
    return int(found[0])


def with_one_behind(base_url: str, num_tokens: int, seed: int) -> tuple[tuple, tuple]:
    """The prompt and a 4-token request, sent together (in flight at once; either may reach the
    queue first: both must be answered, so a prompt stuck at the head of the queue fails this)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(generate, base_url, num_tokens, 4, seed)
        behind = pool.submit(generate, base_url, 4, 4, seed + 1)
        return first.result(), behind.result()


def test_limit_is_the_largest_admissible_prompt(server):
    srv, page_size = server
    assert logged_limit(srv) == EXPECTED_LIMIT[page_size]


def test_prompt_at_the_limit_is_served_with_a_request_behind_it(server):
    srv, page_size = server
    limit = logged_limit(srv)
    (status, body, _), (behind_status, behind, _) = with_one_behind(srv.base_url, limit, seed=1)
    assert status == 200, body
    assert body["meta_info"]["prompt_tokens"] == limit and body["meta_info"]["completion_tokens"] >= 1, body
    assert behind_status == 200 and behind["meta_info"]["completion_tokens"] >= 1, behind


def test_one_token_over_is_refused_up_front_and_the_next_request_is_answered(server):
    srv, page_size = server
    limit = logged_limit(srv)
    (status, body, seconds), (behind_status, behind, behind_s) = with_one_behind(srv.base_url, limit + 1, seed=3)
    assert status == 400, body
    message = json.dumps(body)
    assert f"Input length ({limit + 1} tokens) exceeds the maximum allowed length ({limit + 1} tokens)" in message
    assert seconds < 10, seconds  # refused at once, not after a wait
    assert behind_status == 200 and behind["meta_info"]["completion_tokens"] >= 1, behind
    assert behind_s < ANSWER_TIMEOUT_S
    assert srv.is_healthy()


def test_readme_command_serves_metrics_from_the_start_and_hit_details(server):
    """Issue 14: the README's command (no report flags) gives /metrics and per-tier details."""
    srv, page_size = server
    assert "turned on --enable-cache-report --enable-metrics" in srv.log_text()
    with urllib.request.urlopen(srv.base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    for s in SERIES:
        for value in s.values or (None,):
            pattern = re.escape(s.name) + r"\{[^}]*" + (re.escape(f'{s.label}="{value}"') if value else "") + r"[^}]*\} "
            assert re.search(pattern, text, re.M), (s.name, value)
    assert re.search(r'sglang:hiradix_tier_capacity_tokens\{[^}]*tier="HBM"[^}]*\} 512\.0', text)
    assert re.search(r'sglang:hiradix_failed_transfers_total\{[^}]*kind="DEMOTE"[^}]*\} 0\.0', text)
    messages = [{"role": "user", "content": "Tell me about rivers. " + "rivers " * 60}]
    chat(srv.base_url, messages)
    again = chat(srv.base_url, messages)
    # every token but the last (computed for its logits), at page size 16 too: the partial page
    # (the default --hiradix-partial-page on) copies the rows of the page the prompt ends inside
    assert again["cached"] == again["prompt_tokens"] - 1, (page_size, again)
    assert again["details"].get("device", 0) + again["details"].get("host", 0) == again["cached"], again
