"""scripts/gpu_check on a CPU machine: argument parsing, offline install, skip paths, JSON output.

The CPU run (``--allow-cpu --quick``) executes every check's code path with tiny sizes: the
three DRAM -> HBM paths of ``hiradix.dataplane.device_copy`` through ``HostMover`` and the
layer-wise loader, the async HBM -> DRAM store, ``NvmeStore.read_slots_to_device`` on its POSIX
path, and the torch reference of the attention check. The figures it writes are not GPU
figures; the GPU test at the end runs the real thing when a CUDA device is present.
"""

from __future__ import annotations

import importlib.util
import io
import json
import subprocess
import sys
import tarfile
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "gpu_check"
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def gc():
    """The script, imported as a module (it has no .py suffix)."""
    loader = SourceFileLoader("gpu_check_under_test", str(SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def test_cli(gc):
    args = gc.parse_args(["--out", "/tmp/x"])
    assert args.checks.split(",") == list(gc.CHECKS)
    assert args.budget_s < 480  # the whole script must finish inside an 8-minute device run
    with pytest.raises(SystemExit):
        gc.parse_args(["--out", "/tmp/x", "--checks", "layerwise,bogus"])
    with pytest.raises(SystemExit):
        gc.parse_args([])  # --out is required


def test_flashinfer_trim_keeps_what_the_attention_jit_needs(gc):
    keep = gc._keep_flashinfer_member
    assert gc.parse_args(["--prepare-wheels", "/tmp/w"]).prepare_wheels == "/tmp/w"  # no --out needed
    for name in ("flashinfer/decode.py", "flashinfer/data/csrc/batch_decode.cu",
                 "flashinfer/data/csrc/batch_prefill_paged_kernel_inst.jinja", "flashinfer/data/include/flashinfer/page.cuh",
                 "flashinfer/data/cutlass/include/cute/tensor.hpp", "flashinfer_python-0.7.2.post1.dist-info/METADATA"):
        assert keep(name), name
    for name in ("flashinfer/data/csrc/kda/kernel.cu", "flashinfer/experimental/x/csrc/k.cu", "b12x/__init__.py"):
        assert not keep(name), name


def test_pick_disk_dir_takes_the_explicit_dir(gc, tmp_path):
    base, seen = gc.pick_disk_dir(str(tmp_path), 1 << 20)
    assert base == tmp_path
    assert seen["chosen_reason"] == "explicit"
    assert "fstype" in seen["candidates"][str(tmp_path)]


def test_rates_of_a_slow_run_stay_above_zero_and_shares_divide(gc):
    # a loaded machine's dry run read 0.56 MB in > 0.1 s: GB/s rounded to 2 decimals was 0.0 and
    # the NVMe check's share of the raw read divided by zero (the check failed)
    common = sys.modules["gpu_checks.common"]
    assert common._gbps(0.56e6, 0.2) == 0.0028 and common._gbps(2e9, 1.0) == 2.0
    assert common._gbps(1.0, 3.0) == 3.33e-10


@pytest.mark.skipif(CUDA, reason="checks the no-GPU skip path")
@pytest.mark.parametrize("name", ["layerwise", "nvme", "mla", "flashinfer"])
def test_checks_skip_cleanly_without_cuda(gc, tmp_path, name):
    ctx = gc.Ctx(name, tmp_path / f"{name}.json", deadline=1e18, quick=True, allow_cpu=False, opts={})
    getattr(gc, f"check_{name}")(ctx)
    assert ctx.result["status"] == "skipped"
    assert "CUDA" in ctx.result["reason"]


@pytest.mark.parametrize("gpus", [0, 1])
def test_dp_check_needs_two_gpus(gc, tmp_path, monkeypatch, gpus):
    dp = sys.modules["gpu_checks.dp"]
    monkeypatch.setattr(dp, "_gpu_count", lambda: gpus)
    ctx = gc.Ctx("dp", tmp_path / "dp.json", deadline=1e18, quick=True, allow_cpu=True, opts={})
    gc.check_dp(ctx)
    assert ctx.result["status"] == "skipped"
    assert ctx.result["reason"] == f"needs 2 GPUs (TP 2 x DP 2); {gpus} visible"
    assert ctx.result["reason"].startswith(gc.NEEDS_GPUS_REASON)


def test_dp_check_skips_without_sglang(gc, tmp_path, monkeypatch):
    dp = sys.modules["gpu_checks.dp"]
    monkeypatch.setattr(dp, "_gpu_count", lambda: 2)
    monkeypatch.setattr(dp, "_probe_sglang", lambda env: {"ok": False, "error": "No module named 'sglang'"})
    ctx = gc.Ctx("dp", tmp_path / "dp.json", deadline=1e18, quick=True, allow_cpu=True, opts={})
    gc.check_dp(ctx)
    assert ctx.result["status"] == "skipped"
    assert ctx.result["reason"] == "SGLang is not importable on this machine: No module named 'sglang'"


def test_layer_done_counter_stand_in_when_sglang_is_missing(gc, monkeypatch):
    for name in ("sglang", "sglang.srt", "sglang.srt.managers", "sglang.srt.managers.cache_controller"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails; restored after the test
    where = gc.ensure_layer_done_counter()
    assert where.startswith("stand-in")
    from sglang.srt.managers.cache_controller import LayerDoneCounter

    assert LayerDoneCounter is gc._LayerDoneCounter


def _tarball(path: Path) -> None:
    """A tiny package as a .tar.gz, the form the trimmed FlashInfer travels in."""
    data = b"VALUE = 42\n"
    with tarfile.open(path, "w:gz") as tf:
        info = tarfile.TarInfo("gc_probe_pkg/__init__.py")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))


def _whole(check: dict) -> str:
    """A check's whole result for an assertion message (pytest cuts a dict short of a failed
    method's ``reason``)."""
    return json.dumps(check, default=str)[:6000]


def _run(tmp_path: Path, *extra: str) -> dict:
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _tarball(wheels / "gc_probe_pkg.tar.gz")
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--wheels", str(wheels), "--site", str(tmp_path / "site"),
           "--out", str(out), "--budget-s", "300", "--nvme-dir", str(tmp_path), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "gpu_check.log").stat().st_size > 0
    results = json.loads((out / "results.json").read_text())
    assert results["install"]["status"] == "ok", results["install"]
    assert (tmp_path / "site" / "gc_probe_pkg" / "__init__.py").exists()
    assert results["summary"] and results["finished_utc"]
    return results


@pytest.mark.skipif(CUDA, reason="the CPU dry run; the GPU run is test_gpu_check_on_gpu")
def test_cpu_dry_run_exercises_every_check(tmp_path):
    results = _run(tmp_path, "--allow-cpu", "--quick")
    checks = results["checks"]
    assert set(checks) == {"layerwise", "nvme", "mla", "cold", "flashinfer", "dp"}
    assert checks["dp"]["status"] == "skipped" and checks["dp"]["reason"] == "needs 2 GPUs (TP 2 x DP 2); 0 visible"
    mla = checks["mla"]
    assert mla["status"] == "ok", _whole(mla)
    assert mla["layout"]["row"] == 576 and mla["layout"]["layer_page_bytes"] == 16 * 576 * 2
    for path in ("gather", "runs", "host"):
        assert mla["load_paths"][path]["status"] == "ok" and mla["load_paths"][path]["verified_bit_exact"], path
        assert mla["load_paths"][path]["load_GBps"] > 0
    assert mla["attention"]["torch_fp32_vs_fp64_rel_err"] < 1e-2
    assert mla["attention"]["flashinfer"] == {"status": "skipped", "reason": "no CUDA device"}
    cold = checks["cold"]
    assert cold["status"] == "ok", _whole(cold)
    for fmt, ratio in (("fp8", 1.9), ("int4", 2.5)):  # bf16 pages of 16 tokens
        assert cold[fmt]["codec"]["ratio"] > ratio and cold[fmt]["codec"]["device_cpu_identical_byte_share"] == 1.0
        mover = cold[fmt]["mover"]
        assert mover["path"] == "decode" and mover["promote_done"] and mover["within_bound"], mover
        assert 0 < mover["max_rel_err"] and mover["pcie_bytes"] * ratio < cold["exact_mover"]["pcie_bytes"]
    assert cold["exact_mover"]["within_bound"] and cold["exact_mover"]["max_rel_err"] == 0.0
    lw = checks["layerwise"]
    assert lw["status"] == "ok", _whole(lw)
    assert set(lw["variants"]) == {"gather_pinned", "runs_pinned", "host_pageable", "limit_memcpy_pinned"}
    for name, v in lw["variants"].items():
        assert v["status"] == "ok" and v["verified_bit_exact"], (name, v)
        for key in ("load_alone_ms", "load_GBps", "overlapped_ms", "exposed_load_ms", "exposed_share_of_load",
                    "ideal_exposed_share", "share_of_memcpy_GBps"):
            assert isinstance(v[key], float), (name, key)
        if name != "limit_memcpy_pinned":
            assert v["verified_after_overlap"], name
    assert lw["variants"]["limit_memcpy_pinned"]["share_of_memcpy_GBps"] == 1.0
    assert [lw["variants"][n]["path"] for n in ("gather_pinned", "runs_pinned", "host_pageable")] == [
        "gather", "runs", "host"]
    assert lw["auto_path"]["path"] == "host" and lw["pinned"] is False
    assert lw["store"]["status"] == "ok" and lw["store"]["d2h_copies"] >= 1
    nv = checks["nvme"]
    assert nv["status"] == "ok", _whole(nv)
    assert nv["write"]["ok"]
    assert nv["auto_device_read_path"]["path"] == "posix"
    methods = nv["methods"]
    assert methods["raw_posix_read"]["status"] == "ok" and methods["raw_posix_read"]["bytes"] > 0
    assert methods["store_to_device_posix"]["verified"]
    assert methods["store_to_device_posix"]["raw_limit"] == "raw_posix_read"
    assert methods["store_to_device_kvikio"]["status"] == "skipped"
    assert methods["raw_kvikio_to_gpu"]["status"] == "skipped"
    fl = checks["flashinfer"]
    assert fl["status"] == "ok", _whole(fl)
    for trial in fl["torch_reference"]["trials"]:
        assert trial["pages_loaded_bit_exact"]
        assert trial["fp64_from_pool_vs_fp64_from_dram_max_rel_err"] == 0.0
        assert trial["torch_sdpa_bf16_vs_fp64_max_rel_err"] < 1e-2
    assert fl["flashinfer"] == {"status": "skipped", "reason": "no CUDA device"}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_check_on_gpu(tmp_path):
    results = _run(tmp_path, "--quick", "--checks", "layerwise,nvme")
    lw = results["checks"]["layerwise"]
    assert lw["status"] == "ok", lw
    assert lw["pinned"] and lw["unpinned_at_close"], lw.get("pin_failure")
    assert lw["auto_path"]["path"] in ("gather", "runs")
    for name in ("gather_pinned", "runs_pinned", "host_pageable"):
        v = lw["variants"][name]
        assert v["status"] == "ok" and v["verified_bit_exact"] and v["verified_after_overlap"], (name, v)
    methods = results["checks"]["nvme"]["methods"]
    assert methods["store_to_device_posix"]["verified"]
    assert methods["store_to_device_kvikio"].get("verified", True)  # skipped where kvikio is missing
