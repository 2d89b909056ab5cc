"""The cluster simulator (``bench/sim/cluster.py``): SMG router policies, the shared store, load or recompute.

The scripted chat trace of ``test_simulate`` (8 conversations x 3 turns behind a shared system
block; 47 of 72 block references hit in one infinite cache) on 4 simulated servers, routed at
arrival. Invariants are checked after every step of every server (``check_every_step``).
"""

from __future__ import annotations

import json

import pytest

from bench.sim.cluster import Scenario, main, run_cluster
from bench.sim.router import ROUTER_POLICIES, CacheAwareConfig, Router, conversation_of
from bench.sim.simulate import BLOCK_TOKENS, TraceRequest, infinite_hit_rates, load_trace
from tests.benchmarks.test_simulate import ample, chat_trace

HIT_BLOCKS = 47  # of the chat trace's 72 block references (see chat_trace)


def req(*ids: int, tokens: int = 0) -> TraceRequest:
    return TraceRequest(0.0, tokens or BLOCK_TOKENS * len(ids), 1, ids)


def test_sticky_keeps_conversations_together_and_random_is_seeded(tmp_path):
    trace = load_trace(chat_trace(tmp_path))
    sticky = Router("sticky", 4)
    where: dict[int, set] = {}
    for r in trace:
        where.setdefault(conversation_of(r), set()).add(sticky.route(r, [0] * 4))
    assert all(len(s) == 1 for s in where.values()) and len(set().union(*where.values())) > 1

    def picks(seed):
        router = Router("random", 4, seed)
        return [router.route(r, [0] * 4) for r in trace]

    assert picks(3) == picks(3) and picks(3) != picks(4)
    with pytest.raises(ValueError, match="round_robin, random, power_of_two, cache_aware, sticky"):
        Router("least_load", 4)


def test_round_robin_is_balanced_and_power_of_two_picks_the_lighter_of_two():
    rr = Router("round_robin", 4)
    assert [rr.route(req(1), [0] * 4) for _ in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    p2 = Router("power_of_two", 4, seed=0)
    picks = [p2.route(req(1), [3, 0, 1, 2]) for _ in range(300)]
    # the heaviest server loses every pair; the lightest wins all 3 pairs it is drawn in (1/2 of draws)
    assert 0 not in picks and 120 < picks.count(1) < 180


def test_cache_aware_follows_a_repeated_prefix_until_loads_are_imbalanced():
    ca = Router("cache_aware", 4)
    first = ca.route(req(0, 11, 12), [0, 0, 0, 0])  # empty trees: a miss -> least loaded (ties: fewest routed, index)
    assert first == 0 and ca.decisions["miss"] == 1
    # the same conversation's next turn (3 of 4 blocks match, 0.75 > 0.3) follows it, even to a busier server
    assert ca.route(req(0, 11, 12, 13), [3, 0, 0, 0]) == 0 and ca.decisions["match"] == 1
    # only the system block matches (1 of 4 = 0.25 <= 0.3): a miss, to the least loaded
    assert ca.route(req(0, 21, 22, 23), [3, 1, 0, 2]) == 2
    # imbalanced: 100 - 0 > 64 and 100 > 1.5 x 0: the least loaded, whatever the match
    assert ca.route(req(0, 11, 12, 13, 14), [100, 5, 0, 7]) == 2 and ca.decisions["imbalanced"] == 1
    # balanced again (100 - 40 = 60 <= 64): back to the match (server 0 or 2 hold 0-11-12-13; 2 most recently)
    assert ca.route(req(0, 11, 12, 13, 14, 15), [100, 40, 40, 40]) == 2
    smallest = Router("cache_aware", 3, cache_aware=CacheAwareConfig(miss="smallest_tree"))
    smallest.route(req(0, 1, 2), [0, 0, 0])  # -> 0 (all trees empty)
    assert smallest.route(req(7, 8), [0, 9, 9]) == 1  # server 0's tree is the largest: 1 (tie with 2, index)


def test_cache_aware_prunes_each_tree_to_its_size_by_lru():
    ca = Router("cache_aware", 1, cache_aware=CacheAwareConfig(eviction_interval_s=10, max_tree_tokens=2 * BLOCK_TOKENS))
    ca.route(req(1, 2, 3), [0], now_s=0.0)
    ca.route(req(1, 4), [0], now_s=1.0)  # blocks by last use: 2, 3 (oldest), 1, 4
    ca.route(req(9), [0], now_s=10.0)  # pruning first: 5 blocks -> 2 (1 and 4), then 9 is added
    assert list(ca.tree.held[0]) == [1, 4, 9] and ca.tree.size_tokens[0] == 3 * BLOCK_TOKENS


def test_round_robin_imbalance_is_one_and_sticky_hits_each_servers_own_reuse(tmp_path):
    trace = load_trace(chat_trace(tmp_path))
    cfg = ample()
    rr = run_cluster(trace, cfg, Scenario(4, "round_robin", store=False), "dram", "lookahead")
    assert rr["requests_per_server"] == [6, 6, 6, 6] and rr["imbalance"] == 1.0
    sticky = run_cluster(trace, cfg, Scenario(4, "sticky", store=False), "dram", "lookahead")
    router, parts = Router("sticky", 4), [[] for _ in range(4)]
    for r in trace:
        parts[router.route(r, [0] * 4)].append(r)
    own_reuse = sum(infinite_hit_rates(p, cfg.page_size)["token_hit_rate"] * sum(r.input_len for r in p) for p in parts if p)
    prompt = sum(r.input_len for r in trace)
    assert sticky["hit_rate"] * prompt == pytest.approx(own_reuse) == (HIT_BLOCKS - 3) * BLOCK_TOKENS
    assert sticky["store_hit_rate"] == 0.0 and sticky["time_saved"] == pytest.approx(sticky["hit_rate"])


def test_the_store_raises_round_robin_to_sticky(tmp_path):
    trace = load_trace(chat_trace(tmp_path))
    cfg = ample()
    prompt = sum(r.input_len for r in trace)
    infinite = infinite_hit_rates(trace, cfg.page_size)["token_hit_rate"]
    # 3 servers: turn t of conversation c goes to (8t + c) mod 3, a new server every turn (4 would keep it)
    sticky = run_cluster(trace, cfg, Scenario(3, "sticky", store=False), "dram", "lookahead")
    rr = run_cluster(trace, cfg, Scenario(3, "round_robin", store=False), "dram", "lookahead")
    shared = run_cluster(trace, cfg, Scenario(3, "round_robin", store=True), "dram", "lookahead")
    # Without a store only block 0 hits (24 references - 3 first sightings); with it, all of sticky's
    assert rr["hit_rate"] * prompt == (24 - 3) * BLOCK_TOKENS and rr["imbalance"] == 1.0
    assert shared["hit_rate"] >= sticky["hit_rate"] and shared["hit_rate"] <= infinite + 1e-9
    assert shared["store_hit_rate"] > 0 and shared["store_objects"] > 0 and shared["requests"] == len(trace)


@pytest.mark.parametrize("store_read_bytes_per_s, reads", [(1e8, False), (1e11, True)])
def test_load_or_recompute_never_reads_a_slow_store_and_always_reads_a_fast_one(tmp_path, store_read_bytes_per_s, reads):
    trace = load_trace(chat_trace(tmp_path))
    scenario = Scenario(4, "round_robin", store=True)
    out = {}
    for load_policy in ("worth", "always", "never"):
        cfg = ample(cost_model=True, store_read_bytes_per_s=store_read_bytes_per_s, load_policy=load_policy)
        out[load_policy] = run_cluster(trace, cfg, scenario, "dram", "lookahead")
    worth = out["worth"]
    # 128 KiB per token at 50k tokens/s: break-even 6.6 GB/s; 0.1 GB/s never pays, 100 GB/s always does
    assert (worth["store_tokens"] > 0) == reads and (worth["recomputed_hit_tokens"] == 0) == reads
    assert worth["store_tokens"] == out["always" if reads else "never"]["store_tokens"]
    assert worth["time_saved"] >= max(out["always"]["time_saved"], out["never"]["time_saved"]) - 1e-12
    assert out["always"]["store_tokens"] > 0 and out["never"]["store_tokens"] == 0


def test_cli_writes_json_and_png(tmp_path, capsys):
    trace = chat_trace(tmp_path)
    out = tmp_path / "out"
    assert main(["--trace", str(trace), "--instances", "1,2", "--policies", "sticky,cache_aware", "--jobs", "1",
                 "--out-dir", str(out)]) == 0
    summary = json.loads((out / "simulate_cluster.json").read_text())
    assert [r["scenario"] for r in summary["results"]] == [
        "1x sticky", "1x sticky +store", "2x sticky", "2x sticky +store", "2x cache_aware", "2x cache_aware +store"]
    assert summary["config"]["cost_model"] is True and summary["results"][2]["time_scale"] == 0.5
    assert (out / "simulate_cluster.png").stat().st_size > 0
    assert "2x cache_aware +store" in capsys.readouterr().out
    assert set(ROUTER_POLICIES) == {"round_robin", "random", "power_of_two", "cache_aware", "sticky"}
