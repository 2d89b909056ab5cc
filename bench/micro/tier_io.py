"""I/O throughput of the DRAM and NVMe tiers, each against a raw baseline measured in the same run.

Run from the repository root (as a module: the file is named like the standard library's ``io``)::

    .venv/bin/python -m bench.micro.tier_io                       # ~1 minute on 2 cores
    .venv/bin/python -m bench.micro.tier_io --dir /mnt/nvme/tmp   # the disk to test (default: runs/)

Per model shape (a page = ``page_size`` tokens of all layers, K and V), ``--repeats`` rounds,
variants interleaved in an order rotated every round, after one discarded warm-up round:

NVMe (one file system, ``--threads`` I/O threads everywhere):
  raw      the baseline: the same bytes as the store's slots (``num_pages * slot_bytes``) moved in
           ``--raw-chunk-mib`` ``O_DIRECT`` ``pwritev``/``preadv`` calls from page-aligned buffers
           (populated at creation) on a ``ThreadPoolExecutor`` of ``--threads`` threads, on a
           file in the same directory;
  raw-slot the same, in calls of one slot each: what the disk gives at the store's I/O size;
  store    ``NvmeStore.write_slots``/``read_slots`` of all pages in one call, pages in a
           ``DramPool`` (what the I/O worker does, in this process; xxhash trailers included);
  worker   the same through the I/O worker process: one ``StorePages``/``LoadPages`` job of all
           pages, ``IOWorkerClient.submit`` to ``JobDone`` (ZMQ ipc + the worker's thread pool);
  jobs     the same pages as jobs of ``--pages-per-job`` pages (a cache node's size), submitted
           together, until the last ``JobDone``;
  kvikio   ``NvmeStore`` with the KvikIO backend, only where it is usable (a CUDA device).
DRAM (the "device" pool is a CPU tensor here, so these are host copies, not PCIe):
  memcpy   the baseline: one contiguous ``copy_`` of the same bytes;
  store    ``store_pages`` of all pages, all layers (gather from token slots, scatter into DRAM);
  load     ``load_layer`` for every layer (the layer-wise promotion path).
ZMQ: ``IOWorkerClient.ping`` round trips (``--pings`` per round, between the rounds).

``O_DIRECT`` bypasses this machine's page cache, so reads come from the device (a virtual
disk may still be cached by its host: say so when quoting the numbers). On tmpfs ``O_DIRECT``
measures memory copies, not a disk: the script prints the file system and warns.

Prints a table (medians, bests and ratios to the baseline; GB = 1e9 bytes) and writes
``io.json`` and ``io.png`` to ``runs/io-<timestamp>/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import mmap
import os
import platform
import queue
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from hiradix.io.client import IOWorkerClient
from hiradix.io.protocol import LoadPages, StorePages, WorkerSpec
from hiradix.dataplane.layout import KVLayout, load_layer, store_pages
from hiradix.tiers.dram import DramPool
from hiradix.tiers.nvme import SLOT_ALIGN, NvmeStore, align_up, kvikio_unusable_reason

REPO_ROOT = Path(__file__).resolve().parents[2]
READ_TARGET_RATIO = 0.9  # NVMe reads must reach this fraction of the raw baseline
GB = 1e9  # bytes


@dataclass(frozen=True)
class Shape:
    """A model's KV page and how many pages one operation moves."""

    label: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int  # tokens per page
    num_pages: int  # pages per operation

    def layout(self) -> KVLayout:
        return KVLayout(self.num_layers, self.page_size, self.num_kv_heads, self.head_dim, torch.bfloat16)


SHAPES = {
    "llama3-8b": Shape("llama3-8b", 32, 8, 128, 16, 64),  # 2 MiB pages, 128 MiB per operation
    "qwen2-0.5b": Shape("qwen2-0.5b", 24, 2, 64, 16, 256),  # 192 KiB pages, 48 MiB per operation
    "tiny": Shape("tiny", 2, 2, 8, 4, 16),  # 512 B pages: the smoke test's
}


# ---- the machine and the file system ---------------------------------------------------------


def file_system_of(path: Path) -> dict[str, str | bool]:
    """Mount point, type and block device holding ``path`` (longest match in /proc/self/mounts)."""
    real = os.path.realpath(path)
    best = {"mountpoint": "/", "fstype": "unknown", "device": "unknown"}
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            device, mountpoint, fstype = line.split()[:3]
            mountpoint = mountpoint.encode().decode("unicode_escape")  # \040 = space
            inside = real == mountpoint or real.startswith(mountpoint.rstrip("/") + "/")
            if inside and len(mountpoint) >= len(best["mountpoint"]):
                best = {"mountpoint": mountpoint, "fstype": fstype, "device": device}
    name = os.path.basename(best["device"])
    rotational = Path(f"/sys/class/block/{name}/queue/rotational")
    driver = Path(f"/sys/class/block/{name}/device/driver")
    return {
        **best,
        "tmpfs": best["fstype"] in ("tmpfs", "ramfs"),
        "rotational": rotational.read_text().strip() == "1" if rotational.exists() else "unknown",
        "driver": os.path.basename(os.path.realpath(driver)) if driver.exists() else "unknown",
    }


def check_memory(shapes: list[Shape], shm_dir: Path) -> None:
    """Refuse to start where the largest shape would leave under 1 GiB of RAM (a shared machine).

    Peak per shape: the DRAM pool (on ``shm_dir``), the stand-in device buffers and the memcpy
    destination, each about ``num_pages * page_bytes``, plus the I/O worker process.
    """
    need_bytes = max(3 * s.num_pages * s.layout().page_bytes for s in shapes) + (512 << 20)
    with open("/proc/meminfo") as meminfo:
        avail_bytes = int(next(line for line in meminfo if line.startswith("MemAvailable")).split()[1]) << 10
    shm_free_bytes = shutil.disk_usage(shm_dir).free
    pool_bytes = max(s.num_pages * s.layout().page_bytes for s in shapes)
    if avail_bytes - need_bytes < 1 << 30 or shm_free_bytes < 2 * pool_bytes:
        sys.exit(f"not enough memory: need {need_bytes >> 20} MiB (+1 GiB spare), {avail_bytes >> 20} MiB available, "
                 f"{shm_free_bytes >> 20} MiB free on {shm_dir}; use --num-pages to shrink")  # fmt: skip


def machine() -> dict[str, object]:
    """CPU count, memory and versions, for the record."""
    with open("/proc/meminfo") as meminfo:
        mem_kib = int(next(line for line in meminfo if line.startswith("MemTotal")).split()[1])
    return {"nproc": os.cpu_count(), "mem_total_gib": round(mem_kib / 2**20, 1), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}  # fmt: skip


# ---- the raw baseline ------------------------------------------------------------------------


def populated_buffer(num_bytes: int) -> mmap.mmap:
    """Page-aligned anonymous memory, faulted in by the kernel in one pass at creation.

    One pass (``MAP_POPULATE``) tends to get physically contiguous pages, so one large
    ``O_DIRECT`` call is few scatter-gather segments and few block requests. Buffers first
    touched piecemeal (e.g. by several threads at once) are scattered 4 KiB pages: a 2 MiB
    call then needs more segments than a request may hold and is split.
    """
    return mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)


class DeviceRequests:
    """Completed read and write requests of a block device (``/sys/class/block/<dev>/stat``), all processes."""

    def __init__(self, device: str):
        path = Path(f"/sys/class/block/{os.path.basename(device)}/stat")
        self.path = path if path.exists() else None  # None: not a block device (tmpfs, overlay, ...)

    def counts(self) -> tuple[int, int]:
        """``(reads, writes)`` completed so far; ``(0, 0)`` where there is no device."""
        if self.path is None:
            return 0, 0
        fields = self.path.read_text().split()
        return int(fields[0]), int(fields[4])


class RawDirectFile:
    """``size_bytes`` of one ``O_DIRECT`` file moved in ``chunk_bytes`` calls on ``threads`` threads."""

    def __init__(self, path: Path, size_bytes: int, chunk_bytes: int, threads: int):
        if chunk_bytes % SLOT_ALIGN:
            raise ValueError(f"chunk of {chunk_bytes} bytes is not a multiple of {SLOT_ALIGN}")
        self.size_bytes = align_up(size_bytes)
        self.direct_io = True
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            self._fd = os.open(path, flags | os.O_DIRECT, 0o600)
        except OSError:  # a file system without O_DIRECT; the store falls back the same way
            self.direct_io = False
            self._fd = os.open(path, flags, 0o600)
        os.posix_fallocate(self._fd, 0, self.size_bytes)
        self._chunks = [(off, min(chunk_bytes, self.size_bytes - off)) for off in range(0, self.size_bytes, chunk_bytes)]
        self._bufs: queue.SimpleQueue[mmap.mmap] = queue.SimpleQueue()
        self._bufs_all = [populated_buffer(chunk_bytes) for _ in range(threads)]
        rng = np.random.default_rng(1)
        for buf in self._bufs_all:  # random bytes: nothing below may compress or deduplicate them
            np.frombuffer(buf, np.uint8)[:] = rng.integers(0, 256, chunk_bytes, dtype=np.uint8)
            self._bufs.put(buf)
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="raw-io")

    def _one(self, call, chunk: tuple[int, int]) -> None:
        offset, length = chunk
        buf = self._bufs.get()
        try:
            done = call(self._fd, [memoryview(buf)[:length]], offset)
        finally:
            self._bufs.put(buf)
        if done != length:
            raise OSError(f"raw I/O moved {done} of {length} bytes at {offset}")

    def write(self) -> None:
        list(self._executor.map(lambda c: self._one(os.pwritev, c), self._chunks))

    def read(self) -> None:
        list(self._executor.map(lambda c: self._one(os.preadv, c), self._chunks))

    def close(self) -> None:
        self._executor.shutdown()
        os.close(self._fd)
        for buf in self._bufs_all:
            buf.close()


def prefault_bounce(store: NvmeStore) -> NvmeStore:
    """Diagnostic (``--prefault-bounce``): give ``store`` bounce buffers from :func:`populated_buffer`.

    Previews the proposed fix of ``NvmeStore.__init__`` (allocate its bounce buffers with
    ``MAP_POPULATE``); reaches into the store's private fields, so it is for measurement only.
    """
    old = store._bounce_all
    store._bounce_all = [populated_buffer(len(buf)) for buf in old]
    store._bounce = queue.SimpleQueue()
    for buf in store._bounce_all:
        store._bounce.put(buf)
    for buf in old:
        buf.close()
    return store


# ---- one shape: the pool, the store, the worker, the baseline ---------------------------------


class NvmeCase:
    """Everything the NVMe and ZMQ measurements of one shape need; ``run(op, variant)`` times one."""

    def __init__(self, shape: Shape, args: argparse.Namespace, shm_dir: Path, nvme_dir: Path, device: str):
        self.shape, self.layout = shape, shape.layout()
        n = shape.num_pages
        self.pool = DramPool.create(self.layout, n, shm_dir / shape.label)
        self.pool.tensor.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(0))
        self.pages = list(range(n))
        self.slots = list(range(n))
        store_dir = nvme_dir / shape.label
        self.stores = {"store": NvmeStore.create(store_dir, self.layout.page_bytes, n, "posix", args.threads)}
        if args.kvikio is None:
            self.stores["kvikio"] = NvmeStore.create(nvme_dir / f"{shape.label}-kvikio", self.layout.page_bytes, n, "kvikio", args.threads)
        self.slot_bytes = self.stores["store"].slot_bytes
        self.disk_bytes = n * self.slot_bytes
        self.raws = {  # the baseline, and the same calls cut at slot size (the I/O size the store issues)
            "raw": RawDirectFile(nvme_dir / f"{shape.label}-raw.bin", self.disk_bytes, args.raw_chunk_mib << 20, args.threads),
            "raw-slot": RawDirectFile(nvme_dir / f"{shape.label}-raw-slot.bin", self.disk_bytes, self.slot_bytes, args.threads),
        }
        spec = WorkerSpec(
            dram_path=str(self.pool.path), layout=self.layout.to_json(), num_dram_pages=n,
            nvme_dir=str(store_dir), num_nvme_slots=n, page_bytes=self.layout.page_bytes, io_backend="posix",
            socket_dir=str(shm_dir / "sock"), threads=args.threads, parent_pid=os.getpid(),
        )  # fmt: skip
        if args.prefault_bounce:  # the proposed nvme.py fix, on the same file (never used concurrently)
            self.stores["store+pop"] = prefault_bounce(NvmeStore.open(self.stores["store"].path, self.layout.page_bytes, n, "posix", args.threads))
        self.client = IOWorkerClient(spec)
        self.client.start()
        self.pages_per_job = min(args.pages_per_job, n)
        self.variants = [*self.raws, *self.stores, "worker", "jobs"]
        self.worker_busy_s: dict[str, list[float]] = {"write": [], "read": []}  # JobDone.duration_s
        self.device = DeviceRequests(device)
        self.requests: dict[tuple[str, str], list[int]] = {}  # (op, variant) -> block requests per run
        self._job_id = 0

    def run(self, op: str, variant: str) -> float:
        """Seconds for one ``op`` ("write" or "read") of all pages through ``variant``.

        Also records the block device's completed requests of that kind meanwhile (all processes).
        """
        before = self.device.counts()
        start_s = time.perf_counter()
        if variant in self.raws:
            self.raws[variant].write() if op == "write" else self.raws[variant].read()
        elif variant in self.stores:
            store = self.stores[variant]
            views = [self.pool.page_view(p) for p in self.pages]
            ok = (store.write_slots if op == "write" else store.read_slots)(self.slots, views)
            if not all(ok):
                raise RuntimeError(f"{variant}: {ok.count(False)} pages failed")
        else:
            per_job = len(self.pages) if variant == "worker" else self.pages_per_job
            busy_s = self._run_jobs(op, per_job)
            if variant == "worker":
                self.worker_busy_s[op].append(busy_s)
        elapsed_s = time.perf_counter() - start_s
        after = self.device.counts()
        kind = 0 if op == "read" else 1
        self.requests.setdefault((op, variant), []).append(after[kind] - before[kind])
        return elapsed_s

    def _run_jobs(self, op: str, per_job: int) -> float:
        """Submit the pages as jobs of ``per_job`` pages, wait for all; returns the worker's busy seconds."""
        waiting = set()
        for start in range(0, len(self.pages), per_job):
            self._job_id += 1
            pages, slots = self.pages[start : start + per_job], self.slots[start : start + per_job]
            job = StorePages(self._job_id, pages, slots) if op == "write" else LoadPages(self._job_id, slots, pages)
            self.client.submit(job)
            waiting.add(self._job_id)
        busy_s = 0.0
        while waiting:
            for done in self.client.wait(timeout_s=60.0):
                if done.error or not all(done.ok):
                    raise RuntimeError(f"worker job {done.job_id} failed: {done.error or done.ok}")
                waiting.discard(done.job_id)
                busy_s += done.duration_s
            if waiting and not self.client.check_alive():
                raise RuntimeError("the I/O worker died")
        return busy_s

    def ping_us(self, count: int) -> list[float]:
        """``count`` Ping/Pong round trips through the worker, in microseconds each."""
        round_trips_us = []
        for _ in range(count):
            start_ns = time.perf_counter_ns()
            if not self.client.ping(timeout_s=5.0):
                raise RuntimeError("no Pong within 5 s")
            round_trips_us.append((time.perf_counter_ns() - start_ns) / 1e3)
        return round_trips_us

    def close(self) -> None:
        self.client.close()
        for store in self.stores.values():
            store.close()
        for raw in self.raws.values():
            raw.close()
        self.pool.close()
        self.pool.unlink()


# ---- measurements ------------------------------------------------------------------------------


def rotated(items: list[str], by: int) -> list[str]:
    return items[by % len(items) :] + items[: by % len(items)]


def measure_nvme(case: NvmeCase, repeats: int, pings: int) -> tuple[dict[str, dict[str, list[float]]], list[float]]:
    """Seconds per (op, variant), interleaved and rotated, round 0 discarded; ping µs between rounds.

    Writes come first in every round, so reads always find written slots (a never-written
    extent of a pre-allocated file reads as zeros without touching the disk).
    """
    seconds: dict[str, dict[str, list[float]]] = {op: {v: [] for v in case.variants} for op in ("write", "read")}
    round_trips_us: list[float] = []
    for round_ in range(repeats + 1):
        for op in ("write", "read"):
            for variant in rotated(case.variants, round_):
                elapsed_s = case.run(op, variant)
                if round_:
                    seconds[op][variant].append(elapsed_s)
        if round_ == 0:
            case.worker_busy_s = {"write": [], "read": []}
            case.ping_us(min(pings, 50))  # warm-up
        else:
            round_trips_us += case.ping_us(pings)
    return seconds, round_trips_us


def measure_dram(case: NvmeCase, repeats: int) -> dict[str, list[float]]:
    """Seconds of memcpy / store_pages / load_layer (all layers) of all pages, interleaved."""
    layout, n, ps = case.layout, case.shape.num_pages, case.shape.page_size
    gen = torch.Generator().manual_seed(2)
    rows = (n + 1) * ps  # device page 0 is SGLang's padding page
    buf_shape = (rows, layout.num_kv_heads, layout.head_dim)
    k_buffers = [torch.randn(buf_shape, generator=gen).to(layout.dtype) for _ in range(layout.num_layers)]
    v_buffers = [torch.randn(buf_shape, generator=gen).to(layout.dtype) for _ in range(layout.num_layers)]
    device_pages = torch.randperm(n, generator=gen) + 1
    token_slots = (device_pages[:, None] * ps + torch.arange(ps)).reshape(-1)
    page_ids = torch.randperm(n, generator=gen)  # a pool after churn
    src = case.pool.tensor
    dst = torch.empty_like(src)

    def load_all_layers() -> None:
        for layer in range(layout.num_layers):
            load_layer(k_buffers[layer], v_buffers[layer], layer, src, page_ids, token_slots, layout)

    ops = {
        "memcpy": lambda: dst.copy_(src),
        "store": lambda: store_pages(k_buffers, v_buffers, token_slots, src, page_ids, layout),
        "load": load_all_layers,
    }
    seconds: dict[str, list[float]] = {name: [] for name in ops}
    for round_ in range(repeats + 1):
        for name in rotated(list(ops), round_):
            start_s = time.perf_counter()
            ops[name]()
            if round_:
                seconds[name].append(time.perf_counter() - start_s)
    return seconds


# ---- summaries, table, files -------------------------------------------------------------------


def summarize(samples_s: list[float], num_bytes: int, baseline_s: list[float]) -> dict[str, float]:
    """Median/best seconds and GB/s of ``num_bytes``, and the throughput ratio to the baseline."""
    median_s, best_s = statistics.median(samples_s), min(samples_s)
    return {
        "bytes": num_bytes,
        "median_s": median_s,
        "best_s": best_s,
        "median_gbps": num_bytes / median_s / GB,
        "best_gbps": num_bytes / best_s / GB,
        "ratio_median": statistics.median(baseline_s) / median_s,  # = GB/s / baseline GB/s
        "ratio_best": min(baseline_s) / best_s,
        "samples_s": samples_s,
    }


def nvme_rows(case: NvmeCase, seconds: dict[str, dict[str, list[float]]]) -> list[dict[str, object]]:
    rows = []
    for op, by_variant in seconds.items():
        for variant, samples_s in by_variant.items():
            row = {"shape": case.shape.label, "op": op, "variant": variant}
            row |= summarize(samples_s, case.disk_bytes, by_variant["raw"])
            row["device_requests_median"] = statistics.median(case.requests[(op, variant)][-len(samples_s):])
            if variant == "worker":  # time outside the worker's job: ZMQ, polling, decode
                outside_s = [wall - busy for wall, busy in zip(samples_s, case.worker_busy_s[op])]
                row["outside_job_ms_median"] = statistics.median(outside_s) * 1e3
            rows.append(row)
    return rows


def dram_rows(case: NvmeCase, seconds: dict[str, list[float]]) -> list[dict[str, object]]:
    num_bytes = case.shape.num_pages * case.layout.page_bytes
    rows = []
    for op, samples_s in seconds.items():
        row = {"shape": case.shape.label, "op": op} | summarize(samples_s, num_bytes, seconds["memcpy"])
        if op == "load":
            row["per_layer_us_median"] = row["median_s"] / case.layout.num_layers * 1e6
        rows.append(row)
    return rows


def zmq_summary(round_trips_us: list[float]) -> dict[str, float]:
    ordered = sorted(round_trips_us)
    return {
        "count": len(ordered),
        "median_us": statistics.median(ordered),
        "p99_us": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "min_us": ordered[0],
        "max_us": ordered[-1],
    }


def read_target(nvme: list[dict[str, object]]) -> dict[str, object]:
    """Every non-raw NVMe read against ``READ_TARGET_RATIO`` of the raw read (medians)."""
    reads = [r for r in nvme if r["op"] == "read" and not r["variant"].startswith("raw")]
    checks = [{"shape": r["shape"], "variant": r["variant"], "ratio_median": r["ratio_median"],
               "ratio_best": r["ratio_best"], "met": r["ratio_median"] >= READ_TARGET_RATIO} for r in reads]  # fmt: skip
    return {"target_ratio": READ_TARGET_RATIO, "met": all(c["met"] for c in checks), "checks": checks}


def print_tables(result: dict[str, object]) -> None:
    meta = result["meta"]
    fs = meta["file_system"]
    print(f"\nNVMe: {fs['fstype']} on {fs['device']} (driver {fs['driver']}, rotational {fs['rotational']}), "
          f"O_DIRECT={meta['direct_io']}, {meta['threads']} threads, raw chunk {meta['raw_chunk_mib']} MiB; "
          f"GB/s of slot bytes; ratio = raw time / variant time")  # fmt: skip
    head = f"{'shape':<12}{'op':<7}{'variant':<9}{'MiB':>6}{'med ms':>9}{'GB/s med':>9}{'GB/s best':>10}{'ratio med':>10}{'ratio best':>11}"
    print(head + f"{'reqs/op':>8}{'outside job ms':>15}\n" + "-" * (len(head) + 23))
    for r in result["nvme"]:
        outside = f"{r['outside_job_ms_median']:>15.2f}" if "outside_job_ms_median" in r else ""
        print(f"{r['shape']:<12}{r['op']:<7}{r['variant']:<9}{r['bytes'] / 2**20:>6.0f}{r['median_s'] * 1e3:>9.1f}"
              f"{r['median_gbps']:>9.2f}{r['best_gbps']:>10.2f}{r['ratio_median']:>10.2f}{r['ratio_best']:>11.2f}{r['device_requests_median']:>8.0f}{outside}")  # fmt: skip
    print(f"\nDRAM pool copies (CPU 'device' tensors; {meta['torch_threads']} torch thread(s)); ratio = memcpy time / op time")
    head = f"{'shape':<12}{'op':<8}{'MiB':>6}{'med ms':>9}{'GB/s med':>9}{'GB/s best':>10}{'ratio med':>10}{'ratio best':>11}"
    print(head + f"{'us/layer':>10}\n" + "-" * (len(head) + 10))
    for r in result["dram"]:
        per_layer = f"{r['per_layer_us_median']:>10.0f}" if "per_layer_us_median" in r else ""
        print(f"{r['shape']:<12}{r['op']:<8}{r['bytes'] / 2**20:>6.0f}{r['median_s'] * 1e3:>9.1f}{r['median_gbps']:>9.2f}"
              f"{r['best_gbps']:>10.2f}{r['ratio_median']:>10.2f}{r['ratio_best']:>11.2f}{per_layer}")  # fmt: skip
    z = result["zmq"]
    print(f"\nZMQ Ping/Pong round trip ({z['count']} pings): median {z['median_us']:.0f} us, "
          f"p99 {z['p99_us']:.0f} us, min {z['min_us']:.0f} us, max {z['max_us']:.0f} us")  # fmt: skip
    t = result["read_target"]
    worst = min(t["checks"], key=lambda c: c["ratio_median"])
    print(f"NVMe read target (>= {t['target_ratio']:.0%} of raw, medians): {'MET' if t['met'] else 'MISSED'}; "
          f"lowest {worst['ratio_median']:.2f} ({worst['shape']} {worst['variant']})")  # fmt: skip


def plot(result: dict[str, object], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - only the plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [3, 2, 1.4]})
    for ax, rows, group_keys, bar_key, title in (
        (axes[0], result["nvme"], ("shape", "op"), "variant", "NVMe (bars: median, whisker: best)"),
        (axes[1], result["dram"], ("shape",), "op", "DRAM pool copies"),
    ):
        groups = list(dict.fromkeys(tuple(r[k] for k in group_keys) for r in rows))
        bars = list(dict.fromkeys(r[bar_key] for r in rows))
        width = 0.8 / len(bars)
        for i, bar in enumerate(bars):
            sel = {tuple(r[k] for k in group_keys): r for r in rows if r[bar_key] == bar}
            xs = [g + i * width for g, key in enumerate(groups) if key in sel]
            med = [sel[key]["median_gbps"] for key in groups if key in sel]
            best = [sel[key]["best_gbps"] - sel[key]["median_gbps"] for key in groups if key in sel]
            ax.bar(xs, med, width, label=bar, yerr=[[0] * len(best), best], capsize=2)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], ["\n".join(key) for key in groups])
        ax.set_ylabel("GB/s")
        ax.set_title(title)
        ax.legend(fontsize=8)
    samples_us = result["zmq"]["samples_us"]
    axes[2].hist(samples_us, bins=np.geomspace(min(samples_us), max(samples_us) * 1.01, 50))
    axes[2].set_xscale("log")
    axes[2].set_xlabel("round trip (us, log scale)")
    axes[2].set_title(f"ZMQ ping: median {result['zmq']['median_us']:.0f} us, p99 {result['zmq']['p99_us']:.0f} us")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main --------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.tier_io", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=REPO_ROOT / "runs", help="parent directory on the disk to test (default: runs/)")
    parser.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"), help="tmpfs parent directory for the DRAM pool")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: runs/io-<timestamp>)")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["llama3-8b", "qwen2-0.5b"])
    parser.add_argument("--num-pages", type=int, default=None, help="pages per operation (default: per shape)")
    parser.add_argument("--repeats", type=int, default=9, help="measured rounds per shape (after one warm-up round)")
    parser.add_argument("--threads", type=int, default=4, help="I/O threads of the store, the worker and the baseline")
    parser.add_argument("--raw-chunk-mib", type=int, default=4, help="bytes per raw O_DIRECT call, MiB")
    parser.add_argument("--pages-per-job", type=int, default=8, help="pages per job in the 'jobs' variant")
    parser.add_argument("--pings", type=int, default=200, help="Ping/Pong round trips per round")
    parser.add_argument("--prefault-bounce", action="store_true",
                        help="add variant 'store+pop': the store with MAP_POPULATE bounce buffers (the proposed nvme.py fix)")
    parser.add_argument("--torch-threads", type=int, default=1, help="intra-op threads for the DRAM copies")
    args = parser.parse_args(argv)
    if min(args.repeats, args.threads, args.raw_chunk_mib, args.pages_per_job, args.pings, args.torch_threads) < 1:
        parser.error("counts must be >= 1")
    return args


def measure_shape(shape: Shape, args: argparse.Namespace, shm_dir: Path, nvme_dir: Path) -> tuple[list, list, list, dict]:
    """NVMe + ZMQ, then DRAM, for one shape; returns its rows, ping samples and direct-I/O flags."""
    case = NvmeCase(shape, args, shm_dir, nvme_dir, str(file_system_of(nvme_dir)["device"]))
    try:
        print(f"{shape.label}: {shape.num_pages} pages x {case.layout.page_bytes} B (slot {case.slot_bytes} B), "
              f"variants {', '.join(case.variants)} ...", flush=True)  # fmt: skip
        nvme_s, round_trips_us = measure_nvme(case, args.repeats, args.pings)
        dram_s = measure_dram(case, args.repeats)
        direct = {name: raw.direct_io for name, raw in case.raws.items()} | {name: s.direct_io for name, s in case.stores.items()}
        return nvme_rows(case, nvme_s), dram_rows(case, dram_s), round_trips_us, direct
    finally:
        case.close()


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out_dir = args.out or REPO_ROOT / "runs" / f"io-{stamp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    args.dir.mkdir(parents=True, exist_ok=True)
    shapes = [SHAPES[name] if not args.num_pages else Shape(**(asdict(SHAPES[name]) | {"num_pages": args.num_pages})) for name in args.shapes]
    check_memory(shapes, args.shm_dir)
    args.kvikio = kvikio_unusable_reason()  # None = usable
    fs = file_system_of(args.dir)
    print(f"NVMe directory {args.dir}: {fs['fstype']} on {fs['device']} (mount {fs['mountpoint']}); kvikio: {args.kvikio or 'usable'}")
    if fs["tmpfs"]:
        print("WARNING: tmpfs: O_DIRECT here measures memory copies, not a disk")
    nvme_dir = Path(tempfile.mkdtemp(prefix="hiradix-io-", dir=args.dir))
    shm_dir = Path(tempfile.mkdtemp(prefix="hiradix-io-", dir=args.shm_dir))
    nvme, dram, round_trips_us, direct = [], [], [], {}
    try:
        for shape in shapes:
            rows_nvme, rows_dram, samples_us, direct = measure_shape(shape, args, shm_dir, nvme_dir)
            nvme, dram, round_trips_us = nvme + rows_nvme, dram + rows_dram, round_trips_us + samples_us
    finally:
        shutil.rmtree(nvme_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    meta = machine() | {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join([os.path.relpath(sys.executable, REPO_ROOT), "-m", "bench.micro.tier_io", *(argv if argv is not None else sys.argv[1:])]),
        "file_system": fs, "direct_io": direct, "kvikio": args.kvikio or "usable", "threads": args.threads,
        "raw_chunk_mib": args.raw_chunk_mib, "pages_per_job": args.pages_per_job, "repeats": args.repeats,
        "shapes": {shape.label: asdict(shape) for shape in shapes},
    }  # fmt: skip
    result = {"meta": meta, "nvme": nvme, "dram": dram, "zmq": zmq_summary(round_trips_us) | {"samples_us": round_trips_us}}
    result["read_target"] = read_target(nvme)
    print_tables(result)
    (out_dir / "io.json").write_text(json.dumps(result, indent=1))
    plot(result, out_dir / "io.png")
    print(f"\nwrote {out_dir / 'io.json'} and {out_dir / 'io.png'}")
    return result


if __name__ == "__main__":
    if not __package__:
        sys.exit("run it as a module from the repository root: .venv/bin/python -m bench.micro.tier_io")
    main()
