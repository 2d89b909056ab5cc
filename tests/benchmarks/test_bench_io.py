"""Smoke test of ``bench/micro/tier_io.py``: the tiny shape, two rounds, every field of the JSON present and positive.

Checks that the benchmark runs end to end (raw baseline, NvmeStore, a real I/O worker process,
DRAM copies, pings) and writes its files; it measures nothing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import bench.micro.tier_io as bench_io
from tests.helpers.store import requires_mooncake

NVME_FIELDS = ("bytes", "median_s", "best_s", "median_gbps", "best_gbps", "ratio_median", "ratio_best")
PINGS = 10
REPEATS = 2


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_bench_io_tiny_run_writes_complete_json(tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    argv = ["--shapes", "tiny", "--repeats", str(REPEATS), "--pings", str(PINGS), "--prefault-bounce",
            "--dir", str(tmp_path / "disk"), "--out", str(out_dir)]  # fmt: skip
    result = bench_io.main(argv)

    # the files: JSON equal to the returned result, a non-empty PNG
    assert json.loads((out_dir / "io.json").read_text()) == json.loads(json.dumps(result))
    assert (out_dir / "io.png").stat().st_size > 0

    # NVMe: every variant, both ops, positive timings and ratios; the baseline's ratio is 1
    variants = {"raw", "raw-slot", "store", "store+pop", "worker", "jobs"}
    assert {(r["op"], r["variant"]) for r in result["nvme"]} == {(op, v) for op in ("write", "read") for v in variants}
    for row in result["nvme"]:
        assert all(positive(row[field]) for field in NVME_FIELDS), row
        assert len(row["samples_s"]) == REPEATS and all(map(positive, row["samples_s"]))
        assert row["device_requests_median"] >= 0  # 0 where the directory is on no block device
        if row["variant"] == "raw":
            assert row["ratio_median"] == row["ratio_best"] == 1.0
        if row["variant"] == "worker":
            assert "outside_job_ms_median" in row

    # DRAM copies and the layer-wise load
    assert {r["op"] for r in result["dram"]} == {"memcpy", "store", "load"}
    for row in result["dram"]:
        assert all(positive(row[field]) for field in NVME_FIELDS), row
    assert positive(next(r for r in result["dram"] if r["op"] == "load")["per_layer_us_median"])

    # ZMQ round trips: PINGS per measured round
    zmq = result["zmq"]
    assert zmq["count"] == len(zmq["samples_us"]) == PINGS * REPEATS
    assert all(positive(zmq[k]) for k in ("median_us", "p99_us", "min_us", "max_us"))
    assert zmq["min_us"] <= zmq["median_us"] <= zmq["p99_us"] <= zmq["max_us"]

    # the verdict and the record of the machine
    checks = result["read_target"]["checks"]
    assert {c["variant"] for c in checks} == variants - {"raw", "raw-slot"}
    assert result["read_target"]["met"] == all(c["met"] for c in checks)
    meta = result["meta"]
    assert positive(meta["nproc"]) and positive(meta["mem_total_gib"])
    assert meta["file_system"]["fstype"] and meta["command"].endswith(" ".join(argv))


def test_cold_io_tiny_run_covers_every_format_through_the_worker(tmp_path: Path) -> None:
    """``bench/micro/cold_io.py`` (issue 21): one worker per format; every (format, op, variant) timed,
    the disk page of a lossy format smaller than the source page, exact's own ratio 1."""
    import bench.micro.cold_io as cold_io

    out_dir = tmp_path / "out"
    result = cold_io.main(["--shapes", "tiny", "--repeats", "1", "--dir", str(tmp_path / "disk"), "--out", str(out_dir)])
    assert json.loads((out_dir / "cold_io.json").read_text()) == json.loads(json.dumps(result))
    rows = result["rows"]
    assert {(r["format"], r["op"], r["variant"]) for r in rows} == {
        (f, op, v) for f in ("exact", "fp8", "int4") for op in ("write", "read") for v in ("worker", "jobs")}
    page = {r["format"]: r["encoded_page_bytes"] for r in rows}
    assert page["exact"] == 512 and page["fp8"] < page["int4"] < 512  # tiny: 2 layers x K,V x 4 tokens x 2 heads x 8, bf16
    for r in rows:
        assert positive(r["tokens_per_s_median"]) and r["tokens"] == 16 * 4
        assert r["vs_exact"] == (1.0 if r["format"] == "exact" else r["vs_exact"]) and positive(r["vs_exact"])


@requires_mooncake
def test_cold_io_store_tier_reads_back_what_each_format_put(tmp_path: Path) -> None:
    """``--tiers store``: the worker puts every format's encoded pages into a real loopback Mooncake
    Store under fresh keys and gets them back (a failed job raises); the store row counts the
    encoded bytes."""
    import bench.micro.cold_io as cold_io

    out_dir = tmp_path / "out"
    result = cold_io.main(["--shapes", "tiny", "--repeats", "1", "--tiers", "store", "--dir", str(tmp_path / "disk"),
                           "--out", str(out_dir)])  # fmt: skip
    rows = result["rows"]
    assert {(r["tier"], r["format"], r["op"], r["variant"]) for r in rows} == {
        ("store", f, op, v) for f in ("exact", "fp8", "int4") for op in ("write", "read") for v in ("worker", "jobs")}
    for r in rows:
        assert r["disk_bytes"] == 16 * r["encoded_page_bytes"] and positive(r["tokens_per_s_median"])
    assert not list((tmp_path / "disk").glob("hiradix-coldio-*"))  # temporary NVMe files removed
