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


def test_foundation_five_sessions_match_stock(tiny_model: Path, tmp_path: Path):
    with start(tiny_model, tmp_path / "stock.log", 8192, []) as stock:
        expected = run_sessions(stock.base_url, sessions=5, turns=4, words=30)
    with start(tiny_model, tmp_path / "hiradix.log", 8192, ["--enable-hiradix", "--hiradix-dram-gb", "0.05"]) as srv:
        got = run_sessions(srv.base_url, sessions=5, turns=4, words=30)
        log = srv.log_text()
    assert "hiradix: HiRadixCache in use" in log
    for s in range(5):
        assert [r["text"] for r in got[s]] == [r["text"] for r in expected[s]], f"session {s} differs"
        assert [r["completion_tokens"] for r in got[s]] == [r["completion_tokens"] for r in expected[s]]
        for t in range(1, 4):
            assert got[s][t]["cached"] > 0, (s, t, got[s][t])


def test_tiers_histories_return_from_dram_and_nvme(tiny_model: Path, tmp_path: Path):
    nvme_dir = tmp_path / "nvme"
    nvme_dir.mkdir()
    # ~20 sessions x 4 turns x ~150 tokens: the working set is ~4x the 2048-token HBM pool
    # and more than the DRAM tier (0.006 GB ~ 183 pages ~ 2.9k tokens of the tiny model).
    with start(tiny_model, tmp_path / "stock.log", 32768, []) as stock:
        expected = run_sessions(stock.base_url, sessions=20, turns=4, words=25)
    flags = [
        "--enable-hiradix",
        "--hiradix-dram-gb", "0.006",
        "--hiradix-nvme-path", str(nvme_dir),
        "--hiradix-nvme-gb", "0.2",
        "--hiradix-policy", "lru",
    ]  # fmt: skip
    with start(tiny_model, tmp_path / "hiradix.log", 2048, flags) as srv:
        got = run_sessions(srv.base_url, sessions=20, turns=4, words=25)
    host = sum(r["details"].get("host", 0) for s in got for r in s[1:])
    storage = sum(r["details"].get("storage", 0) or 0 for s in got for r in s[1:])
    for s in range(20):
        assert [r["text"] for r in got[s]] == [r["text"] for r in expected[s]], f"session {s} differs"
    assert host > 0, "no turn was served from DRAM"
    assert storage > 0, "no turn was served from NVMe"
