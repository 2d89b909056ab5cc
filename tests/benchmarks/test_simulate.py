"""The trace simulator (``bench/sim/simulate.py`` over ``hiradix.testing.sim_ports``) on scripted traces.

Small Mooncake-format traces written to a temp dir; every simulated step ends with
``books.check_integrity()`` plus the HBM slot balance (``SimConfig.check_every_step``).
Expected figures are worked out by hand in the comments.
"""

from __future__ import annotations

import json

import pytest

from bench.sim.offline import belady_hit_rate, lru_hit_rate
from bench.sim.overflow import ConversationCuts
from bench.sim.simulate import BLOCK_TOKENS, Engine, SimConfig, infinite_hit_rates, load_trace, main, run_scenario
from hiradix.testing.sim_ports import SimClock, SimDevicePool, SimIOClient
from hiradix.io.protocol import LoadPages, StorePages
from hiradix.core.node import IntegrityError

A, B, C, D, G, F = 1, 2, 3, 4, 5, 6  # block ids of the scripted traces


def write_trace(path, rows):
    """rows: (timestamp s, hash ids, output tokens[, input tokens]); blocks are full unless given."""
    with open(path, "w") as f:
        for row in rows:
            t_s, ids, out = row[:3]
            inp = row[3] if len(row) > 3 else BLOCK_TOKENS * len(ids)
            f.write(json.dumps({"timestamp": int(t_s * 1000), "input_length": inp, "output_length": out, "hash_ids": ids}) + "\n")
    return path


def chat_trace(tmp_path):
    """8 conversations x 3 turns, all behind the shared system block 0; arrivals 10 s apart.

    Turn t of conversation c sends [0, c1, .., ct]. Block references: 8 x (2 + 3 + 4) = 72.
    Hits: turn 1 hits block 0 except the very first request (7); turn 2 hits 2 blocks (16);
    turn 3 hits 3 (24): 47 of 72.
    """
    rows, t = [], 0.0
    for turn in (1, 2, 3):
        for conv in range(8):
            rows.append((t, [0] + [100 * (conv + 1) + k for k in range(turn)], 4))
            t += 10.0
    return write_trace(tmp_path / "chat.jsonl", rows)


def ample(**kw) -> SimConfig:
    base = dict(hbm_tokens=64 * BLOCK_TOKENS, dram_tokens=64 * BLOCK_TOKENS, nvme_tokens=256 * BLOCK_TOKENS, check_every_step=True)
    base.update(kw)
    return SimConfig(**base)


def test_infinite_hit_rate_by_hand(tmp_path):
    trace = load_trace(chat_trace(tmp_path))
    inf = infinite_hit_rates(trace, page_size=512)
    assert (inf["block_refs"], inf["distinct_blocks"]) == (72, 25)
    assert inf["block_hit_rate"] == pytest.approx(47 / 72)
    assert inf["token_hit_rate"] == pytest.approx(47 / 72)  # all blocks full


def test_partial_last_block_counts_whole_pages_only(tmp_path):
    # [7, 8] with 700 tokens (block 8 holds 188), then the same prompt again.
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [(0, [7, 8], 1, 700), (5, [7, 8], 1, 700)]))
    # page 128: the second request can hit 512 + 128 tokens of 1400 prompt tokens
    assert infinite_hit_rates(trace, 128)["token_hit_rate"] == pytest.approx(640 / 1400)
    assert infinite_hit_rates(trace, 512)["token_hit_rate"] == pytest.approx(512 / 1400)
    assert infinite_hit_rates(trace, 512)["block_hit_rate"] == pytest.approx(2 / 4)
    r = run_scenario(trace, ample(page_size=128), "hbm", "lru")
    assert r["hit_tokens"]["hbm"] == 640 and r["block_hit_rate"] == pytest.approx(2 / 4)


@pytest.mark.parametrize("tier", ["hbm", "dram", "nvme"])
@pytest.mark.parametrize("policy", ["lru", "lookahead", "predictive"])
def test_ample_cache_reaches_the_infinite_hit_rate(tmp_path, tier, policy):
    trace = load_trace(chat_trace(tmp_path))
    r = run_scenario(trace, ample(), tier, policy)
    assert r["hit_tokens"] == {"hbm": 47 * 512, "dram": 0, "nvme": 0}  # nothing ever leaves HBM
    assert r["block_hit_rate"] == pytest.approx(47 / 72)
    assert r["requests"] == 24 and r["rejected"] == 0


def test_token_level_keys_give_the_same_decisions(tmp_path):
    trace = load_trace(chat_trace(tmp_path))
    small = dict(hbm_tokens=6 * BLOCK_TOKENS, dram_tokens=4 * BLOCK_TOKENS, page_size=256)
    pages = run_scenario(trace, ample(**small), "nvme", "lookahead")
    tokens = run_scenario(trace, ample(token_level=True, **small), "nvme", "lookahead")
    assert pages["hit_tokens"] == tokens["hit_tokens"]
    assert pages["hit_tokens"]["dram"] + pages["hit_tokens"]["nvme"] > 0  # the small HBM really pushed KV down


def scripted_cfg(**kw) -> SimConfig:
    """One request at a time; 1 s of prefill per 512-token page; decode 1 token/s."""
    base = dict(
        page_size=512, max_running=1, prefill_tokens_per_s=512.0, decode_tokens_per_s=1.0,
        kv_bytes_per_token=1, nvme_read_bytes_per_s=512.0, nvme_write_bytes_per_s=51200.0,
        check_every_step=True,
    )  # fmt: skip
    base.update(kw)
    return SimConfig(**base)


@pytest.mark.parametrize(
    "tier, expect",
    [
        # HBM only: LRU deleted A, so the queued request recomputes it.
        ("hbm", {"lru": {"hbm": 0, "dram": 0, "nvme": 0}, "lookahead": {"hbm": 512, "dram": 0, "nvme": 0}}),
        # + DRAM: LRU demoted A to DRAM and loads it back; look-ahead kept it in HBM.
        ("dram", {"lru": {"hbm": 0, "dram": 512, "nvme": 0}, "lookahead": {"hbm": 512, "dram": 0, "nvme": 0}}),
    ],
)
@pytest.mark.parametrize("policy", ["lru", "lookahead"])
def test_lookahead_keeps_what_a_queued_request_needs(tmp_path, tier, expect, policy):
    # HBM holds 4 pages. t=0 [A] and t=2 [B] leave A (older) and B in HBM. At t=4 [C,D,E]
    # needs 3 pages (1 eviction) while [A,F] waits behind it (max_running=1):
    #   lru       evicts A (least recent)       -> [A,F] at t=7 misses A in HBM;
    #   lookahead evicts B (A is needed next)   -> [A,F] hits A in HBM.
    rows = [(0, [A], 0), (2, [B], 0), (4, [C, D, 9], 0), (4, [A, F], 0)]
    trace = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    cfg = scripted_cfg(hbm_tokens=4 * 512, dram_tokens=8 * 512)
    r = run_scenario(trace, cfg, tier, policy)
    assert r["hit_tokens"] == expect[policy]


@pytest.mark.parametrize("policy", ["lru", "lookahead"])
def test_lookahead_reads_nvme_ahead_of_admission(tmp_path, policy):
    # HBM 4 pages, DRAM 2 pages, NVMe 16; a page reads in 1 s, writes in 0.01 s.
    # t=0..7: [A], [B], [C], [D] fill HBM; each backup to DRAM drops the oldest redundant
    #         DRAM copy (A at t=5, B at t=7).
    # t=8:  [G] with 4 output tokens needs 2 pages: evicts A then B from HBM (each backed up
    #       to DRAM first, dropping C's and D's DRAM copies), both demoted to NVMe.
    # t=9:  G's backup drops A's DRAM copy: A is on NVMe only. G decodes until t=13.
    # t=10: [A,F] arrives and waits (G holds the only running slot).
    #   lookahead: the window reads A into DRAM at t=10 (lands t=11); admitted at t=13,
    #              A served from its DRAM copy read from NVMe (an NVMe hit), no NVMe wait.
    #   lru:       first tried at t=13, reads A on demand, skipped until t=14: NVMe, 1 s wait.
    rows = [(0, [A], 0), (2, [B], 0), (4, [C], 0), (6, [D], 0), (8, [G], 4), (10, [A, F], 0)]
    trace = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    cfg = scripted_cfg(hbm_tokens=4 * 512, dram_tokens=2 * 512, nvme_tokens=16 * 512)
    r = run_scenario(trace, cfg, "nvme", policy)
    assert r["hit_tokens"] == {"hbm": 0, "dram": 0, "nvme": 512}  # read from NVMe either way (issue 14)
    if policy == "lookahead":
        assert r["nvme_wait_s"]["total"] == 0.0
        assert r["strict_dram_share"] == 1.0
    else:
        assert r["nvme_wait_s"]["total"] == pytest.approx(1.0)
        assert r["strict_dram_share"] == 0.0
    assert r["prefetch_tokens"]["started"] == 512


def test_integrity_is_checked_every_step(tmp_path, monkeypatch):
    calls = []
    real = Engine.check
    monkeypatch.setattr(Engine, "check", lambda self: (calls.append(self.clock()), real(self))[1])
    trace = load_trace(chat_trace(tmp_path))
    r = run_scenario(trace, ample(hbm_tokens=6 * BLOCK_TOKENS, dram_tokens=4 * BLOCK_TOKENS), "nvme", "lru")
    assert len(calls) == r["steps"] and r["steps"] >= 2 * 24  # at least an arrival and an end per request


def test_io_client_serves_each_channel_fifo():
    clock = SimClock()
    io = SimIOClient(clock, read_s_per_page=0.5, write_s_per_page=0.25)
    io.submit(LoadPages(1, [0, 1], [0, 1]))  # read channel: done at 1.0
    io.submit(LoadPages(2, [2], [2]))  # queued behind job 1: done at 1.5
    io.submit(StorePages(3, [3], [3]))  # write channel, independent: done at 0.25
    assert io.poll() == [] and io.next_done_s() == 0.25
    assert [d.job_id for d in io.wait(10.0)] == [3] and clock() == 0.25
    clock.advance_to(1.2)
    assert [(d.job_id, d.ok) for d in io.poll()] == [(1, [True, True])]
    assert io.in_flight() == {2}


def test_device_pool_hands_out_whole_pages_and_refuses_double_free():
    pool = SimDevicePool(num_tokens=10, page_size=4)  # 2 pages
    slots = pool.alloc(8)
    assert sorted(slots) == list(range(8)) and pool.alloc(4) is None
    pool.free(slots[4:])
    assert pool.available_size() == 4
    with pytest.raises(ValueError):
        pool.free(slots[4:])


def test_cli_writes_json_and_png(tmp_path, capsys):
    path = chat_trace(tmp_path)
    out = tmp_path / "out"
    assert main(["--trace", str(path), "--out-dir", str(out), "--jobs", "1", "--hbm-tokens", "4096"]) == 0
    summary = json.loads((out / "simulate.json").read_text())
    assert [r["scenario"] for r in summary["results"]] == [
        f"{t}/{p}" for t in ("hbm", "dram", "nvme") for p in ("lru", "lookahead", "predictive")
    ]
    assert summary["infinite"]["block_hit_rate"] == pytest.approx(47 / 72)
    assert (out / "simulate.png").stat().st_size > 0
    assert "infinite" in capsys.readouterr().out


def test_integrity_check_catches_a_leaked_hbm_slot(tmp_path):
    trace = load_trace(chat_trace(tmp_path))
    engine = Engine(trace[:3], ample(), "dram", "lru")
    engine.run()
    engine.check()  # balanced after the run
    assert engine.cache.device.alloc(engine.tree.page_size) is not None  # one page nobody owns
    with pytest.raises(IntegrityError, match="HBM"):
        engine.check()


def test_belady_and_lru_references_by_hand(tmp_path):
    # Pool of 2 blocks. Requests: [A], [B], [C], [A], [B, G], [C].
    #   LRU:    A, B, C (evicts A), A misses (evicts B), [B, G] misses, C misses: 0 hits.
    #   Belady: after C, the block used farthest ahead goes: C itself (next at #6; A at #4, B at
    #           #5). A hits, B hits; G (never used again) goes at once; C misses: 2 of 7 references.
    rows = [(0, [A], 0), (1, [B], 0), (2, [C], 0), (3, [A], 0), (4, [B, G], 0), (5, [C], 0)]
    trace = load_trace(write_trace(tmp_path / "t.jsonl", rows))
    assert lru_hit_rate(trace, 2) == 0.0
    assert belady_hit_rate(trace, 2) == pytest.approx(2 / 7)
    # prefix semantics: a block after a miss does not hit. [A, B] then [C, B]: B's id under C is
    # another block (ids encode their prefix), so nothing but what a request shares in front.
    rows = [(0, [A, B], 0), (1, [A, B], 0), (2, [D, F], 0), (3, [A, B], 0)]
    trace = load_trace(write_trace(tmp_path / "p.jsonl", rows))
    assert belady_hit_rate(trace, 2) == pytest.approx(4 / 8)  # [D, F] bypasses: A, B hit twice
    assert lru_hit_rate(trace, 2) == pytest.approx(2 / 8)  # [D, F] pushed A, B out
    assert belady_hit_rate(trace, 100) == lru_hit_rate(trace, 100) == infinite_hit_rates(trace, 512)["block_hit_rate"]


def test_sweep_writes_its_tables_json_and_png(tmp_path, capsys):
    path = chat_trace(tmp_path)
    out = tmp_path / "sweep"
    argv = ["--trace", str(path), "--out-dir", str(out), "--jobs", "1", "--sweep", "--fractions", "0.2,0.5",
            "--hbm-tokens", "2048", "--check-every-step"]
    assert main(argv) == 0
    summary = json.loads((out / "sweep.json").read_text())
    pts = summary["points"]
    # 25 distinct blocks: 20% = 5 blocks, 50% = 12 (DRAM 1/9 of it, at least one block)
    assert [p["tokens"] // BLOCK_TOKENS for p in pts] == [5, 12]
    assert [p["dram_tokens"] // BLOCK_TOKENS for p in pts] == [1, 1]
    for p in pts:
        assert set(p["results"]) == {"lru", "lookahead", "predictive"} and p["dram_only"]["tiers"] == "dram"
        assert p["lru_blocks"] <= p["belady"] <= summary["infinite"]["block_hit_rate"]
    assert {r["target"] for r in summary["targets"]} >= {"hit >= 90% of Belady", "NVMe worth >= 95%"}
    assert (out / "sweep.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "Belady" in printed and "targets (predictive)" in printed and "saved% pred" in printed
    for p in pts:  # no cost model: the time saved is the prefill of the hit tokens (of admitted requests)
        r = p["results"]["lru"]
        assert r["time_saved_s"] == pytest.approx(sum(r["hit_tokens"].values()) / SimConfig().prefill_tokens_per_s)


def test_dram_staging_serves_from_nvme_what_cache_mode_serves_from_dram(tmp_path):
    """Issue 14, --hiradix-dram-mode staging: DRAM only carries pages in flight, so a history the
    small HBM pushed down comes back from NVMe (never from a DRAM copy); nothing is lost."""
    trace = load_trace(chat_trace(tmp_path))
    small = dict(hbm_tokens=6 * BLOCK_TOKENS, dram_tokens=16 * BLOCK_TOKENS)  # DRAM holds some histories
    cache = run_scenario(trace, ample(**small), "nvme", "lru")
    staging = run_scenario(trace, ample(dram_staging=True, **small), "nvme", "lru")
    assert cache["hit_tokens"]["dram"] == 14 * BLOCK_TOKENS
    assert staging["hit_tokens"]["dram"] == 0 and staging["hit_tokens"]["nvme"] > cache["hit_tokens"]["nvme"]
    assert sum(staging["hit_tokens"].values()) == sum(cache["hit_tokens"].values())  # NVMe holds everything
    assert staging["bytes_moved"]["PREFETCH"] > cache["bytes_moved"]["PREFETCH"]


def test_selective_write_through_backs_up_only_what_is_hit_again(tmp_path):
    """HiCache's write_through_selective, for measurement: a turn's history is backed up only
    once hit again; with a small HBM most are evicted first and lost (bench/RESULTS.md)."""
    trace = load_trace(chat_trace(tmp_path))
    small = dict(hbm_tokens=6 * BLOCK_TOKENS, dram_tokens=4 * BLOCK_TOKENS)
    full = run_scenario(trace, ample(**small), "nvme", "lru")
    selective = run_scenario(trace, ample(write_selective=True, **small), "nvme", "lru")
    assert 0 < selective["bytes_moved"]["BACKUP"] < full["bytes_moved"]["BACKUP"]
    assert sum(selective["hit_tokens"].values()) < sum(full["hit_tokens"].values())


# ---------------------------------------------------------------- context overflow (issue 20, item 6)
def overflow_trace(tmp_path):
    """3 conversations behind the shared block 0 (the head); full 512-token blocks, no output; 10 s apart.

    X: [0,x1,x2] -> [0,x1..x4] -> [0,x1..x6] -> [0,x1..x7] -> [0,x1..x8]; Y: [0,y1] -> [0,y1..y3];
    Z: [0,z1..z6] -> [0,z1..z7]. Arrival order X1 Y1 Z1 X2 Y2 Z2 X3 X4 X5.
    """
    x = [0] + [100 + k for k in range(1, 9)]
    y = [0, 201, 202, 203]
    z = [0] + [300 + k for k in range(1, 8)]
    turns = [x[:3], y[:2], z[:7], x[:5], y[:4], z[:8], x[:7], x[:8], x[:9]]
    return write_trace(tmp_path / "overflow.jsonl", [(10.0 * i, ids, 0) for i, ids in enumerate(turns)])


@pytest.mark.parametrize("tier, policy", [("hbm", "lru"), ("dram", "lookahead"), ("nvme", "predictive")])
def test_context_overflow_hits_by_hand(tmp_path, tier, policy):
    # Context 5 blocks (2560 tokens), head = block 0, drop half of the rest in whole pages (at least the overflow).
    #   X1 [0,x1,x2]: miss (0)        Y1 [0,y1]: 0 hits (1)        Z1 [0,z1..z6] 7 > 5: drop z1..z3,
    #   sends [0,z4,z5,z6]: head hits (1), no source cached.        X2 [0,x1..x4] 5: hits [0,x1,x2] (3)
    #   Y2 [0,y1..y3]: (2)            Z2 = Z1's cut + z7 = [0,z4..z7] 5: a normal prefix of Z1's branch (4)
    #   X3 [0,x1..x6] 7 > 5: drop x1..x3, sends [0,x4,x5,x6]; recompute: head only (1);
    #      shift: head + x4, cached at its old position by X2 (2).
    #   X4 = [0,x4..x7] 5: X3's branch (4)    X5 = [0,x4..x8] 6 > 5: rest 5 blocks, drop 3 (x4..x6),
    #      sends [0,x7,x8]; recompute (1); shift: head + x7 from X4 (2).
    # Blocks sent: 3+2+4+5+4+5+4+5+3 = 35; hits 17 (recompute), 19 (shift); 3 cuts of 3 blocks.
    trace = load_trace(overflow_trace(tmp_path))
    out = {}
    for mode in ("recompute", "shift"):
        r = run_scenario(trace, ample(context_tokens=5 * BLOCK_TOKENS, context_overflow=mode), tier, policy)
        assert r["prompt_tokens"] == 35 * BLOCK_TOKENS and r["requests"] == 9 and r["rejected"] == 0
        assert r["overflow"]["overflowed_requests"] == 3 and r["overflow"]["dropped_tokens"] == 9 * BLOCK_TOKENS
        out[mode] = r
    assert sum(out["recompute"]["hit_tokens"].values()) == 17 * BLOCK_TOKENS
    assert out["recompute"]["overflow"]["shifted_tokens"] == 0
    assert out["shift"]["hit_tokens"] == {"hbm": 19 * BLOCK_TOKENS, "dram": 0, "nvme": 0}
    assert out["shift"]["overflow"]["shifted_tokens"] == 2 * BLOCK_TOKENS
    cuts = ConversationCuts(trace, ample(context_tokens=5 * BLOCK_TOKENS))
    assert cuts.head_blocks == 1 and cuts.continuing == 6  # X2..X5, Y2, Z2
    assert cuts.shift_bound_tokens() == 2 * BLOCK_TOKENS  # the ample cache shifts all it could
    # no cost model: time saved = hit tokens / prefill rate
    assert out["shift"]["time_saved_s"] - out["recompute"]["time_saved_s"] == pytest.approx(2 * BLOCK_TOKENS / 50_000)
    # unlimited context: X3..X5 and Z hit their whole history: 0+1+1+3+2+7+5+7+8 = 34 of 53 blocks
    ref = run_scenario(trace, ample(), tier, policy)
    assert ref["prompt_tokens"] == 53 * BLOCK_TOKENS and sum(ref["hit_tokens"].values()) == 34 * BLOCK_TOKENS
    assert "overflow" not in ref


@pytest.mark.parametrize("hbm_pages, shifted_blocks", [(6, 0), (7, 1)])
def test_context_shift_reuses_only_what_is_still_cached(tmp_path, hbm_pages, shifted_blocks):
    # A small HBM (LRU, no lower tier). 6 pages: Y2 and Z2 evict X2's [x1..x4] before X3 (nothing
    # to shift); at X5 the old path [0,x4..x7] (5 pages, locked while copied) plus the 2 new pages
    # do not fit, so X5 recomputes too: shift = recompute. 7 pages: X5's x7 is shifted.
    trace = load_trace(overflow_trace(tmp_path))
    small = dict(hbm_tokens=hbm_pages * BLOCK_TOKENS, context_tokens=5 * BLOCK_TOKENS)
    rec = run_scenario(trace, ample(context_overflow="recompute", **small), "hbm", "lru")
    shift = run_scenario(trace, ample(context_overflow="shift", **small), "hbm", "lru")
    assert shift["overflow"]["shifted_tokens"] == shifted_blocks * BLOCK_TOKENS
    assert sum(shift["hit_tokens"].values()) - sum(rec["hit_tokens"].values()) == shifted_blocks * BLOCK_TOKENS


@pytest.mark.parametrize("tier", ["hbm", "nvme"])
def test_a_context_nothing_reaches_changes_nothing(tmp_path, tier):
    trace = load_trace(chat_trace(tmp_path))
    small = dict(hbm_tokens=6 * BLOCK_TOKENS, dram_tokens=4 * BLOCK_TOKENS, cost_model=True)
    base = run_scenario(trace, ample(**small), tier, "lru")
    wide = run_scenario(trace, ample(context_tokens=1 << 20, context_overflow="shift", **small), tier, "lru")
    assert wide.pop("overflow") == {"overflowed_requests": 0, "dropped_tokens": 0, "shifted_tokens": 0, "too_long": 0,
                                    "context_tokens": 1 << 20, "mode": "shift"}
    for r in (base, wide):
        r.pop("wall_s")
    assert wide == base


def test_context_flags_and_too_long_prompts(tmp_path):
    from bench.sim.simulate import parse_args, sim_config_from_args

    cfg = sim_config_from_args(parse_args(["--context-tokens", "8192", "--context-overflow", "shift"]))
    assert (cfg.context_tokens, cfg.context_overflow, cfg.context_drop_ratio) == (8192, "shift", 0.5)
    assert sim_config_from_args(parse_args([])).context_tokens is None
    with pytest.raises(ValueError, match="recompute, shift"):
        SimConfig(context_overflow="noshift")
    # an output as long as the context leaves no room for any prompt: refused, counted
    trace = load_trace(write_trace(tmp_path / "t.jsonl", [(0, [0, 1], 2048), (1, [0, 2], 4)]))
    r = run_scenario(trace, ample(context_tokens=2048), "hbm", "lru")
    assert r["overflow"]["too_long"] == 1 and r["rejected"] == 1 and r["requests"] == 2


def test_overflow_report_prints_the_table_and_writes_json(tmp_path, capsys):
    from bench.sim import overflow_report

    argv = ["--trace", str(overflow_trace(tmp_path)), "--contexts", str(5 * BLOCK_TOKENS), "--dram-tokens", "32768",
            "--hbm-tokens", "32768", "--out-dir", str(tmp_path / "out")]
    assert overflow_report.main(argv) == 0
    rows = json.loads((tmp_path / "out" / "overflow.json").read_text())["rows"]
    assert [(r["context_tokens"], r["mode"]) for r in rows] == [(None, "unlimited"), (2560, "recompute"), (2560, "shift")]
    assert [r["prefill_tokens"] // BLOCK_TOKENS for r in rows] == [53 - 34, 35 - 17, 35 - 19]  # as by hand above
    assert "| 0.032768 M | 2,560 | shift | 3 (33.3%)" in capsys.readouterr().out


def test_cold_format_at_the_same_bytes_holds_more_pages_and_exact_changes_nothing(tmp_path):
    """Issue 21: a format with half the bytes per token holds twice the pages in the same NVMe bytes and
    reads each page in half the time; ``exact`` (with codec rates set, which it ignores) gives the
    simulator's figures without the option, field for field."""
    from bench.sim.cold_tier import codec_bytes_ratio, nvme_read_s_per_page, nvme_slots, nvme_source_read_bytes_per_s

    trace = load_trace(chat_trace(tmp_path))
    small = dict(hbm_tokens=6 * BLOCK_TOKENS, dram_tokens=2 * BLOCK_TOKENS, nvme_tokens=5 * BLOCK_TOKENS)
    exact = ample(cold_format="exact", cold_decode_bytes_per_s=1e6, cold_encode_bytes_per_s=1e6, **small)
    half = ample(cold_format="fp8", cold_bytes_ratio=0.5, **small)
    assert (nvme_slots(exact), nvme_slots(half)) == (5, 10)
    assert nvme_read_s_per_page(half) == pytest.approx(nvme_read_s_per_page(exact) / 2)
    assert nvme_source_read_bytes_per_s(half) == pytest.approx(2 * exact.nvme_read_bytes_per_s)
    # the codec's own ratio for Llama-3-8B 16-bit pages of 512 tokens: fp8 ~1/2, int4 ~0.27 (3.7x)
    assert 0.5 < codec_bytes_ratio("fp8", 512) < 0.501 and 0.26 < codec_bytes_ratio("int4", 512) < 0.28
    for policy in ("lru", "lookahead"):
        today = run_scenario(trace, ample(**small), "nvme", policy)
        same = run_scenario(trace, exact, "nvme", policy)
        for r in (today, same):
            r.pop("wall_s")
        assert same == today
        halved = run_scenario(trace, half, "nvme", policy)
        assert sum(halved["hit_tokens"].values()) > sum(today["hit_tokens"].values())  # 10 pages hold more histories
    with pytest.raises(ValueError, match="exact, fp8, int4"):
        SimConfig(cold_format="fp4")


def test_format_sweep_prints_one_row_per_point_and_format(tmp_path, capsys):
    path = chat_trace(tmp_path)
    out = tmp_path / "formats"
    argv = ["--trace", str(path), "--out-dir", str(out), "--jobs", "1", "--sweep", "--fractions", "0.2",
            "--cold-formats", "exact,fp8", "--cold-bytes-ratio", "0.5", "--policies", "lru", "--hbm-tokens", "3072",
            "--cost-model"]
    assert main(argv) == 0
    summary = json.loads((out / "formats.json").read_text())
    (pt,) = summary["points"]
    exact, fp8 = pt["formats"]["exact"], pt["formats"]["fp8"]
    assert (exact["nvme_slots"], fp8["nvme_slots"]) == (4, 8)  # 5 blocks: DRAM 1, NVMe 4 (8 at half the bytes)
    assert fp8["results"]["lru"]["block_hit_rate"] >= exact["results"]["lru"]["block_hit_rate"]
    printed = capsys.readouterr().out
    assert "blk% lru" in printed and "saved% lru" in printed and printed.count("fp8") >= 1
