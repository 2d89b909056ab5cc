"""Helpers of the end-to-end tests: a chat client, the multi-turn workload, metrics, flags.

The workload: ``sessions`` chats of ``turns`` user turns each (``words`` filler words per
turn), turn t of every session before turn t+1, at temperature 0; each result keeps the
answer text, token counts and the per-tier cached tokens (``cached_tokens_details``).
The ``stock_outputs`` fixture (tests/conftest.py) runs it on stock SGLang once per session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Sequence

from hiradix.testing.server import ServerProcess, cpu_args, cpu_env

TOPICS = ["rivers", "compilers", "gardens", "trains", "music", "ice", "clouds", "maps", "salt", "bees",
          "glass", "paper", "wolves", "tea", "bridges", "moons", "tides", "copper", "wheat", "owls"]  # fmt: skip


def chat(base_url: str, messages: list[dict], max_tokens: int = 12, **extra) -> dict:
    """One greedy chat completion; ``extra`` goes into the body (e.g. ``cache_salt``)."""
    body = {
        "model": "default",
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        "return_cached_tokens_details": True,
        **extra,
    }
    req = urllib.request.Request(
        f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    sent_s = time.monotonic()
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.loads(resp.read())
    latency_s = time.monotonic() - sent_s
    usage = out["usage"]
    details = (out.get("sglext") or {}).get("cached_tokens_details") or {}
    choice = out["choices"][0]
    return {
        "text": choice["message"]["content"],
        "completion_tokens": usage["completion_tokens"],
        "prompt_tokens": usage["prompt_tokens"],
        "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "details": details,
        "latency_s": latency_s,  # request sent -> whole answer received (>= TTFT), in seconds
        # token ids, when the body asked for them (``return_token_ids=True``)
        "prompt_ids": choice.get("prompt_token_ids"),
        "output_ids": choice.get("response_token_ids"),
    }


def user_turn(session: int, turn: int, words: int) -> str:
    topic = TOPICS[session % len(TOPICS)]
    filler = " ".join(f"{topic}{(session * 7 + turn * 3 + i) % 23}" for i in range(words))
    return f"Session {session} turn {turn}: tell me about {topic}. {filler}"


def run_sessions(
    base_url: str, sessions: int, turns: int, words: int, parallel: int = 1,
    before_turn: Optional[Callable[[int], None]] = None, first_session: int = 0,
    extra_of: Optional[Callable[[int, int], dict]] = None,
    after_turn: Optional[Callable[[int, list[list[dict]]], None]] = None,
) -> list[list[dict]]:
    """Turn t of every session, then turn t+1 (interleaved); history keeps the model's answers.

    Sessions ``first_session .. first_session + sessions - 1`` (the session number picks the
    user turns' words; result i is session ``first_session + i``). ``before_turn(t)``
    (0-based) runs before the requests of turn t are sent; ``extra_of(i, t)`` gives more body
    fields for result i's turn t (e.g. ``routed_dp_rank``); ``after_turn(t, results)`` runs once
    every session's turn t was answered (e.g. to wait for asynchronous writes, as think time would).
    """
    histories = [[{"role": "system", "content": "You are a terse assistant."}] for _ in range(sessions)]
    results: list[list[dict]] = [[] for _ in range(sessions)]

    def one(s: int, t: int) -> None:
        histories[s].append({"role": "user", "content": user_turn(first_session + s, t, words)})
        r = chat(base_url, histories[s], **(extra_of(s, t) if extra_of is not None else {}))
        histories[s].append({"role": "assistant", "content": r["text"]})
        results[s].append(r)

    for t in range(turns):
        if before_turn is not None:
            before_turn(t)
        with ThreadPoolExecutor(max_workers=parallel) as pool:
            list(pool.map(lambda s: one(s, t), range(sessions)))
        if after_turn is not None:
            after_turn(t, results)
    return results


def shm_dirs_of(server: ServerProcess) -> list[Path]:
    """The private shared-memory directories (``/dev/shm/hiradix-<uid>-<pid>-rank<r>``) of the
    server's live processes (its schedulers make them)."""
    from hiradix.tiers.files import default_shm_dir

    base = default_shm_dir().parent
    return sorted(d for p in server.descendants() for d in base.glob(f"hiradix-{os.geteuid()}-{p.pid}-rank*"))


def start(model: Path, log: Path, max_total_tokens: int, extra: list[str], env: Optional[dict] = None) -> ServerProcess:
    """A CPU server (``env``: more environment variables, e.g. ``HIRADIX_FAULTS``)."""
    return ServerProcess(model, extra_args=cpu_args(max_total_tokens) + extra, env={**cpu_env(), **(env or {})},
                         log_path=log)


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


def assert_log_clean(server: ServerProcess, *bad: str) -> str:
    """The server's log has no traceback and none of `bad`; returns the log."""
    log = server.log_text()
    for marker in ("Traceback", *bad):
        assert marker not in log, log[-4000:]
    return log


def assert_chats_match_stock_and_hit_hbm_and_dram(tiered: list[list[dict]], stock: list[list[dict]],
                                                  longer_than: int, server: ServerProcess) -> None:
    """Chats run with `return_token_ids` on a hiradix server whose HBM is far smaller than the
    histories: stock's prompt and output ids, every later turn hits (in HBM or DRAM, nothing else),
    both tiers serve hits, and pages went HBM -> DRAM and back. First prompts exceed `longer_than`."""
    assert min(session[0]["prompt_tokens"] for session in tiered) > longer_than
    for s, (g, e) in enumerate(zip(tiered, stock)):
        assert [r["prompt_ids"] for r in g] == [r["prompt_ids"] for r in e], s
        assert [r["output_ids"] for r in g] == [r["output_ids"] for r in e], s
        for r in g[1:]:
            assert r["cached"] > 0 and r["cached"] == sum(r["details"].get(k, 0) or 0 for k in ("device", "host")), r
    hits = tier_hits(tiered)
    assert hits["device"] > 0 and hits["host"] > 0, hits
    for kind in ("BACKUP", "PROMOTE"):  # HBM -> DRAM, then DRAM -> HBM for the turns that hit there
        assert metric(server.base_url, "sglang:hiradix_moved_tokens_total", kind=kind) > 0, kind
    assert_log_clean(server, "IntegrityError")


def assert_same_outputs(got: list[list[dict]], expected: list[list[dict]]) -> None:
    for s, (g, e) in enumerate(zip(got, expected)):
        assert [r["text"] for r in g] == [r["text"] for r in e], f"session {s} differs"
        assert [r["completion_tokens"] for r in g] == [r["completion_tokens"] for r in e]


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


def mla_model(preset: str, root: Path) -> Path:
    """models/<preset>, built by scripts/make_model.py if missing (idempotent, ~6 s)."""
    return mla_models([preset], root)[preset]


def mla_models(presets: Sequence[str], root: Path) -> dict[str, Path]:
    """models/<preset> for each preset, built by scripts/make_model.py where missing, the builds
    side by side (each ~7 s of CPU, most of it importing torch; 0.1 s when the model exists)."""
    script = str(Path(__file__).resolve().parents[2] / "scripts" / "make_model.py")
    builds = {p: subprocess.Popen([sys.executable, script, "--preset", p, "--out", str(root / p)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for p in presets}  # fmt: skip
    try:
        for preset, build in builds.items():
            output, _ = build.communicate(timeout=600)
            if build.returncode != 0:
                raise RuntimeError(f"make_model.py --preset {preset} failed ({build.returncode}): {output[-2000:]!r}")
    finally:
        for build in builds.values():
            if build.poll() is None:
                build.kill()
                build.wait()
    return {p: root / p for p in presets}


def dram_pools_mapped(server: ServerProcess) -> set[str]:
    """Inodes of the hiradix DRAM pools (memfd ``hiradix-dram``) mapped by the server's processes."""
    inodes = set()
    for proc in server.descendants():
        try:
            with open(f"/proc/{proc.pid}/maps") as maps:
                inodes |= {line.split()[4] for line in maps if "memfd:hiradix-dram" in line}
        except OSError:
            continue  # a process that exited meanwhile
    return inodes


def generate_with_logprobs(base_url: str, input_ids: list[int], max_new_tokens: int, salt: Optional[str] = None) -> dict:
    """One greedy ``/generate`` of token ids with output logprobs: ``ids``, ``logprobs``,
    ``prompt_tokens`` (after any server-side cut), ``cached`` and ``details``
    (``cached_tokens_details``); ``salt`` sets ``cache_salt``."""
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
            "return_logprob": True, **({"cache_salt": salt} if salt else {})}
    req = urllib.request.Request(f"{base_url}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        meta = json.loads(resp.read())["meta_info"]
    return {"ids": [t[1] for t in meta["output_token_logprobs"]], "logprobs": [t[0] for t in meta["output_token_logprobs"]],
            "prompt_tokens": meta["prompt_tokens"], "cached": meta.get("cached_tokens", 0),
            "details": meta.get("cached_tokens_details") or {}}


def wait_backed_up(server: ServerProcess, tokens: float, timeout_s: float = 120.0) -> float:
    """Block until stock HiCache on ``server`` reports ``tokens`` host -> L3 backups
    (``sglang:backuped_tokens_total``); returns the count it reached."""
    deadline = time.monotonic() + timeout_s
    while (done := metric(server.base_url, "sglang:backuped_tokens_total")) < tokens:
        assert time.monotonic() < deadline, f"{server.base_url} backed up {done} of {tokens} tokens to L3"
        time.sleep(0.2)
    return done


def settled(read, done, timeout_s: float = 15.0, poll_s: float = 0.5):
    """``read()`` once ``done(value)`` holds, or its last value after ``timeout_s``: each rank
    publishes its counters at its own scheduler step (about once a second when idle)."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(poll_s)
        value = read()
    return value


def wait_fully_idle(base_url: str, timeout_s: float = 60.0) -> None:
    """Block until every scheduler of ``base_url`` has published a load snapshot (SGLang's
    ``/v1/loads``) taken after this call began with no request running, waiting, bootstrapping or
    in its PD prefill inflight queue: the state in which SGLang accepts ``/flush_cache``. A PD
    prefill server keeps a request in its inflight queue until the decode side acknowledges the
    transfer, which can come after the client has its answer. The idle scheduler publishes a
    snapshot each time it goes idle and about once a second while idle."""
    since = time.time()
    deadline = time.monotonic() + timeout_s
    while True:
        with urllib.request.urlopen(base_url + "/v1/loads?include=core,disagg", timeout=30) as resp:
            loads = json.loads(resp.read())["loads"]
        busy = [load for load in loads if load["timestamp"] < since or load["num_running_reqs"] or load["num_waiting_reqs"]
                or any(load.get("disaggregation", {}).get(k) for k in ("prefill_bootstrap_queue_reqs", "prefill_inflight_queue_reqs"))]  # fmt: skip
        if loads and not busy:
            return
        assert time.monotonic() < deadline, f"{base_url} not idle after {timeout_s} s: {busy or loads}"
        time.sleep(0.2)


def flush_tiers(base_url: str, timeout_s: float = 60.0) -> None:
    """Once SGLang is fully idle (``wait_fully_idle``), POST /flush_cache and wait until the HBM,
    DRAM and NVMe gauges of hiradix read 0 (the idle scheduler steps about once a second)."""
    wait_fully_idle(base_url, timeout_s)
    with urllib.request.urlopen(urllib.request.Request(base_url + "/flush_cache", method="POST"), timeout=60) as resp:
        assert resp.status == 200
    deadline = time.monotonic() + timeout_s
    while any(metric(base_url, "sglang:hiradix_tier_used_tokens", tier=t) for t in ("HBM", "DRAM", "NVMe")):
        assert time.monotonic() < deadline, "tiers not empty after /flush_cache"
        time.sleep(0.5)


def settle_transfers(base_url: str, timeout_s: float = 120.0, **labels: str) -> None:
    """Drive scheduler steps with 1-token requests until no transfer is in flight (on the ranks
    ``labels`` select, e.g. ``tp_rank="0"``) twice in a row: what landed on NVMe is in its
    durable index before a test stops the server (a stop kills transfers in flight)."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < 2:
        assert time.monotonic() < deadline, "transfers still in flight"
        chat(base_url, [{"role": "user", "content": "ping"}], max_tokens=1)
        quiet = quiet + 1 if metric(base_url, "sglang:hiradix_transfers_in_flight", **labels) == 0 else 0


def fake_sglang(tmp_path: Path, launch_server_source: str) -> dict[str, str]:
    """A package ``sglang`` whose ``launch_server`` module is ``launch_server_source``, under
    ``tmp_path/fake``; the environment that puts it ahead of the real one (``ServerProcess(env=...)``)."""
    package = tmp_path / "fake" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(launch_server_source)
    return {"PYTHONPATH": str(tmp_path / "fake")}
