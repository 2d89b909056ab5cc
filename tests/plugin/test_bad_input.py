"""Bad input (issue 6, item 4): what test_flags does not cover yet, mostly against a real server.

Already covered elsewhere: invalid and contradictory flags, a missing NVMe path, a path that is a
file or not writable (/proc), NVMe or DRAM sizes beyond free disk or RAM (tests/plugin/test_flags.py);
O_DIRECT refused by the NVMe store itself (tests/tiers/test_tiers.py).

Here, without a server: a directory without write permission is refused (non-root only; root
writes anywhere). With one (e2e): one stock server computes the reference greedy outputs, then
one hiradix server takes all the bad input. Its settings:

* `HIRADIX_CHECK_INTEGRITY=1`: the tree and tier books prove their invariants after every
  scheduler step; a violation raises `IntegrityError` in the scheduler, SGLang logs "Scheduler
  hit an exception" and the server dies. `assert_still_sane` looks for both, and for SGLang's
  own idle-time "memory leak" check, after each test, and asks `/health_generate`.
* NVMe directory on a file system that refuses O_DIRECT. tmpfs does so only before Linux 6.6,
  so the refusal is simulated: a `sitecustomize` on the server's PYTHONPATH makes `os.open`
  fail with EINVAL for O_DIRECT under that directory, as such file systems do at open.
* `HIRADIX_FAULTS=load_delay_s=6`: the I/O worker holds every NVMe read 6 s (load timeout
  30 s), so a client can leave while its prefetch is in flight.
* HBM 2,048 tokens, DRAM 0.006 GB (~2.9k tokens), chunked prefill of 64 tokens, 8 running.

Not tested: `/generate` with `"text": ""` (tokenized to no token at all) crashes stock SGLang
0.5.23 on the CPU path as well (a zero-token forward in the rotary embedding), so it is not a
hiradix case; the OpenAI endpoints refuse empty prompts with 400 before that point.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import stat
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from bench.soak.run import LogScanner
from hiradix.config import HiRadixConfig, HiRadixConfigError, check_machine
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env

LOAD_DELAY_S = 6.0
WAIT_S = 60.0  # upper bound for any awaited event; a correct run never gets near it
SHARED_SESSIONS = 32  # sessions sharing one system prompt: 1 alone, then 31 at once

# Prompts as token ids (the tiny model's vocabulary has 4,096 ids; 0-4 are special).
LONG_IDS = [(i * 13 + 1) % 4000 + 5 for i in range(1900)]  # 30 chunks of 64, fits HBM 2,048
HISTORY_IDS = [(i * 17 + 3) % 4000 + 5 for i in range(600)]  # session whose history goes to NVMe
NEXT_TURN_IDS = [11, 12, 13, 14, 15]
SYSTEM_PROMPT = "You are the archive assistant of a small museum. " + " ".join(
    f"Rule {i}: answer briefly about exhibit {i}, room {i % 7}, and cite catalogue {i * 31}." for i in range(40)
)

NO_ODIRECT_SITECUSTOMIZE = '''\
"""Test shim: O_DIRECT is refused (EINVAL at open) under $HIRADIX_TEST_NO_ODIRECT_DIR."""
import errno
import os

_ROOT = os.environ.get("HIRADIX_TEST_NO_ODIRECT_DIR")
if _ROOT:
    _real_open = os.open

    def _open(path, flags, mode=0o777, *, dir_fd=None):
        full = os.path.abspath(os.fsdecode(path))
        if flags & os.O_DIRECT and (full + os.sep).startswith(_ROOT + os.sep):
            raise OSError(errno.EINVAL, "Invalid argument (no O_DIRECT on this file system)", path)
        return _real_open(path, flags, mode, dir_fd=dir_fd)

    os.open = _open
'''


# ---------------------------------------------------------------------- no server


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_nvme_dir_without_write_permission_is_refused(tmp_path):
    locked = tmp_path / "nvme"
    locked.mkdir(mode=0o500)
    try:
        with pytest.raises(HiRadixConfigError, match=f"^--hiradix-nvme-path {locked} is not writable$"):
            check_machine(HiRadixConfig(nvme_path=locked, nvme_bytes=1))
        assert list(locked.iterdir()) == []  # the probe left nothing behind
    finally:
        locked.chmod(0o700)


# ---------------------------------------------------------------------- helpers


def post(base_url: str, path: str, body: dict, timeout_s: float = 300) -> tuple[int, dict]:
    """`(status, decoded JSON body)`; HTTP errors are returned, not raised."""
    req = urllib.request.Request(base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def generate(base_url: str, input_ids: list[int], max_new_tokens: int = 8) -> dict:
    status, out = post(base_url, "/generate", {"input_ids": input_ids, "return_cached_tokens_details": True,
                                               "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})
    assert status == 200, out
    return out


def chat(base_url: str, messages: list[dict], max_tokens: int = 8) -> tuple[int, dict]:
    body = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": max_tokens}
    return post(base_url, "/v1/chat/completions", body)


def chat_text(base_url: str, messages: list[dict]) -> tuple[str, int]:
    """`(answer, cached prompt tokens)` of a greedy chat request that must succeed."""
    status, out = chat(base_url, messages)
    assert status == 200, out
    return out["choices"][0]["message"]["content"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample from /metrics over the label sets matching `labels`."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()))  # fmt: skip


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll a server state (metrics, log) until `condition()`; fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


def open_stream(server: ServerProcess, input_ids: list[int]) -> http.client.HTTPConnection:
    """Send a streaming /generate request and return its connection, unread."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=WAIT_S)
    body = {"input_ids": input_ids, "stream": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def hang_up(conn: http.client.HTTPConnection) -> None:
    """The client goes away: shut the socket down without reading the answer."""
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def shared_prompt_sessions() -> list[list[dict]]:
    return [[{"role": "system", "content": SYSTEM_PROMPT},
             {"role": "user", "content": f"Visitor {s} asks about exhibit {s * 3 % 40}."}]
            for s in range(SHARED_SESSIONS)]  # fmt: skip


def run_shared_prompt_sessions(base_url: str) -> list[tuple[str, int]]:
    """Session 0 alone (it puts the system prompt into the tree), then the rest at once."""
    sessions = shared_prompt_sessions()
    first = chat_text(base_url, sessions[0])
    with ThreadPoolExecutor(max_workers=len(sessions) - 1) as pool:
        return [first, *pool.map(lambda messages: chat_text(base_url, messages), sessions[1:])]


def server_flags(extra: list[str]) -> list[str]:
    return cpu_args(2048) + ["--chunked-prefill-size", "64", "--max-running-requests", "8", *extra]


# ---------------------------------------------------------------------- servers


def compute_references(url: str) -> dict:
    """Greedy outputs of every prompt the tests send, from the server at `url`."""
    history_out = generate(url, HISTORY_IDS)["output_ids"]
    return {
        "long": generate(url, LONG_IDS)["output_ids"],
        "history": history_out,
        "next_turn": generate(url, HISTORY_IDS + history_out + NEXT_TURN_IDS)["output_ids"],
        "shared": [text for text, _ in run_shared_prompt_sessions(url)],
        "empty_user": chat_text(url, [{"role": "user", "content": ""}])[0],
        "one_token": generate(url, [7])["output_ids"],
        "hello": chat_text(url, [{"role": "user", "content": "Hello after a refusal."}])[0],
    }


@dataclass
class Served:
    server: ServerProcess  # the hiradix server
    log: LogScanner  # reads its log; collects error-marker lines
    nvme_dir: Path  # --hiradix-nvme-path (O_DIRECT refused under it)
    references: dict  # stock SGLang's greedy outputs (compute_references)


@pytest.fixture(scope="module")
def served(tiny_model: Path, tmp_path_factory) -> Served:
    """The hiradix server of the module docstring, started while a stock server (same chunking,
    batch limit and HBM) computes the reference outputs; both are stopped also on failure."""
    tmp = tmp_path_factory.mktemp("bad_input")
    shim = tmp / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(NO_ODIRECT_SITECUSTOMIZE)
    nvme = tmp / "nvme"
    nvme.mkdir(mode=0o700)
    env = dict(cpu_env(), HIRADIX_CHECK_INTEGRITY="1", HIRADIX_FAULTS=f"load_delay_s={LOAD_DELAY_S:g}",
               HIRADIX_TEST_NO_ODIRECT_DIR=str(nvme),
               PYTHONPATH=os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")])))  # fmt: skip
    flags = server_flags(["--enable-hiradix", "--hiradix-dram-gb", "0.006", "--hiradix-nvme-path", str(nvme),
                          "--hiradix-nvme-gb", "0.05", "--hiradix-load-timeout-s", "30"])  # fmt: skip
    hiradix = ServerProcess(tiny_model, extra_args=flags, env=env, log_path=tmp / "hiradix.log")
    hiradix.start(wait=False)
    try:
        with ServerProcess(tiny_model, extra_args=server_flags([]), env=cpu_env(), log_path=tmp / "stock.log") as stock:
            references = compute_references(stock.base_url)
        hiradix.wait_healthy()
        yield Served(hiradix, LogScanner(hiradix.log_path), nvme, references)
    finally:
        hiradix.stop()


def assert_still_sane(server: ServerProcess, log: LogScanner) -> None:
    """Alive, healthy, and no broken invariant, scheduler crash or KV leak in the log."""
    with urllib.request.urlopen(server.base_url + "/health_generate", timeout=WAIT_S) as resp:
        assert resp.status == 200
    log.read_new()
    assert log.errors == [], log.errors


# ---------------------------------------------------------------------- e2e


@pytest.mark.e2e
def test_nvme_without_odirect_falls_back_to_buffered_io_with_a_warning(served):
    server, log, nvme_dir = served.server, served.log, served.nvme_dir
    text = server.log_text()
    warnings = [line for line in text.splitlines() if "refuses O_DIRECT" in line]
    # One warning, from the scheduler that creates the slot file; the worker that serves it
    # only notes the fallback at INFO (it may not be shown at the default log level).
    from_worker = [w for w in warnings if "io-worker[" in w]
    assert len(warnings) - len(from_worker) == 1 and len(from_worker) <= 1, warnings
    assert not any("WARNING" in w for w in from_worker), from_worker
    assert all(f"{nvme_dir}/hiradix-rank0/nvme.kv: file system refuses O_DIRECT" in w for w in warnings)
    assert "(posix, direct_io=False)" in text
    # The files are private while the server runs (issue 6, item 6).
    rank_dir = nvme_dir / "hiradix-rank0"
    assert stat.S_IMODE(rank_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((rank_dir / "nvme.kv").stat().st_mode) == 0o600
    assert_still_sane(server, log)


@pytest.mark.e2e
def test_many_sessions_share_one_system_prompt(served):
    server, log, references = served.server, served.log, served.references
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.model_path)
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in shared_prompt_sessions()]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[:2]]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)  # tokens all sessions have in common
    shared_pages_tokens = shared // 16 * 16
    assert shared_pages_tokens >= 400  # the system prompt spans many pages
    got = run_shared_prompt_sessions(server.base_url)
    assert [text for text, _ in got] == references["shared"]
    # Every session after the first found the whole system prompt in the tree (one copy shared).
    cached = [c for _, c in got[1:]]
    assert all(c >= shared_pages_tokens for c in cached), (shared_pages_tokens, cached)
    assert_still_sane(server, log)


@pytest.mark.e2e
def test_prompt_longer_than_the_context_is_refused_and_serving_goes_on(served):
    server, log, references = served.server, served.log, served.references
    status, out = chat(server.base_url, [{"role": "user", "content": "word " * 9000}])  # > 8,192 tokens
    assert status == 400 and "longer than the model's context length (8192 tokens)" in out["message"], out
    status, out = post(server.base_url, "/generate", {"input_ids": [9] * 3000})  # fits the context, not HBM
    assert status == 400 and "exceeds the maximum allowed length" in out["error"]["message"], out
    assert chat_text(server.base_url, [{"role": "user", "content": "Hello after a refusal."}])[0] == references["hello"]
    assert_still_sane(server, log)


@pytest.mark.e2e
def test_empty_prompts(served):
    server, log, references = served.server, served.log, served.references
    status, out = post(server.base_url, "/v1/completions", {"model": "default", "prompt": "", "max_tokens": 4})
    assert status == 400 and out["message"] == "Prompt cannot be empty", out
    status, out = chat(server.base_url, [])
    assert status == 400 and out["message"] == "Messages cannot be empty.", out
    status, out = post(server.base_url, "/generate", {"input_ids": [], "sampling_params": {"max_new_tokens": 4}})
    assert status == 400 and "input_ids cannot be empty" in json.dumps(out), out
    # An empty user message still makes a prompt (the chat template); one token is less than a page.
    assert chat_text(server.base_url, [{"role": "user", "content": ""}])[0] == references["empty_user"]
    assert generate(server.base_url, [7])["output_ids"] == references["one_token"]
    assert_still_sane(server, log)


def _last_pending_tokens(text: str) -> int | None:
    found = re.findall(r"Prefill batch.*#pending-token: (\d+)", text)
    return int(found[-1]) if found else None


@pytest.mark.e2e
def test_client_disconnects_mid_prefill(served):
    server, log, references = served.server, served.log, served.references
    url = server.base_url
    aborted = metric(url, "sglang:num_aborted_requests_total")
    log.read_new()
    seen: list[str] = []

    def first_chunk_prefilled() -> bool:
        seen.append(log.read_new())
        return _last_pending_tokens("".join(seen)) is not None

    conn = open_stream(server, LONG_IDS)
    wait_until(first_chunk_prefilled, "the first prefill chunk")
    # Freeze the scheduler in place, with chunks of the prompt still to go.
    assert post(url, "/pause_generation", {"mode": "in_place"})[0] == 200
    try:
        hang_up(conn)
        wait_until(lambda: metric(url, "sglang:num_aborted_requests_total") > aborted, "the abort of the request")
        seen.append(log.read_new())
        pending = _last_pending_tokens("".join(seen))
        assert pending is not None and 0 < pending < len(LONG_IDS), pending  # paused with chunks to go
    finally:
        assert post(url, "/continue_generation", {})[0] == 200
    # The same prompt again: the chunks prefilled before the client left are reused, and the
    # answer is stock's.
    again = generate(url, LONG_IDS)
    assert again["output_ids"] == references["long"]
    assert 0 < again["meta_info"]["cached_tokens"] < len(LONG_IDS), again["meta_info"]
    assert_still_sane(server, log)


@pytest.mark.e2e
def test_client_disconnects_mid_prefetch(served):
    server, log, references = served.server, served.log, served.references
    url = server.base_url
    first = generate(url, HISTORY_IDS)
    assert first["output_ids"] == references["history"]
    for k in range(10):  # 7,000 other tokens push the history out of HBM and DRAM, onto NVMe
        generate(url, [(i * (k + 19) + k * 101) % 4000 + 5 for i in range(700)])
    next_turn = HISTORY_IDS + first["output_ids"] + NEXT_TURN_IDS

    def prefetch(outcome: str) -> float:
        return metric(url, "sglang:hiradix_prefetch_tokens_total", outcome=outcome)

    started, completed = prefetch("started"), prefetch("completed")
    skips, aborted = metric(url, "sglang:hiradix_admission_skips_total"), metric(url, "sglang:num_aborted_requests_total")
    conn = open_stream(server, next_turn)
    wait_until(lambda: prefetch("started") > started and metric(url, "sglang:hiradix_admission_skips_total") > skips,
               "the NVMe read of the history and the request waiting for it")
    hang_up(conn)
    wait_until(lambda: metric(url, "sglang:num_aborted_requests_total") > aborted, "the abort of the request")
    assert prefetch("completed") == completed  # the client left while its read was held in the worker
    wait_until(lambda: prefetch("completed") > completed, "the read landing without its requester")
    again = generate(url, next_turn)
    assert again["output_ids"] == references["next_turn"]
    meta = again["meta_info"]
    assert meta["cached_tokens"] >= len(HISTORY_IDS) // 16 * 16, meta  # the whole history was reused,
    details = meta["cached_tokens_details"]  # ... from below HBM: the read from NVMe (buffered I/O) landed
    assert details.get("host", 0) + details.get("storage", 0) > 0, meta  # (a look-ahead read counts as host)
    assert_still_sane(server, log)
