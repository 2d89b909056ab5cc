"""Check 1 of ``scripts/gpu_check``: DRAM -> HBM per layer, overlapped with a forward.

A Llama-3-8B-sized layer (GEMMs of hidden 4096 on 2048 tokens) runs for 32 layers while that
layer's KV pages (a 16k-token prefix, 2 GiB in all) load DRAM -> HBM on a side stream through
the production path: ``HostMover`` + ``LayerwiseLoader`` with SGLang's ``LayerDoneCounter`` (a
stand-in of the same events when SGLang is not installed, named in the results), the forward
waiting per layer with ``wait_until``. The DRAM pools are ``DramPool.create_anonymous`` (the
server's memfd pool), pinned with ``DramPool.pin_for_cuda`` or left pageable. Variants:

- ``gather_pinned``, ``runs_pinned``, ``host_pageable``: the three DRAM -> HBM paths of
  ``hiradix.dataplane.device_copy`` (which one a server uses is in ``auto_path``);
- ``limit_memcpy_pinned``: the limit, one plain pinned ``cudaMemcpyAsync`` (``copy_`` with
  ``non_blocking=True``) of the same bytes per layer, already contiguous, no gather or scatter.

Per variant: load alone (ms, GB/s, share of the limit's GB/s), overlapped with the compute,
exposed load = overlapped - compute, as a share of the load time (the ideal is
``max(0, load - compute) / load``), the host time of ``start_loading`` and bit-exactness.
Plus the HBM -> DRAM store of the same pages (``store_pages_async``) against one D2H copy.
"""

from __future__ import annotations

import math
import time
import traceback
from typing import Any, Callable

from gpu_checks.common import Ctx, _device, _gbps, _llama_cfg, _median, _r, _sync, ensure_layer_done_counter


class _Variant:
    """How one variant starts a batch's load (returns the producer index) and drains it."""

    def __init__(self, start: Callable[[], int], drain: Callable[[], None], loader: Any, path: str):
        self.start, self.drain, self.loader, self.path = start, drain, loader, path


def _setup(ctx: Ctx, dev, cfg: dict[str, Any]) -> dict[str, Any]:
    """Pools, device buffers, ids and slots; fills the pools with random bits."""
    import torch

    from hiradix.dataplane.layout import KVLayout
    from hiradix.tiers.dram import DramPool

    L, H, D, ps = cfg["num_layers"], cfg["kv_heads"], cfg["head_dim"], cfg["page_size"]
    layout = KVLayout(L, ps, H, D, torch.bfloat16)
    n = cfg["prefix_tokens"] // ps
    pool_pages = n + n // 4  # the pool is larger, so the loaded pages are scattered in it
    dev_pages = n + -(-cfg["tokens"] // ps) + 8
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randperm(pool_pages, generator=gen)[:n].tolist()
    dev_page_ids = torch.randperm(dev_pages, generator=gen)[:n]
    slots = (dev_page_ids[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1).to(dev)
    t = time.time()
    pinned = DramPool.create_anonymous(layout, pool_pages)
    pageable = DramPool.create_anonymous(layout, pool_pages)
    flat = pinned.tensor.view(-1)
    for s in range(0, flat.numel(), 1 << 26):  # random bits made on the device (fast), copied down
        part = torch.randn(min(1 << 26, flat.numel() - s), device=dev, dtype=layout.dtype)
        flat[s : s + part.numel()].copy_(part.cpu())
    pageable.tensor.copy_(pinned.tensor)
    ctx.result["setup_pools_s"] = _r(time.time() - t, 2)
    t = time.time()
    ctx.result["pinned"] = pinned.pin_for_cuda() if dev.type == "cuda" else False
    ctx.result["pin_failure"] = pinned.pin_failure
    ctx.result["cuda_host_register_s"] = _r(time.time() - t, 3)
    rows = dev_pages * ps
    k = [torch.empty(rows, H, D, device=dev, dtype=layout.dtype) for _ in range(L)]
    v = [torch.empty(rows, H, D, device=dev, dtype=layout.dtype) for _ in range(L)]
    return dict(layout=layout, n=n, pool_pages=pool_pages, ids=ids, slots=slots, pinned=pinned,
                pageable=pageable, k=k, v=v)


def _variants(dev, s: dict[str, Any], counter) -> dict[str, _Variant]:
    """The production paths (through HostMover) and the memcpy limit (through the loader alone)."""
    import types

    import torch

    from hiradix.core.ledger import Kind, Transfer
    from hiradix.dataplane.layerwise import LayerwiseLoader
    from hiradix.dataplane.movers import HostMover

    kv = types.SimpleNamespace(k_buffer=s["k"], v_buffer=s["v"])
    L, n = s["layout"].num_layers, s["n"]
    out: dict[str, _Variant] = {}

    def via_mover(pool, path: str) -> _Variant:
        loader = LayerwiseLoader(L, dev, counter)
        mover = HostMover(kv, pool, loader, load_path=path)

        def start() -> int:
            mover.promote(Transfer(op_id=1, kind=Kind.PROMOTE, nodes=[], src_ids=s["ids"], dst_ids=[],
                                   hbm_parts=[s["slots"]]))
            return mover.start_loading()

        def drain() -> None:
            mover.flush()
            mover.drop_pending()

        return _Variant(start, drain, loader, mover.load_path)  # the path it really took

    if dev.type == "cuda" and s["pinned"].cuda_pinned:
        out["gather_pinned"] = via_mover(s["pinned"], "gather")
        out["runs_pinned"] = via_mover(s["pinned"], "runs")
    elif dev.type != "cuda":  # the CPU dry run: the same code, CPU tensors
        out["gather_pinned"] = via_mover(s["pageable"], "gather")
        out["runs_pinned"] = via_mover(s["pageable"], "runs")
    out["host_pageable"] = via_mover(s["pageable"], "host")
    elems = s["layout"].layer_page_bytes // 2 * n
    stage = torch.empty((L, elems), dtype=torch.bfloat16, pin_memory=dev.type == "cuda")  # bytes do not matter
    target = torch.empty((L, elems), dtype=torch.bfloat16, device=dev)
    loader = LayerwiseLoader(L, dev, counter)

    def limit_start() -> int:
        loader.submit(1, lambda layer: target[layer].copy_(stage[layer], non_blocking=True))
        return loader.start()

    def limit_drain() -> None:
        loader.flush()
        loader.finished()
        loader.reset()

    out["limit_memcpy_pinned"] = _Variant(limit_start, limit_drain, loader, "memcpy")
    s["limit_buffers"] = (stage, target)
    return out


def _verify(s: dict[str, Any]) -> bool:
    """Every loaded row equals its DRAM source, bit for bit (the CPU path computes the reference)."""
    import torch

    from hiradix.dataplane.layout import _rows

    layout, n, ps = s["layout"], s["n"], s["layout"].page_size
    src = s["pageable"].tensor.view(s["pool_pages"], layout.num_layers, 2, -1)
    ids = torch.as_tensor(s["ids"])
    slots = s["slots"]
    for layer in range(layout.num_layers):
        for half, bufs in ((0, s["k"]), (1, s["v"])):
            want = src[ids, layer, half].reshape(n * ps, -1).view(torch.int16)
            got = _rows(bufs[layer]).index_select(0, slots).cpu().view(torch.int16)
            if not torch.equal(got, want):
                return False
    return True


def _compute(dev, cfg: dict[str, Any]):
    """The per-layer GEMMs of a Llama layer (QKV, O, gate_up, down) on ``tokens`` tokens."""
    import torch
    import torch.nn.functional as F

    hid, inter, T, Hq, H, D = (cfg[k] for k in ("hidden", "intermediate", "tokens", "q_heads", "kv_heads", "head_dim"))
    dtype = torch.bfloat16

    def w(a: int, b: int) -> torch.Tensor:
        return (torch.randn(a, b, device=dev, dtype=torch.float32) / math.sqrt(a)).to(dtype)

    qkv_w, o_w, gu_w, dn_w = w(hid, (Hq + 2 * H) * D), w(Hq * D, hid), w(hid, 2 * inter), w(inter, hid)
    x = torch.randn(T, hid, device=dev, dtype=dtype)
    y = torch.empty_like(x)
    flops = 2 * T * (hid * (Hq + 2 * H) * D + Hq * D * hid + hid * 2 * inter + inter * hid)

    def layer_compute() -> None:
        qkv = x @ qkv_w
        h = x + qkv[:, : Hq * D] @ o_w  # stands in for attention; the layer waits for its KV all the same
        gu = h @ gu_w
        y.copy_(h + (F.silu(gu[:, :inter]) * gu[:, inter:]) @ dn_w)

    return layer_compute, flops


def _time_load(dev, var: _Variant) -> tuple[float, float]:
    """(load alone ms, start() host ms)."""
    _sync(dev)
    t0 = time.perf_counter()
    var.start()
    t1 = time.perf_counter()
    var.drain()
    _sync(dev)
    return (time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3


def _time_overlap(dev, var: _Variant, layer_compute, num_layers: int) -> tuple[float, float]:
    """(load + forward with per-layer waits ms, start() host ms)."""
    _sync(dev)
    t0 = time.perf_counter()
    producer = var.start()
    t1 = time.perf_counter()
    var.loader.set_consumer(producer)
    for layer in range(num_layers):
        var.loader.wait_until(layer)
        layer_compute()
    _sync(dev)
    t2 = time.perf_counter()
    var.drain()
    return (t2 - t0) * 1e3, (t1 - t0) * 1e3


def _measure(ctx: Ctx, dev, name: str, var: _Variant, s: dict[str, Any], timing: dict[str, Any],
             share_s: float) -> dict[str, Any]:
    """Bit-exactness, then load alone and overlapped, repetitions fitted into ``share_s``."""
    L = s["layout"].num_layers
    v: dict[str, Any] = {"path": var.path}
    is_limit = name.startswith("limit")  # the limit copies other bytes; nothing to verify
    if not is_limit:
        for b in s["k"] + s["v"]:
            b.fill_(float("nan"))
    first_s = _time_load(dev, var)[0] / 1e3
    v["verified_bit_exact"] = True if is_limit else _verify(s)
    runs = int(share_s / (2.2 * first_s + 1e-6))
    reps = max(2, min(timing["reps"], runs - timing["warm"]))
    v["reps_timed"] = reps
    loads = [_time_load(dev, var) for _ in range(reps)]
    for _ in range(timing["warm"]):
        _time_overlap(dev, var, timing["compute"], L)
    over = [_time_overlap(dev, var, timing["compute"], L) for _ in range(reps)]
    load_ms, over_ms = _median([a for a, _ in loads]), _median([a for a, _ in over])
    compute_ms = timing["compute_ms"]
    exposed = over_ms - compute_ms
    v.update(load_alone_ms=_r(load_ms), load_GBps=_gbps(s["load_bytes"], load_ms / 1e3),
             start_call_ms=_r(_median([b for _, b in over])), overlapped_ms=_r(over_ms),
             exposed_load_ms=_r(exposed), exposed_share_of_load=_r(exposed / load_ms, 3),
             ideal_exposed_share=_r(max(0.0, load_ms - compute_ms) / load_ms, 3),
             serial_ms=_r(compute_ms + load_ms), load_alone_all_ms=[_r(a, 2) for a, _ in loads],
             overlapped_all_ms=[_r(a, 2) for a, _ in over])
    if not is_limit:
        for b in s["k"] + s["v"]:
            b.fill_(float("nan"))
        _time_overlap(dev, var, timing["compute"], L)
        v["verified_after_overlap"] = _verify(s)
    v["status"] = "ok"
    return v


def _store_check(dev, s: dict[str, Any]) -> dict[str, Any]:
    """HBM -> pinned DRAM with ``store_pages_async`` vs one D2H copy of the same bytes."""
    import torch

    from hiradix.dataplane.device_copy import store_pages_async

    pool = s["pinned"] if s["pinned"].cuda_pinned else s["pageable"]
    side = torch.cuda.Stream() if dev.type == "cuda" else None
    times, host_ms = [], []
    for _ in range(3):
        _sync(dev)
        t0 = time.perf_counter()
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                copies = store_pages_async(s["k"], s["v"], s["slots"], pool.tensor, s["ids"], s["layout"])
            host_ms.append((time.perf_counter() - t0) * 1e3)
            side.synchronize()
        else:
            copies = store_pages_async(s["k"], s["v"], s["slots"], pool.tensor, s["ids"], s["layout"])
            host_ms.append((time.perf_counter() - t0) * 1e3)
        times.append(time.perf_counter() - t0)
    stage, target = s["limit_buffers"]
    lim = []
    for _ in range(3):
        _sync(dev)
        t0 = time.perf_counter()
        stage.copy_(target, non_blocking=True)
        _sync(dev)
        lim.append(time.perf_counter() - t0)
    return {"status": "ok", "pool": "pinned" if pool is s["pinned"] else "pageable", "d2h_copies": copies,
            "GBps": _gbps(s["load_bytes"], _median(times)), "host_call_ms": _r(_median(host_ms)),
            "limit_d2h_GBps": _gbps(s["load_bytes"], _median(lim)), "share_of_limit": _r(_median(lim) / _median(times), 3)}


def check_layerwise(ctx: Ctx) -> None:
    dev = _device(ctx)
    if dev is None:
        return
    res = ctx.result
    cuda = dev.type == "cuda"
    cfg = _llama_cfg(ctx.quick)
    if ctx.opts.get("prefix_tokens"):
        cfg["prefix_tokens"] = int(ctx.opts["prefix_tokens"])
    res["config"] = dict(cfg)
    counter = None
    if cuda:
        res["layer_done_counter"] = ensure_layer_done_counter()
        from sglang.srt.managers.cache_controller import LayerDoneCounter as counter  # real, or the stand-in
    s = _setup(ctx, dev, cfg)
    layout = s["layout"]
    s["load_bytes"] = layout.num_layers * s["n"] * layout.layer_page_bytes
    res.update(load_bytes_MiB=round(s["load_bytes"] / 2**20, 1), layer_page_bytes=layout.layer_page_bytes)
    res["auto_path"] = _auto_path(dev, s)
    ctx.save()
    try:
        layer_compute, flops = _compute(dev, cfg)
        warm, reps = (1, 2) if ctx.quick else (2, 7)
        for _ in range(warm + 1):
            _time_compute(dev, layer_compute, layout.num_layers)
        compute_ms = _median([_time_compute(dev, layer_compute, layout.num_layers) for _ in range(reps)])
        res.update(compute_alone_ms=_r(compute_ms), compute_GFLOP_per_layer=round(flops / 1e9, 2),
                   compute_TFLOPs=_r(flops * layout.num_layers / (compute_ms / 1e3) / 1e12, 1),
                   reps={"warmup": warm, "timed": reps, "statistic": "median of host wall times, synchronized"})
        timing = dict(compute=layer_compute, compute_ms=compute_ms, warm=warm, reps=reps)
        variants = _variants(dev, s, counter)
        res["variants"] = {}
        for idx, (name, var) in enumerate(variants.items()):
            if ctx.left() < 12:
                res["variants"][name] = {"status": "skipped", "reason": f"time budget: {ctx.left():.0f}s left"}
                continue
            ctx.log(f"variant {name}")
            share = max(4.0, (ctx.left() - 15.0) / (len(variants) - idx))
            try:
                res["variants"][name] = _measure(ctx, dev, name, var, s, timing, share)
            except Exception as exc:
                res["variants"][name] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}",
                                         "traceback": traceback.format_exc()[-1500:]}
                ctx.log(f"variant {name} failed: {exc}")
                if cuda and not _context_alive(res):
                    break
            ctx.save()
        _compare_to_limit(res["variants"])
        if "cuda_context_lost" not in res and ctx.left() > 5:
            res["store"] = _store_check(dev, s)
            res["compute_alone_again_ms"] = _r(_median([_time_compute(dev, layer_compute, layout.num_layers)
                                                        for _ in range(reps)]))
    finally:
        s["pinned"].close()
        s["pageable"].close()
        res["unpinned_at_close"] = not s["pinned"].cuda_pinned
    res["status"] = "ok"


def _time_compute(dev, layer_compute, num_layers: int) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(num_layers):
        layer_compute()
    _sync(dev)
    return (time.perf_counter() - t0) * 1e3


def _auto_path(dev, s: dict[str, Any]) -> dict[str, Any]:
    """The path a server would take here (what ``HostMover`` chooses without ``load_path``)."""
    import types

    from hiradix.dataplane.layerwise import LayerwiseLoader
    from hiradix.dataplane.movers import HostMover
    from hiradix.tiers.pinned import host_pointer_usable_on_device

    if dev.type != "cuda":
        return {"path": "host", "reason": "no CUDA device"}
    kv = types.SimpleNamespace(k_buffer=s["k"], v_buffer=s["v"])
    from sglang.srt.managers.cache_controller import LayerDoneCounter

    mover = HostMover(kv, s["pinned"], LayerwiseLoader(s["layout"].num_layers, dev, LayerDoneCounter))
    return {"path": mover.load_path, "pinned": s["pinned"].cuda_pinned,
            "host_pointer_usable_on_device": host_pointer_usable_on_device(dev.index or 0)}


def _compare_to_limit(variants: dict[str, Any]) -> None:
    """Each variant's load GB/s as a share of the plain pinned memcpy's."""
    lim = variants.get("limit_memcpy_pinned", {})
    if lim.get("status") != "ok":
        return
    for v in variants.values():
        if v.get("status") == "ok":
            v["share_of_memcpy_GBps"] = _r(v["load_GBps"] / lim["load_GBps"], 3)


def _context_alive(res: dict[str, Any]) -> bool:
    import torch

    try:
        torch.cuda.synchronize()
        return True
    except Exception as exc:  # the context is gone: nothing else can run
        res["cuda_context_lost"] = str(exc)
        return False
