"""scripts/gpu_check: the GPU checks of hiradix, for a machine with one NVIDIA GPU.

Usage::

    scripts/gpu_check --wheels .whl --out "$OUT"        # on the GPU machine
    scripts/gpu_check --out /tmp/x --allow-cpu --quick  # CPU dry run, tiny sizes
    scripts/gpu_check --prepare-wheels .whl             # once, where PyPI is reachable (~20 MB)

Installs what the machine lacks offline from ``--wheels`` (``pip install --no-index --no-deps
--target``; ``*.tar.xz``/``*.tar.gz`` there are unpacked into the same target, e.g. a trimmed
FlashInfer), imports hiradix from this checkout, runs six independent checks, each in its own
process with its own time budget (skipped, with the reason, when too little time is left), and
writes ``results.json`` (every figure) and ``gpu_check.log`` into ``--out``:

1. ``layerwise`` (:mod:`gpu_checks.layerwise`): DRAM -> HBM per layer on a side stream,
   overlapped with a Llama-3-8B-sized forward: exposed load time as a share of the load time,
   and H2D GB/s against a plain pinned ``cudaMemcpyAsync`` of the same bytes, for each path of
   ``hiradix.dataplane.device_copy``; HBM -> DRAM stores against one D2H copy.
2. ``nvme`` (:mod:`gpu_checks.nvme`): ``NvmeStore.read_slots_to_device`` (KvikIO/GDS and
   POSIX) against raw reads of the same bytes.
3. ``mla`` (:mod:`gpu_checks.mla`): MLA latent pages (DeepSeek-V3 rows, ``ckv`` + ``kpe``)
   DRAM -> HBM by each path, bit-exact, GB/s; FlashInfer's paged MLA decode over them against a
   float64 reference.
4. ``cold`` (:mod:`gpu_checks.cold`): DRAM as a cold tier: ``fp8`` / ``int4`` pages encoded and
   decoded on the device (``EncodedHostMover``), device vs CPU codec, error within the format's
   bound, promote ms and PCIe bytes against the exact mover.
5. ``flashinfer`` (:mod:`gpu_checks.attention`): paged attention over pages loaded DRAM ->
   HBM, against a float64 reference.
6. ``dp`` (:mod:`gpu_checks.dp`): stock SGLang with ``--tp-size 2 --attn-dp-size 2`` on the tiny
   DeepSeek-V2 model against stock ``--tp-size 2``, greedy outputs compared; skipped with fewer
   than 2 GPUs ("needs 2 GPUs (TP 2 x DP 2)") or without SGLang. Run it alone on a 2-GPU machine:
   ``scripts/gpu_check --checks dp --out "$OUT"``.

Every figure is in the unit its key names (``_ms``, ``_s``, ``_GBps`` = 1e9 bytes/s, ``_MiB``).
"""

from __future__ import annotations

import argparse
import faulthandler
import glob
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from gpu_checks.common import REPO_ROOT, Ctx, _now_utc, _run_cmd, _write_json, fs_info
from gpu_checks.summary import summary_lines

SCRIPT = REPO_ROOT / "scripts" / "gpu_check"
DEFAULT_BUDGET_S = 450.0  # the whole script; the device run wraps it in `timeout 470`
CHECKS = ("layerwise", "nvme", "mla", "cold", "flashinfer", "dp")
# name: (cap of its budget, least time worth starting it with), seconds
CHECK_BUDGETS = {"layerwise": (120.0, 25.0), "nvme": (80.0, 15.0), "mla": (60.0, 15.0), "cold": (45.0, 10.0),
                 "flashinfer": (320.0, 40.0),
                 "dp": (240.0, 15.0)}  # dp: a skip takes ~5 s; two server starts need >= 100 s of it
RESERVE_S = 8.0  # kept back for merging and writing results
_FI_WORKSPACE = "/tmp/gpu_check_flashinfer"


def _check_fn(name: str):
    """The check function of ``name`` (imported in the child only)."""
    if name == "layerwise":
        from gpu_checks.layerwise import check_layerwise

        return check_layerwise
    if name == "nvme":
        from gpu_checks.nvme import check_nvme

        return check_nvme
    if name == "mla":
        from gpu_checks.mla import check_mla

        return check_mla
    if name == "cold":
        from gpu_checks.cold import check_cold

        return check_cold
    if name == "dp":
        from gpu_checks.dp import check_dp

        return check_dp
    from gpu_checks.attention import check_flashinfer

    return check_flashinfer


def child_main(args: argparse.Namespace) -> int:
    name = args.child
    opts = json.loads(args.opts or "{}")
    ctx = Ctx(name, Path(args.child_out), float(args.deadline), args.quick, args.allow_cpu, opts)
    # hard stop a little after the deadline even if stuck inside a CUDA call
    faulthandler.dump_traceback_later(max(5.0, ctx.left() + 5.0), exit=True)
    fn = _check_fn(name)
    try:
        fn(ctx)
        if ctx.result.get("status") == "running":
            ctx.result["status"] = "ok"
    except Exception as exc:
        ctx.result.update(status="failed", reason=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-3000:])
        ctx.log(f"FAILED: {exc}")
    ctx.save()
    return 0



class Runner:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.t0 = time.time()
        self.deadline = self.t0 + args.budget_s
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.log_path = self.out / "gpu_check.log"
        self._log_lock = threading.Lock()
        self.results: dict[str, Any] = {
            "script": "scripts/gpu_check",
            "started_utc": _now_utc(),
            "args": {k: v for k, v in vars(args).items() if not k.startswith("child") and k not in ("opts", "deadline")},
            "budget_s": args.budget_s,
            "checks": {},
        }
        self.env = dict(os.environ)

    def left(self) -> float:
        return self.deadline - time.time()

    def log(self, msg: str) -> None:
        line = f"[gpu_check +{time.time() - self.t0:6.1f}s] {msg}"
        with self._log_lock:
            print(line, flush=True)
            with open(self.log_path, "a") as f:
                f.write(line + "\n")

    def _raw(self, line: str) -> None:
        with self._log_lock:
            sys.stdout.write(line)
            sys.stdout.flush()
            with open(self.log_path, "a") as f:
                f.write(line)

    def save(self) -> None:
        self.results["wall_s"] = round(time.time() - self.t0, 1)
        _write_json(self.out / "results.json", self.results)

    # ---- install
    def install(self) -> None:
        info: dict[str, Any] = {}
        self.results["install"] = info
        site = Path(self.args.site)
        wheels_dir = self.args.wheels
        if not wheels_dir:
            info["status"] = "skipped"
            info["reason"] = "no --wheels given"
        elif not os.path.isdir(wheels_dir):
            info.update(status="failed", reason=f"--wheels {wheels_dir} is not a directory")
        else:
            site.mkdir(parents=True, exist_ok=True)
            wheels = sorted(glob.glob(os.path.join(wheels_dir, "*.whl")))
            tars = sorted(glob.glob(os.path.join(wheels_dir, "*.tar.xz")) + glob.glob(os.path.join(wheels_dir, "*.tar.gz")))
            info["wheels"] = [os.path.basename(w) for w in wheels]
            info["tarballs"] = [os.path.basename(t) for t in tars]
            info["target"] = str(site)
            t = time.time()
            if wheels:
                cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                       "--no-cache-dir", "--upgrade", "--disable-pip-version-check", "--target", str(site), *wheels]
                try:
                    p = subprocess.run(cmd, capture_output=True, text=True, timeout=min(180.0, max(10.0, self.left() - 60)))
                    info["pip_rc"] = p.returncode
                    info["pip_output"] = (p.stdout + p.stderr).strip()[-3000:]
                    if p.returncode != 0:  # one bad wheel fails them all: install the rest one by one
                        info["per_wheel"] = {}
                        for whl in wheels:
                            q = subprocess.run(cmd[: -len(wheels)] + [whl], capture_output=True, text=True, timeout=60)
                            info["per_wheel"][os.path.basename(whl)] = (
                                "ok" if q.returncode == 0 else (q.stdout + q.stderr).strip()[-400:])
                except subprocess.TimeoutExpired:
                    info["pip_rc"] = None
                    info["pip_output"] = "pip install timed out"
            for tball in tars:
                try:
                    with tarfile.open(tball) as tf:
                        tf.extractall(site, filter="data") if hasattr(tarfile, "data_filter") else tf.extractall(site)
                    info.setdefault("tar_ok", []).append(os.path.basename(tball))
                except Exception as exc:
                    info.setdefault("tar_failed", []).append(f"{os.path.basename(tball)}: {exc}")
            info["s"] = round(time.time() - t, 1)
            info["status"] = "ok" if info.get("pip_rc", 0) == 0 and not info.get("tar_failed") else "failed"
        paths = [str(site)] if site.is_dir() else []
        paths.append(str(REPO_ROOT))
        if self.env.get("PYTHONPATH"):
            paths.append(self.env["PYTHONPATH"])
        self.env["PYTHONPATH"] = os.pathsep.join(paths)
        for p in reversed(paths[:2]):
            if p not in sys.path:
                sys.path.insert(0, p)
        self.log(f"install: {info.get('status')} ({info.get('reason') or info.get('s')})")
        if info.get("status") == "failed":
            self.log(f"install output: {info.get('pip_output') or info.get('reason')} {info.get('tar_failed') or ''}")

    # ---- environment
    def environment(self) -> None:
        env: dict[str, Any] = {
            "python": sys.version.split()[0],
            "executable": sys.executable,
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        }
        try:
            env["mem_total_GiB"] = round(int(Path("/proc/meminfo").read_text().split("\n")[0].split()[1]) / 2**20, 1)
        except Exception:
            pass
        # tools the children need: CUDA_HOME, nvcc and ninja on PATH (FlashInfer's JIT)
        path = self.env.get("PATH", "")
        extra = [os.path.dirname(sys.executable)]
        cuda_home = self.env.get("CUDA_HOME") or self.env.get("CUDA_PATH")
        if not cuda_home:
            nvcc = shutil.which("nvcc", path=path)
            derived = str(Path(nvcc).resolve().parent.parent) if nvcc else None
            if os.path.exists("/usr/local/cuda/bin/nvcc"):
                cuda_home = "/usr/local/cuda"
            elif derived and os.path.exists(os.path.join(derived, "include", "cuda_runtime.h")):
                cuda_home = derived
        if cuda_home:
            self.env["CUDA_HOME"] = cuda_home
            extra.append(os.path.join(cuda_home, "bin"))
        self.env["PATH"] = os.pathsep.join([p for p in extra if p not in path.split(os.pathsep)] + [path])
        env["CUDA_HOME"] = cuda_home
        env["nvcc"] = _run_cmd(["nvcc", "--version"] if shutil.which("nvcc", path=self.env["PATH"]) is None else
                               [shutil.which("nvcc", path=self.env["PATH"]), "--version"])["out"][-200:]
        env["ninja"] = shutil.which("ninja", path=self.env["PATH"])
        env["nvidia_smi"] = _run_cmd(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used,"
                                      "clocks.sm,clocks.mem,pcie.link.gen.current,pcie.link.width.current",
                                      "--format=csv"], timeout=20)["out"]
        env["df"] = _run_cmd(["df", "-hT"], timeout=10)["out"]
        env["fs_tmp"] = fs_info(tempfile.gettempdir())
        env["fs_repo"] = fs_info(REPO_ROOT)
        env["fs_dev_shm"] = fs_info("/dev/shm") if os.path.isdir("/dev/shm") else None
        code = (
            "import json,importlib.metadata as m,torch\n"
            "d={'torch':torch.__version__,'torch_cuda':torch.version.cuda,'cuda_available':torch.cuda.is_available()}\n"
            "if d['cuda_available']:\n"
            " p=torch.cuda.get_device_properties(0);d.update(gpu=p.name,cc=f'{p.major}.{p.minor}',sms=p.multi_processor_count,"
            "gpu_mem_GiB=round(p.total_memory/2**30,1))\n"
            "for n in ['sglang','kvikio-cu13','kvikio-cu12','libkvikio-cu13','rapids-logger','flashinfer-python','apache-tvm-ffi',"
            "'cupy-cuda13x','nvidia-cufile','numpy','xxhash']:\n"
            " try: d['pkg_'+n]=m.version(n)\n"
            " except Exception: d['pkg_'+n]=None\n"
            "print(json.dumps(d))\n"
        )
        try:
            p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=self.env)
            env.update(json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"probe_error": p.stderr[-1500:]})
        except Exception as exc:
            env["probe_error"] = f"{type(exc).__name__}: {exc}"
        self.results["env"] = env
        self.log(f"env: torch {env.get('torch')} cuda_available={env.get('cuda_available')} gpu={env.get('gpu')} "
                 f"python {env['python']} tmp fs={env['fs_tmp'].get('fstype')}")

    # ---- children
    def run_check(self, name: str) -> None:
        cap, least = CHECK_BUDGETS[name]
        left = self.left() - RESERVE_S
        # keep what the checks after this one need at least
        later = [c for c in self.selected if CHECKS.index(c) > CHECKS.index(name)]
        keep = sum(CHECK_BUDGETS[c][1] for c in later)
        budget = min(cap, left - keep) if name != self.selected[-1] else min(cap, left)
        if self.args.quick:
            budget = min(budget, 120.0)
        if budget < least:
            self.results["checks"][name] = {"status": "skipped",
                                            "reason": f"time budget: {budget:.0f}s available, needs >= {least:.0f}s"}
            self.log(f"{name}: skipped ({budget:.0f}s available)")
            self.save()
            return
        out_file = self.work / f"{name}.json"
        deadline = time.time() + budget - 3.0
        opts = {"prefix_tokens": self.args.prefix_tokens, "nvme_dir": self.args.nvme_dir,
                "nvme_pages": self.args.nvme_pages, "prefill_min_s": self.args.prefill_min_s}
        cmd = [sys.executable, str(SCRIPT), "--child", name, "--child-out", str(out_file),
               "--deadline", repr(deadline), "--opts", json.dumps(opts), "--out", str(self.out)]
        if self.args.quick:
            cmd.append("--quick")
        if self.args.allow_cpu:
            cmd.append("--allow-cpu")
        self.log(f"{name}: start (budget {budget:.0f}s)")
        t = time.time()
        env = dict(self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("FLASHINFER_WORKSPACE_BASE", _FI_WORKSPACE)
        env.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
        env.setdefault("KVIKIO_NTHREADS", "8")
        env.setdefault("FLASHINFER_DISABLE_VERSION_CHECK", "1")
        env.setdefault("FLASHINFER_DECODE_AUTO_CUDNN", "0")  # decode "auto": never cuDNN (not installed there)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True, cwd=str(REPO_ROOT))

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self._raw(line if line.startswith("[") else f"[{name}] {line}")

        th = threading.Thread(target=pump, daemon=True)
        th.start()
        status_override = None
        try:
            proc.wait(timeout=budget + 2.0)
        except subprocess.TimeoutExpired:
            status_override = f"timed out after {budget:.0f}s (killed; partial results kept)"
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
        th.join(timeout=5)
        try:
            result = json.loads(out_file.read_text())
        except Exception as exc:
            result = {"status": "failed", "reason": f"no result file ({exc}); exit code {proc.returncode}"}
        if status_override:
            result["status"] = "timeout"
            result["reason"] = status_override
        elif proc.returncode not in (0, None) and result.get("status") in ("ok", "running"):
            result["status"] = "failed"
            result["reason"] = f"child exited with {proc.returncode} (killed by its watchdog or crashed)"
        result["process_wall_s"] = round(time.time() - t, 1)
        result["budget_s"] = round(budget, 1)
        self.results["checks"][name] = result
        self.log(f"{name}: {result.get('status')} in {result['process_wall_s']}s {result.get('reason', '')}")
        self.save()

    def summary(self) -> list[str]:
        return summary_lines(self.results["checks"])

    def main(self) -> int:
        faulthandler.dump_traceback_later(self.args.budget_s + 25.0, exit=True)
        self.selected = [c for c in CHECKS if c in self.args.checks.split(",")]
        self.log(f"out={self.out} budget={self.args.budget_s:.0f}s checks={','.join(self.selected)}")
        self.save()
        self.install()
        self.save()
        self.environment()
        self.save()
        for name in self.selected:
            try:
                self.run_check(name)
            except Exception as exc:
                self.results["checks"][name] = {"status": "failed", "reason": f"runner: {type(exc).__name__}: {exc}"}
                self.save()
        self.results["finished_utc"] = _now_utc()
        self.results["summary"] = self.summary()
        self.save()
        shutil.rmtree(self.work, ignore_errors=True)
        print("\n==== gpu_check summary (all figures in " + str(self.out / "results.json") + ")", flush=True)
        for line in self.results["summary"]:
            self._raw(line + "\n")
        self.log(f"done in {time.time() - self.t0:.0f}s")
        return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/gpu_check", description=__doc__.split("\n\n", 2)[1] if __doc__ else None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory for results.json and gpu_check.log (required unless --prepare-wheels)")
    p.add_argument("--wheels", default=None, help="directory of wheels (and *.tar.xz) installed offline")
    p.add_argument("--site", default="/tmp/gpu_check_site", help="pip --target directory for --wheels")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="time budget of the whole script (s)")
    p.add_argument("--checks", default=",".join(CHECKS), help="comma list of checks: " + ",".join(CHECKS))
    p.add_argument("--quick", action="store_true", help="tiny sizes (CPU dry runs, tests)")
    p.add_argument("--allow-cpu", action="store_true", help="run the checks on the CPU when there is no GPU")
    p.add_argument("--prefix-tokens", type=int, default=None, help="layerwise: cached prefix tokens loaded per forward")
    p.add_argument("--nvme-dir", default=None, help="nvme: directory for the slot file (default: first block-device fs)")
    p.add_argument("--nvme-pages", type=int, default=None, help="nvme: pages (of all layers) written and read")
    p.add_argument("--prefill-min-s", type=float, default=150.0, help="flashinfer: least time left to try prefill")
    p.add_argument("--prepare-wheels", metavar="DIR", help="download the wheels the GPU machine lacks into DIR (run "
                   "where PyPI is reachable; then carry DIR, e.g. .whl, listed in .git/info/exclude) and exit")
    # internal: one check in a child process
    p.add_argument("--child", choices=CHECKS, help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--deadline", help=argparse.SUPPRESS)
    p.add_argument("--opts", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [c for c in args.checks.split(",") if c not in CHECKS]
    if bad:
        p.error(f"unknown check(s) {bad}; choose from {CHECKS}")
    if not args.out and not args.prepare_wheels:
        p.error("--out is required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.prepare_wheels:
        from gpu_checks.wheels import prepare_wheels

        return prepare_wheels(args.prepare_wheels)
    if args.child:
        if str(REPO_ROOT) not in sys.path:
            sys.path.insert(0, str(REPO_ROOT))
        return child_main(args)
    return Runner(args).main()


if __name__ == "__main__":
    sys.exit(main())
