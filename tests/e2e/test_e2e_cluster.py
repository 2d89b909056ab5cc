"""The cluster tier end to end: two hiradix servers share KV through one Mooncake Store.

One store (:class:`hiradix.testing.mooncake.MooncakeCluster`: a master and a holder on
loopback) and two hiradix servers A and B (tiny model, ``--hiradix-store mooncake``,
``HIRADIX_CHECK_INTEGRITY=1``: the invariants are proved after every scheduler step) are shared
by the module and stopped by PID; SGLang's router (``smg launch --policy round_robin``,
:class:`hiradix.testing.router.RouterProcess`) stands in front of A and B for the router tests.
The tests run in file order; the worker kill and the store fault tests come last.

| test                                   | expected                                                     |
|----------------------------------------|--------------------------------------------------------------|
| turns alternate between A and B        | the other server's turns hit from the store: >= 90% of the reusable prefix; outputs == stock |
| salted requests                        | a salt never hits another salt's pages; the same salt does   |
| a server with another page size        | no hits on what A and B stored                               |
| chats through SGLang's router (smg, round_robin, in front of A and B) | every turn that lands on the other server hits >= 90% of its reusable prefix, the part A/B did not hold from the store; outputs == stock; salts never cross |
| B killed mid-run behind the router, then restarted | every request answered by A with stock's tokens within its deadline; the router stops sending to B; B rejoins and hits the store for what A wrote |
| holder killed / master frozen / killed | every request answered with the right tokens within its deadline; the store tier switches off and comes back with the store |
"""

from __future__ import annotations

import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hiradix.testing.mooncake import MooncakeCluster
from hiradix.testing.router import RouterProcess
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env, stop_all
from tests.helpers.e2e import TURNS, WORDS, assert_same_outputs, chat, metric, user_turn
from tests.helpers.store import logged_key_prefix, requires_mooncake, wait_until_stored

pytestmark = [pytest.mark.e2e, requires_mooncake]

PAGE_TOKENS = 16
SESSIONS = 6
TIMEOUT_S = 2.0  # --hiradix-load-timeout-s
RETRY_S = 3.0  # HIRADIX_STORE_RETRY_S: a switched-off store is tried again this soon
# A request of the tiny model takes well under a second here; one that waited past its
# deadline (a hang) would take the client's 300 s.
ANSWER_WITHIN_S = 60.0


def hiradix_args(store: MooncakeCluster, page_size: int = PAGE_TOKENS) -> list[str]:
    return cpu_args(4096) + [
        "--page-size", str(page_size),
        "--enable-hiradix", "--hiradix-dram-gb", "0.05",
        "--hiradix-store", "mooncake", "--hiradix-store-config", store.config_json(),
        "--hiradix-load-timeout-s", str(TIMEOUT_S),
        "--served-model-name", "default",  # the router picks workers by the model id the clients send
    ]  # fmt: skip


def start_server(model: Path, store: MooncakeCluster, log: Path, page_size: int = PAGE_TOKENS) -> ServerProcess:
    env = {**cpu_env(), "HIRADIX_CHECK_INTEGRITY": "1", "HIRADIX_STORE_RETRY_S": str(RETRY_S)}
    return ServerProcess(model, extra_args=hiradix_args(store, page_size), env=env, log_path=log)


@pytest.fixture(scope="module")
def servers(tiny_model, store, tmp_path_factory) -> list[ServerProcess]:
    """A, B (page size 16) and C (page size 32) on the module's store, started together."""
    logs = tmp_path_factory.mktemp("cluster")
    found = [start_server(tiny_model, store, logs / f"{name}.log") for name in "ab"]
    found.append(start_server(tiny_model, store, logs / "c.log", page_size=2 * PAGE_TOKENS))
    try:
        for server in found:
            server.start(wait=False)
        for server in found:
            server.wait_healthy()
        yield found
    finally:
        stop_all(found)


@pytest.fixture(scope="module")
def pair(servers) -> list[ServerProcess]:
    return servers[:2]


@pytest.fixture(scope="module")
def router(pair, tmp_path_factory) -> RouterProcess:
    """SGLang's router (smg 1.13.0, round_robin) in front of A and B; stopped by PID."""
    with RouterProcess(tmp_path_factory.mktemp("router") / "router.log",
                       worker_urls=[s.base_url for s in pair], policy="round_robin") as found:  # fmt: skip
        yield found


def from_store(r: dict) -> int:
    """Tokens of a response's hits that came from the cluster store (``storage_backend``)."""
    m = re.search(r"mooncake=(\d+)", r["details"].get("storage_backend") or "")
    return int(m.group(1)) if m else 0


def run_routed(urls: list[str], sessions: int, turns: int, reader, key_prefix: str) -> list[list[dict]]:
    """Turn t of session s goes to ``urls[(s + t) % len(urls)]``: every turn lands on the other
    server than the one that computed the history before it (round-robin per turn)."""
    histories = [[{"role": "system", "content": "You are a terse assistant."}] for _ in range(sessions)]
    results: list[list[dict]] = [[] for _ in range(sessions)]
    for t in range(turns):
        for s in range(sessions):
            histories[s].append({"role": "user", "content": user_turn(s, t, WORDS)})
            r = chat(urls[(s + t) % len(urls)], histories[s], return_token_ids=True)
            histories[s].append({"role": "assistant", "content": r["text"]})
            results[s].append(r)
        wait_round_stored(reader, key_prefix, results)
    return results


def wait_round_stored(reader, key_prefix: str, results: list[list[dict]]) -> None:
    """Before the next turn moves: wait until the store lists every whole page of each session's
    last prompt (PUTs are asynchronous; a user's think time would let them land)."""
    for session in results:
        wait_until_stored(reader, key_prefix, session[-1]["prompt_ids"], PAGE_TOKENS)


def test_turns_routed_to_the_other_server_hit_through_the_store(pair, stock_outputs, store_reader):
    a, b = pair
    got = run_routed([a.base_url, b.base_url], SESSIONS, TURNS, store_reader, logged_key_prefix(a.log_text()))
    assert_same_outputs(got, stock_outputs[:SESSIONS])
    reusable = cached = stored = first_reusable = first_cached = first_stored = 0
    for session in got:
        for t in range(1, TURNS):
            prefix = session[t - 1]["prompt_tokens"] // PAGE_TOKENS * PAGE_TOKENS  # the history, whole pages
            reusable += prefix
            cached += min(session[t]["cached"], prefix)
            stored += from_store(session[t])
            if t == 1:  # the other server never saw this session
                first_reusable += prefix
                first_cached += min(session[t]["cached"], prefix)
                first_stored += from_store(session[t])
    assert cached >= 0.9 * reusable, (cached, reusable)
    assert first_cached >= 0.9 * first_reusable, (first_cached, first_reusable)
    # Locally it holds at most the system prompt's pages that all sessions share (other
    # sessions' turns ran there): everything else the first cross turn hits comes from the store.
    assert first_stored >= first_reusable - SESSIONS * 2 * PAGE_TOKENS, (first_stored, first_reusable)
    assert stored > first_stored  # later turns too get the other server's last turn from the store
    for server in pair:
        assert metric(server.base_url, "sglang:hiradix_store_pages_total", op="get") > 0
        assert metric(server.base_url, "sglang:hiradix_store_pages_total", op="put") > 0
        assert metric(server.base_url, "sglang:hiradix_store_enabled") == 1


def prompt(tag: str, words: int = 60) -> list[dict]:
    return [{"role": "user", "content": f"{tag}: " + " ".join(f"{tag}{i % 17}" for i in range(words))}]


def wait_stored(reader, server: ServerProcess, r: dict, salt: str | None = None) -> None:
    """Wait until the store lists every whole page of the prompt of ``r`` (asked with
    ``return_token_ids``) as ``server`` keys it (PUTs are asynchronous)."""
    namespace = None if salt is None else (None, salt)
    wait_until_stored(reader, logged_key_prefix(server.log_text()), r["prompt_ids"], PAGE_TOKENS, namespace)


def test_salted_requests_never_hit_each_others_pages(pair, store_reader):
    a, b = pair
    first = chat(a.base_url, prompt("salty"), cache_salt="tenant-1", return_token_ids=True)
    wait_stored(store_reader, a, first, salt="tenant-1")
    other = chat(b.base_url, prompt("salty"), cache_salt="tenant-2")
    unsalted = chat(b.base_url, prompt("salty"))
    same = chat(b.base_url, prompt("salty"), cache_salt="tenant-1")
    assert from_store(other) == 0 and other["cached"] < PAGE_TOKENS * 2  # at most B's own template pages
    assert from_store(unsalted) == 0
    assert from_store(same) >= first["prompt_tokens"] // PAGE_TOKENS * PAGE_TOKENS - PAGE_TOKENS
    assert other["text"] == unsalted["text"] == same["text"] == first["text"]


def test_another_page_size_on_the_same_store_gets_no_hits(servers, store_reader):
    a, _, c = servers
    first = chat(a.base_url, prompt("pagesize"), return_token_ids=True)
    wait_stored(store_reader, a, first)
    again = chat(c.base_url, prompt("pagesize"))
    assert metric(c.base_url, "sglang:hiradix_store_pages_total", op="found") == 0
    assert again["cached"] == 0 and from_store(again) == 0 and again["text"] == first["text"]


def answered_in_time(r: dict) -> dict:
    assert r["latency_s"] < ANSWER_WITHIN_S, r
    return r


# ---------------------------------------------------------------- behind SGLang's router

ROUTED_SESSIONS = range(6, 11)  # sessions of the e2e workload no other test of the module sends
KILLED_SESSIONS = range(11, 15)


def landed_on(router: RouterProcess, before: dict[str, float]) -> str:
    """The worker URL whose routed-request count grew since ``before`` (one request in flight)."""
    after = router.requests_per_worker()
    grown = [url for url, n in after.items() if n > before.get(url, 0.0)]
    assert len(grown) == 1, (before, after)
    return grown[0]


def run_through_router(router: RouterProcess, sessions: range, turns: int, reader,
                       key_prefix: str) -> tuple[list[list[dict]], list[list[str]]]:
    """The e2e workload's ``sessions``, turn-major, one request at a time through the router's
    OpenAI endpoint; each result's worker from the router's per-worker counters."""
    histories = [[{"role": "system", "content": "You are a terse assistant."}] for _ in sessions]
    results: list[list[dict]] = [[] for _ in sessions]
    workers: list[list[str]] = [[] for _ in sessions]
    for t in range(turns):
        for i, s in enumerate(sessions):
            histories[i].append({"role": "user", "content": user_turn(s, t, WORDS)})
            before = router.requests_per_worker()
            r = answered_in_time(chat(router.base_url, histories[i], return_token_ids=True))
            workers[i].append(landed_on(router, before))
            histories[i].append({"role": "assistant", "content": r["text"]})
            results[i].append(r)
        wait_round_stored(reader, key_prefix, results)
    return results, workers


def test_chats_through_the_router_hit_the_store_when_a_turn_moves(router, pair, stock_outputs, store_reader):
    got, workers = run_through_router(router, ROUTED_SESSIONS, TURNS, store_reader, logged_key_prefix(pair[0].log_text()))
    assert_same_outputs(got, [stock_outputs[s] for s in ROUTED_SESSIONS])
    assert {w for row in workers for w in row} == {s.base_url for s in pair}  # round_robin used both
    moved = 0
    for session, row in zip(got, workers):
        for t in range(1, TURNS):
            if row[t] == row[t - 1]:
                continue
            moved += 1
            prefix = session[t - 1]["prompt_tokens"] // PAGE_TOKENS * PAGE_TOKENS  # the history, whole pages
            assert session[t]["cached"] >= 0.9 * prefix, (t, session[t], prefix)
            if row[t] not in row[:t]:  # this server never saw the session: all but the shared system pages from the store
                assert from_store(session[t]) >= prefix - 2 * PAGE_TOKENS, (t, session[t], prefix)
            else:  # it holds an older turn: at least the other server's last turn comes from the store
                assert from_store(session[t]) > 0, (t, session[t])
    assert moved >= len(ROUTED_SESSIONS)  # 5 sessions on 2 workers round-robin: turns do move
    counts = router.requests_per_worker()
    assert sum(counts.values()) >= len(ROUTED_SESSIONS) * TURNS


def test_salted_requests_through_the_router_never_hit_each_others_pages(router, pair, store_reader):
    first = chat(router.base_url, prompt("routed-salt"), cache_salt="tenant-1", return_token_ids=True)
    wait_stored(store_reader, pair[0], first, salt="tenant-1")  # A and B key pages alike
    # round_robin: the next three go B, A, B (A: where tenant-1's pages are in HBM)
    other = chat(router.base_url, prompt("routed-salt"), cache_salt="tenant-2")
    unsalted = chat(router.base_url, prompt("routed-salt"))
    same = chat(router.base_url, prompt("routed-salt"), cache_salt="tenant-1")
    for r in (other, unsalted):
        assert from_store(r) == 0 and r["cached"] < PAGE_TOKENS * 2, r  # at most a server's own template pages
    assert same["cached"] >= first["prompt_tokens"] // PAGE_TOKENS * PAGE_TOKENS - PAGE_TOKENS, same
    assert other["text"] == unsalted["text"] == same["text"] == first["text"]


def test_a_killed_worker_is_routed_around_and_rejoins_with_the_store(router, pair, stock_outputs, store_reader):
    a, b = pair
    sessions = KILLED_SESSIONS
    histories = [[{"role": "system", "content": "You are a terse assistant."}] for _ in sessions]
    results: list[list[dict]] = [[] for _ in sessions]
    first_turn_done, turn_two, count_lock = threading.Event(), threading.Event(), threading.Lock()
    answered = [0]

    def one(i: int, t: int) -> None:
        histories[i].append({"role": "user", "content": user_turn(sessions[i], t, WORDS)})
        r = answered_in_time(chat(router.base_url, histories[i], return_token_ids=True))
        histories[i].append({"role": "assistant", "content": r["text"]})
        results[i].append(r)
        with count_lock:
            answered[0] += 1
            if answered[0] == len(sessions):
                first_turn_done.set()

    def session(i: int) -> None:
        one(i, 0)
        assert turn_two.wait(ANSWER_WITHIN_S)
        for t in range(1, TURNS - 1):
            one(i, t)

    with ThreadPoolExecutor(max_workers=len(sessions)) as pool:
        running = [pool.submit(session, i) for i in range(len(sessions))]
        assert first_turn_done.wait(ANSWER_WITHIN_S)
        # The first turns' pages are in the store before B dies: a writer killed inside a PUT
        # leaves Mooncake's claim on those keys for its master's put_start_discard_timeout_sec
        # (30 s), and every other writer's PUT of them meanwhile reports success without storing
        # (measured: tests would then miss pages A "wrote"; a known gap, see bench/RESULTS.md).
        key_prefix = logged_key_prefix(a.log_text())
        for r in (session_results[0] for session_results in results):
            # the KV of the last output token is never computed: its page is not cached
            wait_until_stored(store_reader, key_prefix, r["prompt_ids"] + r["output_ids"][:-1], PAGE_TOKENS)
        turn_two.set()
        b.signal_group(signal.SIGKILL)  # B dies with requests of turn 2 in flight or queued
        for f in running:
            f.result()
    b.stop()
    router.wait_workers(1, timeout_s=60)
    assert_same_outputs(results, [stock_outputs[s][: TURNS - 1] for s in sessions])
    only_a = router.requests_per_worker()
    extra = [answered_in_time(chat(router.base_url, prompt(f"survivor{i}"))) for i in range(3)]
    after = router.requests_per_worker()
    assert after[b.base_url] == only_a[b.base_url] and after[a.base_url] == only_a[a.base_url] + 3
    assert len({r["text"] for r in extra}) == 3
    # B comes back (empty tiers): the router sends to it again, and it finds A's turns in the store.
    b.start()
    router.wait_workers(2, timeout_s=60)
    stored = 0
    for i, s in enumerate(sessions):
        histories[i].append({"role": "user", "content": user_turn(s, TURNS - 1, WORDS)})
        before = router.requests_per_worker()
        r = answered_in_time(chat(router.base_url, histories[i]))
        assert r["text"] == stock_outputs[s][TURNS - 1]["text"]
        if landed_on(router, before) == b.base_url:
            prefix = results[i][-1]["prompt_tokens"] // PAGE_TOKENS * PAGE_TOKENS
            assert from_store(r) >= prefix - 2 * PAGE_TOKENS, (r, prefix)
            stored += 1
    assert stored >= 1  # round_robin sent some of them to B


def test_store_faults_degrade_to_recompute_and_the_tier_comes_back(pair, store, store_reader):
    a, b = pair
    # 1. The holder dies with A's pages in it: exists may still say "present", the GET misses,
    #    B recomputes the right tokens.
    held = answered_in_time(chat(a.base_url, prompt("holder"), return_token_ids=True))
    wait_stored(store_reader, a, held)
    store.kill_holder(0)
    lost = answered_in_time(chat(b.base_url, prompt("holder")))
    assert lost["text"] == held["text"] and from_store(lost) == 0
    store.start_holder(0)
    # 2. The master freezes (SIGSTOP): lookups and puts time out; requests run within their deadline.
    store.freeze_master()
    try:
        frozen = [answered_in_time(chat(s.base_url, prompt(f"frozen{i}"))) for i, s in enumerate((a, b, a))]
    finally:
        store.thaw_master()
    assert all(from_store(r) == 0 for r in frozen)
    # 3. The master dies: puts fail until the tier switches off (one warning per server); the
    #    servers keep serving from their own tiers.
    store.kill_master()
    dead = [answered_in_time(chat(a.base_url, prompt(f"dead{i}"))) for i in range(8)]
    assert all(from_store(r) == 0 for r in dead)
    deadline = time.monotonic() + 60
    while metric(a.base_url, "sglang:hiradix_store_enabled") != 0 and time.monotonic() < deadline:
        answered_in_time(chat(a.base_url, prompt(f"dead-more{time.monotonic()}")))
    assert metric(a.base_url, "sglang:hiradix_store_enabled") == 0
    assert a.log_text().count("cluster store switched off") == 1
    # 4. The master comes back (its index is empty): after RETRY_S the tier is on again and a
    #    turn routed to the other server hits from the store once more.
    store.restart_master()
    time.sleep(RETRY_S + 1.0)  # the servers' own retry timer (nothing to wait on from here)
    deadline = time.monotonic() + 60
    while True:
        tag = f"back{int(time.monotonic() * 10)}"
        first = answered_in_time(chat(a.base_url, prompt(tag)))
        time.sleep(1.0)  # write-through PUT of A's pages
        again = answered_in_time(chat(b.base_url, prompt(tag)))
        if from_store(again) > 0 or time.monotonic() > deadline:
            break
    assert from_store(again) > 0 and again["text"] == first["text"]
    assert metric(a.base_url, "sglang:hiradix_store_enabled") == 1


def test_servers_measure_store_reads_and_prefill_for_load_or_recompute(pair):
    """Issue 19 item 4: each server exports its moving estimates (kept in every --hiradix-store-read
    mode); with the default, always, the store hits above were read, none skipped as slow."""
    for server in pair:
        read_bytes_per_s = metric(server.base_url, "sglang:hiradix_store_read_bytes_per_s")
        prefill_tokens_per_s = metric(server.base_url, "sglang:hiradix_prefill_tokens_per_s")
        assert 1e6 < read_bytes_per_s < 1e11, read_bytes_per_s  # measured from this module's GETs
        assert 100 < prefill_tokens_per_s < 1e8, prefill_tokens_per_s  # from its extend batches
        gets = metric(server.base_url, "sglang:hiradix_store_pages_total", op="get")
        skipped = metric(server.base_url, "sglang:hiradix_store_pages_total", op="skipped_slow")
        assert gets > 0 and skipped == 0, (gets, skipped)
