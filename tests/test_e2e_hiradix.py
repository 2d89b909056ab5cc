"""End to end: real `sglang.launch_server` processes on the tiny model, hiradix vs stock.

* Foundation: 5 sessions x 4 turns through /v1/chat/completions at temperature 0 (float32):
  outputs token-identical to stock SGLang, cached_tokens > 0 from turn 2, hiradix in the log.
* Tiers: an HBM pool far smaller than the working set, a small DRAM tier and an NVMe tier;
  20 sessions x 4 turns interleaved so histories fall to NVMe; from turn 2 hits come from
  DRAM and NVMe (per-request cached_tokens_details), outputs identical to a stock server
  whose HBM holds everything.

Servers are stopped by PID (whole process group) also when an assertion fails.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hiradix.testing.server import ServerProcess, cpu_args, cpu_env

pytestmark = pytest.mark.e2e

TOPICS = ["rivers", "compilers", "gardens", "trains", "music", "ice", "clouds", "maps", "salt", "bees",
          "glass", "paper", "wolves", "tea", "bridges", "moons", "tides", "copper", "wheat", "owls"]  # fmt: skip


def chat(base_url: str, messages: list[dict], max_tokens: int = 12) -> dict:
    body = {
        "model": "default",
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        "return_cached_tokens_details": True,
    }
    req = urllib.request.Request(
        f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.loads(resp.read())
    usage = out["usage"]
    details = (out.get("sglext") or {}).get("cached_tokens_details") or {}
    return {
        "text": out["choices"][0]["message"]["content"],
        "completion_tokens": usage["completion_tokens"],
        "prompt_tokens": usage["prompt_tokens"],
        "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "details": details,
    }


def user_turn(session: int, turn: int, words: int) -> str:
    topic = TOPICS[session % len(TOPICS)]
    filler = " ".join(f"{topic}{(session * 7 + turn * 3 + i) % 23}" for i in range(words))
    return f"Session {session} turn {turn}: tell me about {topic}. {filler}"


def run_sessions(base_url: str, sessions: int, turns: int, words: int, parallel: int = 1) -> list[list[dict]]:
    """Turn t of every session, then turn t+1 (interleaved); history keeps the model's answers."""
    histories = [[{"role": "system", "content": "You are a terse assistant."}] for _ in range(sessions)]
    results: list[list[dict]] = [[] for _ in range(sessions)]

    def one(s: int, t: int) -> None:
        histories[s].append({"role": "user", "content": user_turn(s, t, words)})
        r = chat(base_url, histories[s])
        histories[s].append({"role": "assistant", "content": r["text"]})
        results[s].append(r)

    for t in range(turns):
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            list(pool.map(lambda s: one(s, t), range(sessions)))
    return results


def start(model: Path, log: Path, max_total_tokens: int, extra: list[str]) -> ServerProcess:
    return ServerProcess(model, extra_args=cpu_args(max_total_tokens) + extra, env=cpu_env(), log_path=log)


SESSIONS, TURNS, WORDS = 20, 4, 25


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample from /metrics (all label sets matching ``labels``)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def tier_hits(results: list[list[dict]]) -> dict[str, int]:
    """Cached tokens of turns >= 2 by tier (cached_tokens_details)."""
    out = {"device": 0, "host": 0, "storage": 0}
    for session in results:
        for r in session[1:]:
            for tier in out:
                out[tier] += r["details"].get(tier, 0) or 0
    return out


def assert_same_outputs(got: list[list[dict]], expected: list[list[dict]]) -> None:
    for s, (g, e) in enumerate(zip(got, expected)):
        assert [r["text"] for r in g] == [r["text"] for r in e], f"session {s} differs"
        assert [r["completion_tokens"] for r in g] == [r["completion_tokens"] for r in e]


@pytest.fixture(scope="module")
def stock_outputs(tiny_model: Path, tmp_path_factory) -> list[list[dict]]:
    """Stock SGLang with an HBM pool that keeps everything; a queue forms (2 running)."""
    log = tmp_path_factory.mktemp("stock") / "stock.log"
    with start(tiny_model, log, 32768, ["--max-running-requests", "2"]) as stock:
        return run_sessions(stock.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS)


def tiered_flags(nvme_dir: Path, policy: str, timeout_s: float = 2.0) -> list[str]:
    # HBM 2048 tokens and DRAM 0.006 GB (~183 pages ~ 2.9k tokens of the tiny model) against a
    # working set of ~20 sessions x ~650 tokens: histories must fall to NVMe.
    nvme_dir.mkdir(exist_ok=True)
    return [
        "--max-running-requests", "2",
        "--enable-hiradix",
        "--hiradix-dram-gb", "0.006",
        "--hiradix-nvme-path", str(nvme_dir),
        "--hiradix-nvme-gb", "0.2",
        "--hiradix-policy", policy,
        "--hiradix-load-timeout-s", str(timeout_s),
    ]  # fmt: skip


def test_foundation_sessions_match_stock(tiny_model: Path, tmp_path: Path, stock_outputs):
    """5 sessions x 4 turns, HBM-sized so nothing is evicted: hiradix == stock RadixAttention."""
    with start(tiny_model, tmp_path / "hiradix.log", 8192, ["--enable-hiradix", "--hiradix-dram-gb", "0.05"]) as srv:
        got = run_sessions(srv.base_url, 5, TURNS, WORDS)
        log = srv.log_text()
    assert "hiradix: HiRadixCache in use" in log
    assert_same_outputs(got, stock_outputs[:5])
    for s in range(5):
        for t in range(1, TURNS):
            assert got[s][t]["cached"] > 0, (s, t, got[s][t])


@pytest.fixture(scope="module")
def tiered_runs(tiny_model: Path, tmp_path_factory) -> dict[str, list[list[dict]]]:
    """The same queued workload on hiradix `lru` and `lookahead`, HBM << working set."""
    runs = {}
    for policy in ("lru", "lookahead"):
        tmp = tmp_path_factory.mktemp(policy)
        with start(tiny_model, tmp / "server.log", 2048, tiered_flags(tmp / "nvme", policy)) as srv:
            runs[policy] = run_sessions(srv.base_url, SESSIONS, TURNS, WORDS, parallel=SESSIONS)
            runs[policy + "_prefetch_started"] = metric(srv.base_url, "hiradix_prefetch_tokens_total", outcome="started")
    return runs


def test_tiers_histories_return_from_dram_and_nvme(tiered_runs, stock_outputs):
    """Issue 3: from turn 2 hits come from DRAM and NVMe; outputs equal stock with a big HBM."""
    got = tiered_runs["lru"]
    assert_same_outputs(got, stock_outputs)
    hits = tier_hits(got)
    assert hits["host"] > 0, hits
    assert hits["storage"] > 0, hits


def test_lookahead_serves_more_hits_from_dram_than_lru(tiered_runs, stock_outputs):
    """Issue 4: with a queue, the look-ahead window prefetches and protects queued prefixes."""
    assert_same_outputs(tiered_runs["lookahead"], stock_outputs)
    la, lru = tier_hits(tiered_runs["lookahead"]), tier_hits(tiered_runs["lru"])
    share = {name: h["host"] / max(1, sum(h.values())) for name, h in (("lookahead", la), ("lru", lru))}
    assert share["lookahead"] > share["lru"], (la, lru)
    assert tiered_runs["lookahead_prefetch_started"] > 0
    assert tiered_runs["lru_prefetch_started"] == 0 or share["lookahead"] > share["lru"]


def test_prefetch_that_never_lands_times_out_and_recomputes(tiny_model: Path, tmp_path: Path, stock_outputs):
    """Every NVMe read is held by the worker (fault switch); requests wait 0.5 s, then recompute."""
    env = dict(cpu_env(), HIRADIX_FAULTS="load_delay_s=600")
    flags = cpu_args(2048) + tiered_flags(tmp_path / "nvme", "lru", timeout_s=0.5)
    with ServerProcess(tiny_model, extra_args=flags, env=env, log_path=tmp_path / "server.log") as srv:
        got = run_sessions(srv.base_url, 8, TURNS, WORDS)
        skips = metric(srv.base_url, "hiradix_admission_skips_total")
        started = metric(srv.base_url, "hiradix_prefetch_tokens_total", outcome="started")
        completed = metric(srv.base_url, "hiradix_prefetch_tokens_total", outcome="completed")
    assert_same_outputs(got, stock_outputs[:8])
    assert started > 0 and skips > 0, (started, skips)
    assert completed == 0 and tier_hits(got)["storage"] == 0
