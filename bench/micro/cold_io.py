"""NVMe and store write and read throughput per cold page format, through the real I/O worker (issue 21).

Run from the repository root::

    .venv/bin/python -m bench.micro.cold_io                        # ~1 minute on 2 cores
    .venv/bin/python -m bench.micro.cold_io --dir /mnt/nvme/tmp --shapes llama3-8b --formats exact,int4
    .venv/bin/python -m bench.micro.cold_io --tiers nvme,store     # also a loopback Mooncake Store

Per shape (``bench.micro.tier_io.SHAPES``: a page = ``page_size`` tokens of all layers, K and V,
bf16) and per format of ``--hiradix-cold-format`` (``exact``, ``fp8``, ``int4``), one I/O worker
process is started exactly as the server starts it (``hiradix.runtime.assembly.start_worker``): its
NVMe slot file sized for the encoded page (``PageCodec.encoded_bytes``; ``exact`` = today's page
bytes, no codec), ``WorkerSpec(cold_format=fmt, cold_tiers=("nvme", "store"))``. With ``store`` in
``--tiers``, a loopback Mooncake Store (``hiradix.testing.mooncake.MooncakeCluster``: a master and one
holder big enough for every round's objects) is the worker's store too; a store write is one
``PutStore`` of fresh keys (the encoded page + hiradix's trailer per object), a read a ``GetStore`` of
the keys just written. The DRAM pool holds
``randn`` values (finite, as KV is). Each round, after one discarded warm-up round, formats in an
order rotated every round, variants as in ``tier_io``:

  worker  one ``StorePages`` (write: encode in the worker, then the disk) / ``LoadPages`` (read: the
          disk, then decode into DRAM) job of all pages, ``submit`` to ``JobDone``;
  jobs    the same pages as jobs of ``--pages-per-job`` pages submitted together (the worker's
          ``--threads`` threads encode/decode in parallel).

Reported: tokens/s (pages x page_size / median seconds), GB/s of source (DRAM) bytes and of disk
bytes, and the ratio of tokens/s to ``exact``'s. ``O_DIRECT`` bypasses this machine's page cache (a
virtual disk may still be cached by its host). Writes ``cold_io.json`` to ``runs/cold-io-<time>/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from bench.micro.tier_io import REPO_ROOT, SHAPES, Shape, file_system_of, rotated
from hiradix.dataplane.kv_codec import FORMATS, PageCodec
from hiradix.io.client import IOWorkerClient
from hiradix.io.protocol import GetStore, LoadPages, PutStore, StorePages, WorkerSpec
from hiradix.testing.mooncake import MooncakeCluster
from hiradix.tiers.dram import DramPool
from hiradix.tiers.nvme import NvmeStore

GB = 1e9  # bytes
VARIANTS = ("worker", "jobs")
TIERS = ("nvme", "store")


class FormatCase:
    """One shape's DRAM pool and one I/O worker per format; ``run(fmt, op, variant, tier)`` times one operation."""

    def __init__(self, shape: Shape, formats: list[str], args: argparse.Namespace, shm_dir: Path, nvme_dir: Path,
                 cluster: MooncakeCluster | None = None):
        self.shape, self.layout = shape, shape.layout()
        n = shape.num_pages
        self.pool = DramPool.create(self.layout, n, shm_dir / shape.label)
        self.pool.tensor.view(self.layout.dtype).copy_(torch.randn(self.pool.tensor.view(self.layout.dtype).shape,
                                                                   generator=torch.Generator().manual_seed(0)))
        self.encoded_bytes, self.slot_bytes, self.clients = {}, {}, {}
        self.pages_per_job = min(args.pages_per_job, n)
        self._job_id = 0
        self._keys: dict[str, list[str]] = {}  # format -> the keys its last store write put
        for fmt in formats:
            disk_page = _encoded(shape, fmt)
            store_dir = nvme_dir / f"{shape.label}-{fmt}"
            store = NvmeStore.create(store_dir, disk_page, n, "posix", args.threads)
            self.encoded_bytes[fmt], self.slot_bytes[fmt] = disk_page, store.slot_bytes
            store.close()  # the worker owns the file, as in the server
            spec = WorkerSpec(
                dram_path=str(self.pool.path), layout=self.layout.to_json(), num_dram_pages=n, nvme_dir=str(store_dir),
                num_nvme_slots=n, page_bytes=self.layout.page_bytes, io_backend="posix",
                socket_dir=str(shm_dir / f"sock-{fmt}"), threads=args.threads, parent_pid=os.getpid(),
                cold_format=fmt, cold_tiers=() if fmt == "exact" else TIERS,
                store_backend="mooncake" if cluster else "", store_config=cluster.config_json() if cluster else "",
            )  # fmt: skip
            self.clients[fmt] = IOWorkerClient(spec)
            self.clients[fmt].start()

    def run(self, fmt: str, op: str, variant: str, tier: str = "nvme") -> float:
        """Seconds for one ``op`` ("write" or "read") of all pages in ``fmt`` through ``variant``
        to or from ``tier`` ("nvme" or "store"; a store read gets the keys of the last write).

        Raises:
            RuntimeError: a job failed or the worker died.
        """
        n, client = self.shape.num_pages, self.clients[fmt]
        per_job = n if variant == "worker" else self.pages_per_job
        if tier == "store" and op == "write":
            self._job_id += 1
            self._keys[fmt] = [f"coldio-{fmt}-{self._job_id}-{i}" for i in range(n)]
        start_s = time.perf_counter()
        waiting = set()
        for lo in range(0, n, per_job):
            self._job_id += 1
            ids = list(range(lo, min(lo + per_job, n)))
            client.submit(self._job(fmt, op, tier, ids))
            waiting.add(self._job_id)
        while waiting:
            for done in client.wait(timeout_s=60.0):
                if done.error or not all(done.ok):
                    raise RuntimeError(f"{fmt} {op} job {done.job_id} failed: {done.error or done.ok}")
                waiting.discard(done.job_id)
            if waiting and not client.check_alive():
                raise RuntimeError(f"the {fmt} I/O worker died")
        return time.perf_counter() - start_s

    def _job(self, fmt: str, op: str, tier: str, ids: list[int]):
        if tier == "nvme":
            return StorePages(self._job_id, ids, ids) if op == "write" else LoadPages(self._job_id, ids, ids)
        keys = [self._keys[fmt][i] for i in ids]
        return PutStore(self._job_id, ids, keys) if op == "write" else GetStore(self._job_id, keys, ids)

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        self.pool.close()
        self.pool.unlink()


def measure(case: FormatCase, formats: list[str], tiers: list[str], repeats: int) -> dict[tuple, list[float]]:
    """Seconds per (tier, format, op, variant); per variant a write then a read (the read finds
    what the write just wrote), formats in an order rotated every round."""
    seconds: dict[tuple, list[float]] = {}
    for round_ in range(repeats + 1):
        for tier in tiers:
            for variant in VARIANTS:
                for fmt in rotated(list(formats), round_):
                    for op in ("write", "read"):
                        elapsed_s = case.run(fmt, op, variant, tier)
                        if round_:
                            seconds.setdefault((tier, fmt, op, variant), []).append(elapsed_s)
    return seconds


def rows_of(case: FormatCase, seconds: dict[tuple, list[float]]) -> list[dict[str, object]]:
    """One row per (tier, format, op, variant): medians and bests, tokens/s, GB/s of source and
    tier bytes (``disk_bytes``: NVMe slots, or encoded pages for the store, trailers not counted)."""
    n, ps = case.shape.num_pages, case.shape.page_size
    rows = []
    for (tier, fmt, op, variant), samples_s in seconds.items():
        med, best = statistics.median(samples_s), min(samples_s)
        tier_page = case.slot_bytes[fmt] if tier == "nvme" else case.encoded_bytes[fmt]
        rows.append({"shape": case.shape.label, "tier": tier, "format": fmt, "op": op, "variant": variant,
                     "tokens": n * ps, "source_bytes": n * case.layout.page_bytes,
                     "disk_bytes": n * tier_page, "encoded_page_bytes": case.encoded_bytes[fmt],
                     "median_s": med, "best_s": best, "tokens_per_s_median": n * ps / med, "tokens_per_s_best": n * ps / best,
                     "source_gbps_median": n * case.layout.page_bytes / med / GB,
                     "disk_gbps_median": n * tier_page / med / GB, "samples_s": samples_s})
    for r in rows:
        ref = next((x for x in rows if x["format"] == "exact" and all(x[k] == r[k] for k in ("tier", "op", "variant"))),
                   None)  # fmt: skip
        r["vs_exact"] = r["tokens_per_s_median"] / ref["tokens_per_s_median"] if ref else None
    return rows


def _encoded(shape: Shape, fmt: str) -> int:
    layout = shape.layout()
    return layout.page_bytes if fmt == "exact" else PageCodec(layout, fmt).encoded_bytes


def print_table(rows: list[dict[str, object]]) -> None:
    head = (f"{'shape':<12}{'tier':<6}{'format':<7}{'op':<7}{'variant':<8}{'enc page B':>11}{'med ms':>9}{'tok/s med':>12}"
            f"{'tok/s best':>12}{'src GB/s':>9}{'tier GB/s':>10}{'vs exact':>9}")
    print(head + "\n" + "-" * len(head))
    order = lambda r: (r["shape"], r["tier"], r["op"] != "write", r["variant"], FORMATS.index(r["format"]))  # noqa: E731
    for r in sorted(rows, key=order):
        vs = "-" if r["vs_exact"] is None else f"{r['vs_exact']:.2f}"
        print(f"{r['shape']:<12}{r['tier']:<6}{r['format']:<7}{r['op']:<7}{r['variant']:<8}{r['encoded_page_bytes']:>11}"
              f"{1e3 * r['median_s']:>9.1f}{r['tokens_per_s_median']:>12,.0f}{r['tokens_per_s_best']:>12,.0f}"
              f"{r['source_gbps_median']:>9.2f}{r['disk_gbps_median']:>10.2f}{vs:>9}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=REPO_ROOT / "runs", help="parent directory on the disk to test")
    p.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"), help="tmpfs parent directory for the DRAM pool")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: runs/cold-io-<timestamp>)")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["llama3-8b"])
    p.add_argument("--formats", default=",".join(FORMATS), help="comma list of formats")
    p.add_argument("--tiers", default="nvme", help="comma list of tiers: nvme, store (a loopback Mooncake Store)")
    p.add_argument("--num-pages", type=int, default=None, help="pages per operation (default: per shape)")
    p.add_argument("--repeats", type=int, default=5, help="measured rounds (after one warm-up round)")
    p.add_argument("--threads", type=int, default=4, help="the worker's I/O threads")
    p.add_argument("--pages-per-job", type=int, default=8, help="pages per job in the 'jobs' variant")
    args = p.parse_args(argv)
    for fmt in args.formats.split(","):
        if fmt not in FORMATS:
            p.error(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    for tier in args.tiers.split(","):
        if tier not in TIERS:
            p.error(f"unknown tier {tier!r}; choose from {', '.join(TIERS)}")
    if min(args.repeats, args.threads, args.pages_per_job) < 1:
        p.error("counts must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    formats = args.formats.split(",")
    out_dir = args.out or REPO_ROOT / "runs" / f"cold-io-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    out_dir.mkdir(parents=True, exist_ok=True)
    args.dir.mkdir(parents=True, exist_ok=True)
    fs = file_system_of(args.dir)
    print(f"NVMe directory {args.dir}: {fs['fstype']} on {fs['device']}" + ("  WARNING: tmpfs" if fs["tmpfs"] else ""))
    nvme_dir = Path(tempfile.mkdtemp(prefix="hiradix-coldio-", dir=args.dir))
    shm_dir = Path(tempfile.mkdtemp(prefix="hiradix-coldio-", dir=args.shm_dir))
    tiers = args.tiers.split(",")
    shapes = [SHAPES[name] if not args.num_pages else Shape(**(asdict(SHAPES[name]) | {"num_pages": args.num_pages}))
              for name in args.shapes]  # fmt: skip
    cluster = None
    if "store" in tiers:  # every write puts fresh keys: room for all of them, trailers and slack
        written = max(s.num_pages * sum(_encoded(s, f) for f in formats) for s in shapes) * len(VARIANTS)
        cluster = MooncakeCluster(holder_segment_bytes=int(1.25 * written * (args.repeats + 1)) + (64 << 20),
                                  log_dir=out_dir / "mooncake").start()  # fmt: skip
    rows: list[dict[str, object]] = []
    try:
        for shape in shapes:
            case = FormatCase(shape, formats, args, shm_dir, nvme_dir, cluster)
            try:
                rows += rows_of(case, measure(case, formats, tiers, args.repeats))
            finally:
                case.close()
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(nvme_dir, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    print_table(rows)
    result = {"meta": {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"), "file_system": fs,
                       "args": {k: str(v) for k, v in vars(args).items()}, "nproc": os.cpu_count()}, "rows": rows}
    (out_dir / "cold_io.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {out_dir / 'cold_io.json'}")
    return result


if __name__ == "__main__":
    if not __package__:
        sys.exit("run it as a module from the repository root: .venv/bin/python -m bench.micro.cold_io")
    main()
