"""What every check of ``scripts/gpu_check`` shares: its context, small helpers, disk choice,
and a stand-in of SGLang's ``LayerDoneCounter`` for machines without SGLang.

Every figure is in the unit its key names (``_ms``, ``_s``, ``_GBps`` = 1e9 bytes/s, ``_MiB``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]


def _now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _write_json(path: Path, obj: Any) -> None:
    """Atomic JSON write (a killed process leaves the previous version, never half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(float(x), nd)


def _gbps(nbytes: float, seconds: float) -> float:
    """``nbytes`` in ``seconds`` as 1e9 bytes/s to 3 significant digits: a slow run (a loaded
    CPU machine's dry run) stays above 0 (rounded to decimals it read 0.0, and a share of it
    divided by zero)."""
    return float(f"{nbytes / seconds / 1e9:.3g}")


def _run_cmd(cmd: list[str] | str, timeout: float = 15.0) -> dict[str, Any]:
    """Run a small command; never raises, never hangs longer than ``timeout``."""
    try:
        p = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, timeout=timeout)
        return {"rc": p.returncode, "out": (p.stdout + p.stderr).strip()[-4000:]}
    except Exception as exc:  # missing binary, timeout
        return {"rc": None, "out": f"{type(exc).__name__}: {exc}"}


def fs_info(path: str | Path) -> dict[str, Any]:
    """File system of ``path``: mount point, type, device (from /proc/mounts), free space."""
    path = os.path.realpath(path)
    best: tuple[str, str, str] | None = None
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            mnt = mnt.replace("\\040", " ")
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/") or mnt == "/") and (
                best is None or len(mnt) >= len(best[1])
            ):
                best = (dev, mnt, fstype)
    except OSError:
        pass
    info: dict[str, Any] = {"path": path}
    if best:
        info.update(device=best[0], mount=best[1], fstype=best[2])
    try:
        st = os.statvfs(path)
        info["free_GiB"] = round(st.f_bavail * st.f_frsize / 2**30, 2)
        info["size_GiB"] = round(st.f_blocks * st.f_frsize / 2**30, 2)
    except OSError as exc:
        info["statvfs_error"] = str(exc)
    return info


NON_DISK_FS = {"overlay", "tmpfs", "ramfs", "devtmpfs", "squashfs", "9p", "virtiofs", "fuse", "proc", "sysfs", "nfs", "nfs4"}


def pick_disk_dir(explicit: str | None, need_bytes: int) -> tuple[Path, dict[str, Any]]:
    """A writable directory on a block-device file system with room for ``need_bytes``.

    Returns the chosen base directory and what was seen for each candidate.
    """
    candidates = [explicit] if explicit else []
    candidates += ["/var/tmp", "/root", str(REPO_ROOT), "/mnt", "/data", tempfile.gettempdir()]
    seen: dict[str, Any] = {}
    fallback: Path | None = None
    for cand in candidates:
        if not cand or cand in seen or not os.path.isdir(cand) or not os.access(cand, os.W_OK):
            continue
        info = fs_info(cand)
        seen[cand] = info
        roomy = info.get("free_GiB", 0) * 2**30 > need_bytes * 1.3
        if fallback is None and roomy:
            fallback = Path(cand)
        if roomy and (explicit == cand or info.get("fstype") not in NON_DISK_FS):
            return Path(cand), {"candidates": seen, "chosen_reason": "explicit" if explicit == cand else "block-device fs"}
    if fallback is None:
        fallback = Path(tempfile.gettempdir())
    return fallback, {"candidates": seen, "chosen_reason": "no block-device fs with room found; fallback"}


class Ctx:
    """What a check gets: its deadline, sizes, device, and a way to save partial results."""

    def __init__(self, name: str, out_file: Path, deadline: float, quick: bool, allow_cpu: bool, opts: dict[str, Any]):
        self.name = name
        self.out_file = out_file
        self.deadline = deadline  # time.time() seconds
        self.quick = quick
        self.allow_cpu = allow_cpu
        self.opts = opts
        self.result: dict[str, Any] = {"status": "running"}
        self.t0 = time.time()

    def left(self) -> float:
        return self.deadline - time.time()

    def save(self) -> None:
        self.result["wall_s"] = round(time.time() - self.t0, 2)
        _write_json(self.out_file, self.result)

    def log(self, msg: str) -> None:
        print(f"[{self.name} +{time.time() - self.t0:6.1f}s] {msg}", flush=True)


def _device(ctx: Ctx):
    """The torch device to use, or None (result marked skipped) when there is no GPU."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if ctx.allow_cpu:
        ctx.result["note"] = "no CUDA device: ran on the CPU with --allow-cpu (code paths only; figures are not GPU figures)"
        return torch.device("cpu")
    ctx.result.update(status="skipped", reason="no CUDA device (torch.cuda.is_available() is False)")
    return None


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)



class _LayerLoadingEvent:
    """Equivalent of SGLang 0.5.23's ``LayerLoadingEvent`` (managers/cache_controller.py)."""

    def __init__(self, num_layers: int):
        import torch

        self._num_layers = num_layers
        self.load_events = [torch.cuda.Event() for _ in range(num_layers)]
        self.start_event = torch.cuda.Event()

    def complete(self, layer_index: int) -> None:
        assert 0 <= layer_index < self._num_layers
        self.load_events[layer_index].record()

    def wait(self, layer_index: int) -> None:
        import torch

        torch.cuda.current_stream().wait_event(self.load_events[layer_index])

    @property
    def finish_event(self):
        return self.load_events[-1]


class _LayerDoneCounter:
    """Equivalent of SGLang 0.5.23's ``LayerDoneCounter``: 3 producer slots of per-layer events."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.num_counters = 3
        self.events = [_LayerLoadingEvent(num_layers) for _ in range(self.num_counters)]
        self.producer_index = -1
        self.consumer_index = -1

    def update_producer(self) -> int:
        self.producer_index = (self.producer_index + 1) % self.num_counters
        assert self.events[self.producer_index].finish_event.query(), "producer slot reused before it finished"
        return self.producer_index

    def set_consumer(self, index: int) -> None:
        self.consumer_index = index

    def wait_until(self, threshold: int) -> None:
        if self.consumer_index < 0:
            return
        self.events[self.consumer_index].wait(threshold)

    def reset(self) -> None:
        self.producer_index = -1
        self.consumer_index = -1


def ensure_layer_done_counter() -> str:
    """Make ``sglang.srt.managers.cache_controller.LayerDoneCounter`` importable.

    Returns where it comes from: SGLang itself, or the stand-in above (registered in
    ``sys.modules``) when SGLang cannot be imported here.
    """
    try:
        from sglang.srt.managers.cache_controller import LayerDoneCounter  # noqa: F401

        import sglang

        return f"sglang {getattr(sglang, '__version__', '?')} LayerDoneCounter"
    except Exception as exc:
        import types

        for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
            if sys.modules.get(name) is None:
                mod = types.ModuleType(name)
                mod.__path__ = []  # a package
                sys.modules[name] = mod
        cc = types.ModuleType("sglang.srt.managers.cache_controller")
        cc.LayerDoneCounter = _LayerDoneCounter
        cc.LayerLoadingEvent = _LayerLoadingEvent
        sys.modules["sglang.srt.managers.cache_controller"] = cc
        return (
            "stand-in equivalent of SGLang 0.5.23 LayerDoneCounter (same torch.cuda stream/event pattern; "
            f"sglang not importable: {type(exc).__name__}: {str(exc)[:160]})"
        )


def _llama_cfg(quick: bool) -> dict[str, Any]:
    if quick:
        return dict(model="tiny (quick)", num_layers=4, hidden=256, intermediate=512, q_heads=4, kv_heads=2,
                    head_dim=64, tokens=32, prefix_tokens=256, page_size=16)
    return dict(model="Llama-3-8B-like", num_layers=32, hidden=4096, intermediate=14336, q_heads=32, kv_heads=8,
                head_dim=128, tokens=2048, prefix_tokens=16384, page_size=16)


