"""Check 2 of ``scripts/gpu_check``: NVMe -> HBM reads of the slot file, against raw reads.

``NvmeStore`` slots (Llama-3-8B pages of 2 MiB, 1 GiB in all) are written on the local disk,
then read back cold (fsync + ``posix_fadvise(DONTNEED)`` first; O_DIRECT reads bypass the page
cache anyway) in a shuffled order by :meth:`NvmeStore.read_slots_to_device` into GPU memory:

- ``store_to_device_posix``: verified POSIX reads into pinned host pages, then H2D;
- ``store_to_device_kvikio``: KvikIO ``CuFile.pread`` into device memory (GPUDirect Storage
  where present, KvikIO's compatibility mode otherwise: see ``kvikio``), verified on the host.

Limits, the same bytes with nothing verified or placed: ``raw_posix_read`` (O_DIRECT
``preadv`` of the whole file in 8 MiB pieces on ``io_threads`` threads into host memory) and
``raw_kvikio_to_gpu`` (one ``CuFile.pread`` of the whole file into device memory). Store GB/s
count payload bytes, raw GB/s the bytes read (slots are 4 KiB longer than their payload).
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from gpu_checks.common import Ctx, _device, _gbps, _llama_cfg, _median, _r, _run_cmd, fs_info, pick_disk_dir

RAW_PIECE_BYTES = 8 << 20


def _drop_cache(path: Path) -> str:
    """Push the file out of the page cache so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return "fsync + posix_fadvise(DONTNEED)"


def _kvikio_info(kvikio) -> dict[str, Any]:
    """KvikIO's settings and whether cuFile/GDS is there (every probe guarded)."""
    info: dict[str, Any] = {"version": getattr(kvikio, "__version__", "?")}
    for key in ("compat_mode", "thread_pool_nthreads", "task_size", "gds_threshold", "bounce_buffer_size",
                "auto_direct_io_read"):
        try:
            info[key] = str(kvikio.defaults.get(key))
        except Exception as exc:
            info[key] = f"? ({type(exc).__name__}: {str(exc)[:80]})"
    try:
        info["compat_mode_preferred"] = bool(kvikio.defaults.is_compat_mode_preferred())
    except Exception as exc:
        info["compat_mode_preferred"] = f"? ({type(exc).__name__}: {str(exc)[:80]})"
    try:
        import kvikio.cufile_driver as drv

        info["libcufile_version"] = str(drv.libcufile_version())
        for key in ("is_gds_available", "allow_compat_mode", "major_version", "minor_version"):
            try:
                info[f"cufile_{key}"] = str(drv.get(key))
            except Exception as exc:
                info[f"cufile_{key}"] = f"? ({type(exc).__name__}: {str(exc)[:100]})"
    except Exception as exc:
        info["cufile_driver"] = f"? ({type(exc).__name__}: {str(exc)[:100]})"
    return info


def raw_posix_read(path: Path, nbytes: int, threads: int) -> int:
    """Read ``nbytes`` of ``path`` with O_DIRECT (buffered where refused) in ``RAW_PIECE_BYTES``
    pieces on ``threads`` threads, into page-aligned buffers that are thrown away; bytes read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    bufs = [mmap.mmap(-1, RAW_PIECE_BYTES) for _ in range(threads)]

    def part(k: int) -> int:
        buf, got = bufs[k], 0
        for off in range(k * RAW_PIECE_BYTES, nbytes, threads * RAW_PIECE_BYTES):
            size = min(RAW_PIECE_BYTES, nbytes - off)
            size = -(-size // 4096) * 4096  # O_DIRECT lengths are block multiples
            got += min(os.preadv(fd, [memoryview(buf)[:size]], off), nbytes - off)
        return got

    try:
        with ThreadPoolExecutor(threads) as pool:
            return sum(pool.map(part, range(threads)))
    finally:
        os.close(fd)
        for b in bufs:
            b.close()


def _timed(reps: int, ctx: Ctx, prepare: Callable[[], None], run: Callable[[], Any]) -> tuple[list[float], Any]:
    """``reps`` cold runs (``prepare`` first, untimed); the times in s and the last result."""
    times, out = [], None
    for i in range(reps):
        if i and ctx.left() < 20:
            break
        prepare()
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    return times, out


def check_nvme(ctx: Ctx) -> None:
    import torch

    from hiradix.dataplane.layout import KVLayout
    from hiradix.tiers.nvme import NvmeStore, slot_bytes_for
    from hiradix.tiers.nvme_device import choose_device_read_path, gds_status

    dev = _device(ctx)
    if dev is None:
        return
    res = ctx.result
    cfg = _llama_cfg(ctx.quick)
    layout = KVLayout(cfg["num_layers"], cfg["page_size"], cfg["kv_heads"], cfg["head_dim"], torch.bfloat16)
    pb, sb = layout.page_bytes, slot_bytes_for(layout.page_bytes)
    num = 16 if ctx.quick else int(ctx.opts.get("nvme_pages") or 512)
    threads = 8
    res.update(page_bytes=pb, slot_bytes=sb, pages=num, payload_MiB=round(num * pb / 2**20, 1), io_threads=threads)
    base, seen = pick_disk_dir(ctx.opts.get("nvme_dir"), num * sb)
    res.update(disk=seen, fs=fs_info(base), df=_run_cmd(["df", "-hT", str(base)])["out"])
    work = Path(tempfile.mkdtemp(prefix="hiradix-gpu-check-", dir=base))
    ctx.log(f"slot file in {work} ({res['fs'].get('fstype')} on {res['fs'].get('device')})")
    st = None
    try:
        src = torch.randint(0, 256, (num, pb), dtype=torch.uint8, device=dev).cpu()  # fast on a GPU
        st = NvmeStore.create(work / "nvme", pb, num, backend="posix", threads=threads)
        t0 = time.perf_counter()
        oks = st.write_slots(list(range(num)), [memoryview(src[i].numpy()) for i in range(num)])
        _drop_cache(st.path)
        wt = time.perf_counter() - t0
        res.update(posix_direct_io=st.direct_io, cache_drop=_drop_cache(st.path),
                   write={"ok": all(oks), "s": _r(wt), "GBps": _gbps(num * pb, wt), "backend": "posix"})
        reason, compat = gds_status()
        res["auto_device_read_path"] = dict(zip(("path", "reason"), choose_device_read_path(reason, compat)))
        if reason is None:
            import kvikio

            res["kvikio"] = _kvikio_info(kvikio)
        ctx.save()
        res["methods"] = _methods(ctx, dev, st, src, reason, num, sb)
        res["status"] = "ok"
    finally:
        if st is not None:
            st.close()
        shutil.rmtree(work, ignore_errors=True)


def _methods(ctx: Ctx, dev, st, src, kvikio_reason, num: int, sb: int) -> dict[str, Any]:
    """Every read method, each verified where it places data; GB/s and shares of the raw limits."""
    import numpy as np
    import torch

    reps = 1 if ctx.quick else 3
    total_raw, payload = num * sb, num * st.page_bytes
    order = [int(i) for i in np.random.default_rng(7).permutation(num)]
    want = src[order].to(dev)
    methods: dict[str, Any] = {}

    def drop() -> None:
        _drop_cache(st.path)

    times, got = _timed(reps, ctx, drop, lambda: raw_posix_read(st.path, total_raw, st.threads))
    methods["raw_posix_read"] = {"status": "ok", "bytes": got, "median_s": _r(_median(times), 4),
                                 "GBps": _gbps(total_raw, _median(times))}
    for path in ("posix", "kvikio"):
        name = f"store_to_device_{path}"
        if path == "kvikio" and kvikio_reason is not None:
            methods[name] = {"status": "skipped", "reason": kvikio_reason}
            continue
        if ctx.left() < 12:
            methods[name] = {"status": "skipped", "reason": f"time budget: {ctx.left():.0f}s left"}
            continue
        try:
            dst = torch.empty((num, st.page_bytes), dtype=torch.uint8, device=dev)

            def prepare() -> None:
                dst.fill_(0xA5)
                drop()

            times, ok = _timed(reps, ctx, prepare, lambda: _sync_after(dev, st.read_slots_to_device(order, dst, path)))
            methods[name] = {"status": "ok", "verified": all(ok) and torch.equal(dst, want),
                             "median_s": _r(_median(times), 4), "GBps": _gbps(payload, _median(times))}
        except Exception as exc:
            methods[name] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}",
                             "traceback": traceback.format_exc()[-1200:]}
        ctx.save()
    methods["raw_kvikio_to_gpu"] = _raw_kvikio(ctx, dev, st, kvikio_reason, reps, total_raw)
    for name, limit in (("store_to_device_posix", "raw_posix_read"), ("store_to_device_kvikio", "raw_kvikio_to_gpu")):
        m, lim = methods.get(name, {}), methods.get(limit, {})
        if m.get("status") == "ok" and lim.get("status") == "ok":
            m["share_of_raw"] = _r(m["GBps"] / lim["GBps"], 3)
            m["raw_limit"] = limit
    return methods


def _sync_after(dev, value):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize()
    return value


def _raw_kvikio(ctx: Ctx, dev, st, kvikio_reason, reps: int, total: int) -> dict[str, Any]:
    """One ``CuFile.pread`` of the whole slot file into device memory (nothing verified)."""
    import torch

    if kvikio_reason is not None:
        return {"status": "skipped", "reason": kvikio_reason}
    if ctx.left() < 10:
        return {"status": "skipped", "reason": f"time budget: {ctx.left():.0f}s left"}
    try:
        import cupy as cp
        import kvikio

        gpu = torch.empty(total, dtype=torch.uint8, device=dev)
        f = kvikio.CuFile(st.path, "r")
        try:
            times, got = _timed(reps, ctx, lambda: _drop_cache(st.path),
                                lambda: _sync_after(dev, f.pread(cp.asarray(gpu), total, 0).get()))
            direct = bool(f.is_direct_io_supported())
        finally:
            f.close()
        return {"status": "ok", "bytes": int(got), "direct_io_supported": direct,
                "median_s": _r(_median(times), 4), "GBps": _gbps(total, _median(times))}
    except Exception as exc:
        return {"status": "failed", "reason": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-1200:]}
