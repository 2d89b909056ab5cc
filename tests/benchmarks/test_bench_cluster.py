"""Tests of bench/cluster/run.py (two servers behind a client-side router) and its report.

Fast tests check the router, the cell plan, the `ideal` hits, the storage split, the bootstrap,
the table, the targets and the files on hand-made records; the `e2e` test runs one `--quick`
cell for real (two hiradix servers + a Mooncake store on loopback, models/tiny, ~1.5 minutes).
"""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import psutil
import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # bench/ is a plain directory at the repo root
    sys.path.insert(0, str(REPO_ROOT))

from bench.cluster import report as cluster_report
from bench.cluster import run as cluster  # noqa: E402
from bench.common.conversations import Session  # noqa: E402
from hiradix.testing.mooncake import MooncakeCluster  # noqa: E402
from tests.helpers.store import requires_mooncake  # noqa: E402

# ---------------------------------------------------------------- router, plan, ideal


def test_sticky_keeps_a_session_on_one_server_and_round_robin_moves_every_turn():
    for s in range(6):
        assert {cluster.route("sticky", s, t, 2, 0) for t in range(5)} == {s % 2}
        servers = [cluster.route("round-robin", s, t, 2, 0) for t in range(5)]
        assert all(a != b for a, b in zip(servers, servers[1:]))
    assert {cluster.route("round-robin", 0, t, 3, 0) for t in range(3)} == {0, 1, 2}


def test_random_routing_is_seeded_uses_both_servers_and_moves_about_half_the_turns():
    choices = [[cluster.route("random", s, t, 2, 7) for t in range(8)] for s in range(50)]
    assert choices == [[cluster.route("random", s, t, 2, 7) for t in range(8)] for s in range(50)]
    assert choices != [[cluster.route("random", s, t, 2, 8) for t in range(8)] for s in range(50)]
    moves = sum(a != b for row in choices for a, b in zip(row, row[1:]))
    assert 0.35 < moves / (50 * 7) < 0.65
    # a str seed is hashed with SHA-512, not Python's per-process hash: fixed across runs
    assert [cluster.route("random", 0, t, 2, 0) for t in range(8)] == [1, 0, 1, 0, 0, 0, 0, 1]


def test_unknown_routing_and_no_servers_are_refused():
    with pytest.raises(ValueError, match="unknown routing"):
        cluster.route("least-loaded", 0, 0, 2, 0)
    with pytest.raises(ValueError, match="num_servers"):
        cluster.route("sticky", 0, 0, 0, 0)


def test_cell_plan_puts_the_aa_first_and_rotates_systems_and_routings():
    cells = cluster.plan_cells(cluster.SYSTEMS, cluster.ROUTINGS, repeats=2, aa=True)
    assert (cells[0].system, cells[0].routing) == ("stock-aa", "sticky")
    assert [c.index for c in cells] == list(range(len(cells))) and len(cells) == 1 + 2 * 9
    for r in range(2):
        pairs = [(c.system, c.routing) for c in cells if c.repeat == r and c.system != "stock-aa"]
        assert sorted(pairs) == sorted((s, rt) for s in cluster.SYSTEMS for rt in cluster.ROUTINGS)
    body = cells[1:10]
    firsts = {body[i].system for i in (0, 3, 6)}  # the first system of each routing's block
    assert firsts == set(cluster.SYSTEMS)
    assert cells[1].routing != cells[10].routing  # the second repeat starts with another routing
    assert cluster.plan_cells(["hiradix"], ["random"], 1, aa=False) == [cluster.Cell(0, "hiradix", "random", 0)]


def test_workload_order_is_turn_major():
    sessions = [Session(f"s{i}", tuple({"role": "user", "content": "x"} for _ in range(3)), "synthetic")
                for i in range(3)]  # fmt: skip
    assert cluster.workload_order(sessions) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_ideal_hits_are_whole_pages_of_the_longest_earlier_prefix_below_the_last_token():
    base = list(range(100, 140))  # 40 tokens
    prompts = {
        (0, 0): base,
        (1, 0): base[:20] + [1, 2, 3],  # shares 20 with (0, 0): one page of 16
        (0, 1): base + [7] * 10,  # all of (0, 0): 40 -> 32
        (1, 1): base[:32],  # 32 shared, but the last token is computed: 31 -> 16
        (2, 0): [9] * 40,  # nothing shared
    }
    order = [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1)]
    ideal = cluster.ideal_cached_tokens(prompts, order, page_tokens=16)
    assert ideal == {(0, 0): 0, (1, 0): 16, (2, 0): 0, (0, 1): 32, (1, 1): 16}


def test_a_prompt_that_cannot_fit_the_pool_is_refused_naming_the_flag():
    cluster.check_fits({(0, 0): [1] * 100}, max_total_tokens=128, max_tokens=8)
    with pytest.raises(ValueError, match="--max-total-tokens 120"):
        cluster.check_fits({(0, 0): [1] * 10, (3, 2): [1] * 100}, max_total_tokens=120, max_tokens=8)


def test_systems_get_the_same_pool_and_dram_bytes(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 256, "num_attention_heads": 4,
                                                   "num_key_value_heads": 2, "num_hidden_layers": 2}))  # fmt: skip
    settings = cluster.BenchSettings(model, (), cluster.WorkloadConfig(), 1024, 2.0, 0.5, 16 << 20, 0, tmp_path, 60)
    store = MooncakeCluster(num_holders=1, holder_segment_bytes=16 << 20, log_dir=tmp_path / "store")  # not started
    flags = {name: cluster.system_launch(name, store if name != "stock" else None, settings, tmp_path, 0)
             for name in ("stock", "hicache", "hiradix")}  # fmt: skip
    for args, _ in flags.values():
        assert args[args.index("--max-total-tokens") + 1] == "1024" and args[args.index("--page-size") + 1] == "16"
    stock, hicache, hiradix = (flags[n][0] for n in ("stock", "hicache", "hiradix"))
    assert not any(a.startswith(("--hicache", "--hiradix", "--enable-hi")) for a in stock)
    assert hicache[hicache.index("--hicache-ratio") + 1] == "2.0"
    # the same ratio of the same 1024-token device pool as HiCache's host pool: the same DRAM bytes
    assert hiradix[hiradix.index("--hiradix-dram-ratio") + 1] == "2" and "--hiradix-dram-gb" not in hiradix
    assert store.master_address in hicache[hicache.index("--hicache-storage-backend-extra-config") + 1]
    assert json.loads(hiradix[hiradix.index("--hiradix-store-config") + 1])["master_server_address"] == store.master_address
    assert flags["hicache"][1]["SGLANG_HICACHE_MOONCAKE_REUSE_TE"] == "0"
    other, _ = cluster.system_launch("hiradix", store, settings, tmp_path, 1)
    assert hiradix[hiradix.index("--hiradix-nvme-path") + 1] != other[other.index("--hiradix-nvme-path") + 1]


def test_options_quick_defaults_and_refusals():
    args = cluster.parse_args(["--quick"])
    assert args.model == "models/tiny" and args.sessions == 4 and args.systems == list(cluster.SYSTEMS)
    assert cluster.parse_args([]).model == "models/small"
    assert cluster.parse_args(["--routings", "sticky,random"]).routings == ["sticky", "random"]
    for bad in (["--systems", "stock,vllm"], ["--routings", "sticky,sticky"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            cluster.parse_args(bad)


# ---------------------------------------------------------------- report


def test_storage_hits_split_into_nvme_and_store():
    split = cluster_report.split_storage
    assert split(272, "nvme=32,mooncake=240") == (32, 240)
    assert split(16, "nvme=16") == (16, 0)
    assert split(320, "MooncakeStore") == (0, 320)  # SGLang HiCache's L3 label
    assert split(48, None) == (0, 48)
    assert split(None, None) == (None, None)


def test_bootstrap_interval_brackets_the_median_and_is_seeded():
    values = [1.0, 2.0, 2.5, 3.0, 10.0, 2.2, 2.8]
    lo, hi = cluster_report.bootstrap_ci(values)
    assert lo <= 2.5 <= hi and (lo, hi) == cluster_report.bootstrap_ci(values)
    assert all(math.isnan(x) for x in cluster_report.bootstrap_ci([]))
    ratio, rlo, rhi = cluster_report.ratio_ci([2.0] * 9, [1.0] * 9)
    assert ratio == rlo == rhi == 2.0


def _record(system, routing, s, t, prompt, cached, *, device=0, host=0, store=0, ideal=0, ttft=1.0, out=(1, 2)):
    r = cluster.ClusterRecord(system, f"s{s}", s, t, routing=routing, ideal_cached_tokens=ideal)
    r.prompt_tokens, r.cached_tokens, r.ttft_s, r.completion_tokens = prompt, cached, ttft, len(out)
    r.cached_device_tokens, r.cached_host_tokens, r.cached_storage_tokens = device, host, store
    r.cached_nvme_tokens, r.cached_store_tokens = 0, store
    r.output_token_ids = list(out)
    return r


def _run(system, routing, records, index=0):
    return cluster.CellRun(cluster.Cell(index, system, routing, 0), records, [1.0, 1.0], 2.0, None)


def _runs():
    def cell(system, routing, cached, store, ttft, out=(1, 2)):
        return _run(system, routing, [_record(system, routing, 0, 0, 50, 0, ttft=ttft),
                                      _record(system, routing, 0, 1, 100, cached, store=store, ideal=96,
                                              device=cached - store, ttft=ttft, out=out)])  # fmt: skip
    return [cell("stock-aa", "sticky", 64, 0, 1.1), cell("stock", "sticky", 64, 0, 1.0),
            cell("hiradix", "sticky", 96, 0, 0.5), cell("hiradix", "random", 88, 80, 0.6, out=(1, 3)),
            cell("hicache", "random", 48, 48, 0.8), cell("stock", "random", 16, 0, 1.2)]  # fmt: skip


def test_report_figures_per_cell_and_targets():
    report = cluster_report.build_report(_runs())
    cells = {(c["system"], c["routing"]): c for c in report["cells"]}
    rand = cells[("hiradix", "random")]
    assert rand["prompt_tokens"] == 150 and rand["cached_tokens"] == 88 and rand["prefill_tokens"] == 62
    assert rand["tier_tokens"] == {"device": 8, "host": 0, "nvme": 0, "store": 80}
    assert rand["hit_share"] == pytest.approx(88 / 150) and rand["hit_of_ideal"] == pytest.approx(88 / 96)
    assert rand["identical_to_stock_sticky"] == [1, 2]  # turn 1 answered (1, 3)
    assert rand["ttft_ratio_to_stock"] == pytest.approx(0.6 / 1.2)  # stock with the same routing
    assert cells[("stock-aa", "sticky")]["ttft_ratio_to_stock"] == pytest.approx(1.1)  # the A/A: vs stock sticky
    assert [(c["routing"], c["system"]) for c in report["cells"]][:3] == [
        ("random", "stock"), ("random", "hicache"), ("random", "hiradix")]
    met = {t["target"]: t["met"] for t in report["targets"]}
    assert list(met.values()) == [True, True]  # 88 >= 0.9 x 96, and 88 > 48
    missed = cluster_report.build_report([_run("hiradix", "sticky", _runs()[2].records),
                                          _run("hiradix", "random", [_record("hiradix", "random", 0, 1, 100, 80)]),
                                          _run("hicache", "random", [_record("hicache", "random", 0, 1, 100, 80)])])  # fmt: skip
    assert [t["met"] for t in missed["targets"]] == [False, False]  # 80 < 86.4; 80 is not above 80
    text = cluster_report.format_report(report)
    assert "hiradix   random" in text and "MET" in text and "MISSED" not in text


def test_outputs_are_written_with_every_record_and_field(tmp_path):
    runs = _runs()
    report = cluster_report.build_report(runs)
    cluster_report.write_outputs(runs, report, tmp_path, {"quick": True})
    rows = json.loads((tmp_path / "records.json").read_text())
    assert len(rows) == 12 and {"routing", "server_index", "cached_store_tokens", "ideal_cached_tokens"} <= set(rows[0])
    with open(tmp_path / "records.csv") as f:
        assert len(list(csv.DictReader(f))) == 12
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert len(summary["cells"]) == 6 and len(summary["cell_runs"]) == 6 and len(summary["targets"]) == 2
    for png in ("cluster_hits.png", "cluster_ttft.png"):
        assert (tmp_path / png).stat().st_size > 10_000


# ---------------------------------------------------------------- end to end


@pytest.mark.e2e
@requires_mooncake
@pytest.mark.timeout(900)
def test_e2e_quick_round_robin_cell_hits_through_the_store(tiny_model, tmp_path, capsys):
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. the session's servers
    code = cluster.main(["--quick", "--systems", "hiradix", "--routings", "round-robin", "--model", str(tiny_model),
                         "--out-dir", str(tmp_path)])  # fmt: skip
    assert code == 0
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert left == []  # servers, master, holder: all stopped
    rows = json.loads((tmp_path / "records.json").read_text())
    assert len(rows) == 4 * 3 and all(r["error"] is None for r in rows)
    assert [(r["session_index"], r["turn_index"]) for r in rows] == [(s, t) for t in range(3) for s in range(4)]
    assert all(r["server_index"] == cluster.route("round-robin", r["session_index"], r["turn_index"], 2, 0)
               for r in rows)  # fmt: skip
    later = [r for r in rows if r["turn_index"] >= 1]
    # every later turn runs on the server that did not compute the turn before: its history is in the store
    assert sum(r["cached_store_tokens"] or 0 for r in later) >= 0.8 * sum(r["ideal_cached_tokens"] for r in later)
    assert sum(r["cached_tokens"] for r in later) >= 0.9 * sum(r["ideal_cached_tokens"] for r in later) > 0
    assert all("mooncake=" in (r["cached_storage_backend"] or "") for r in later if r["cached_store_tokens"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    (cell,) = summary["cells"]
    assert (cell["system"], cell["routing"], cell["requests"], cell["errors"]) == ("hiradix", "round-robin", 12, 0)
    assert cell["store_keys"][0] > 0 and summary["targets"] == []
    assert (tmp_path / "cluster_hits.png").stat().st_size > 10_000
    assert "a smoke run" in capsys.readouterr().out
