"""The cluster simulator (``bench/sim/cluster.py``): routing, and what a shared store recovers.

The scripted chat trace of ``test_simulate`` (8 conversations x 3 turns behind a shared system
block; 47 of 72 block references hit in one infinite cache) on 4 simulated servers. Invariants
are checked after every step of every server (``check_every_step``).
"""

from __future__ import annotations

import json

from bench.sim.simulate import BLOCK_TOKENS, infinite_hit_rates, load_trace
from bench.sim.cluster import Scenario, conversation_of, main, route, run_cluster
from tests.benchmarks.test_simulate import ample, chat_trace

HIT_BLOCKS = 47  # of the chat trace's 72 block references (see chat_trace)


def test_sticky_routing_keeps_conversations_together_and_random_is_seeded(tmp_path):
    trace = load_trace(chat_trace(tmp_path))
    parts = route(trace, 4, "sticky")
    for part in parts:  # every conversation's turns on one server
        for conv in {conversation_of(r) for r in part}:
            assert all(conversation_of(r) in {conversation_of(x) for x in part} for r in trace if conversation_of(r) == conv)
    assert sum(len(p) for p in parts) == len(trace) and sum(1 for p in parts if p) > 1
    assert route(trace, 4, "random", seed=3) == route(trace, 4, "random", seed=3)
    assert route(trace, 4, "random", seed=3) != route(trace, 4, "random", seed=4)


def test_a_shared_store_recovers_what_random_routing_loses(tmp_path):
    trace = load_trace(chat_trace(tmp_path))
    cfg = ample()
    infinite = infinite_hit_rates(trace, cfg.page_size)["token_hit_rate"]
    sticky = run_cluster(trace, cfg, Scenario(4, "sticky", store=False), "dram", "lookahead")
    scattered = run_cluster(trace, cfg, Scenario(4, "random", store=False), "dram", "lookahead", seed=1)
    shared = run_cluster(trace, cfg, Scenario(4, "random", store=True), "dram", "lookahead", seed=1)
    prompt = sum(r.input_len for r in trace)
    # Sticky: each server holds its conversations whole (ample tiers): every reusable block hits,
    # except block 0 once per server that sees it first (4 servers instead of 1).
    assert sticky["hit_rate"] * prompt == (HIT_BLOCKS - 3) * BLOCK_TOKENS
    assert scattered["hit_rate"] < sticky["hit_rate"] and scattered["store_share"] == 0.0
    # The store: a turn on another server than its history's finds it there.
    assert shared["hit_rate"] * prompt >= (HIT_BLOCKS - 3) * BLOCK_TOKENS
    assert shared["store_share"] > 0 and shared["hit_rate"] <= infinite + 1e-9
    assert shared["store_objects"] > 0 and shared["requests"] == len(trace)


def test_cli_writes_json_and_png(tmp_path, capsys):
    trace = chat_trace(tmp_path)
    out = tmp_path / "out"
    assert main(["--trace", str(trace), "--instances", "1,2", "--out-dir", str(out)]) == 0
    summary = json.loads((out / "simulate_cluster.json").read_text())
    assert [r["scenario"] for r in summary["results"]] == [
        "1x sticky", "1x sticky +store", "2x sticky", "2x sticky +store", "2x random", "2x random +store"]
    assert (out / "simulate_cluster.png").stat().st_size > 0
    assert "2x random +store" in capsys.readouterr().out
