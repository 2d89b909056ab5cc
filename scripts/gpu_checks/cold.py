"""Check 4 of ``scripts/gpu_check``: DRAM as a cold tier, pages encoded and decoded on the device.

With ``--hiradix-cold-tiers dram`` the DRAM pool holds ``fp8`` / ``int4`` pages and
``hiradix.dataplane.encoded_mover.EncodedHostMover`` encodes on the device before the HBM -> DRAM
copy and decodes on the device after the DRAM -> HBM copy, so PCIe carries the compressed bytes.
Llama-3-8B-shaped pages (32 layers, 8 KV heads x 128, page 16, bf16; ``--quick``: 2 layers):

- ``codec``: ``PageCodec`` on the device against the same pages on the CPU: share of identical
  encoded bytes, largest decode difference, encode and decode GB/s of source bytes on the device;
- ``mover``: the production path (``EncodedHostMover`` + ``LayerwiseLoader`` with SGLang's
  ``LayerDoneCounter``, a pinned encoded ``DramPool``): backup ``n`` pages, promote them into other
  slots, largest error relative to each page's largest value (bound: fp8 1/16, int4 1/4), promote
  ms next to the exact ``HostMover``'s load of the same pages, and the bytes each moves over PCIe.
"""

from __future__ import annotations

import time
import traceback
import types
from typing import Any

from gpu_checks.common import Ctx, _device, _gbps, _r, _sync, ensure_layer_done_counter

BOUND = {"fp8": 1 / 16, "int4": 1 / 4}  # max |x - x'| / max |x| per layer page, loose


def _setup(dev, quick: bool) -> dict[str, Any]:
    import torch

    from hiradix.dataplane.layout import KVLayout

    L, ps, H, D = (2, 16, 8, 128) if quick else (32, 16, 8, 128)
    n = 16 if quick else 256  # 256 pages = a 4k-token history, 512 MiB exact
    layout = KVLayout(L, ps, H, D, torch.bfloat16)
    rows = 2 * n * ps + 64
    gen = torch.Generator(device=dev).manual_seed(11)
    k = [torch.randn(rows, H, D, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(L)]
    v = [torch.randn(rows, H, D, device=dev, generator=gen, dtype=torch.bfloat16) for _ in range(L)]
    src = torch.arange(n * ps, device=dev)
    dst = torch.arange(n * ps, 2 * n * ps, device=dev)
    return dict(layout=layout, n=n, k=k, v=v, src=src, dst=dst)


def _codec(dev, s: dict[str, Any], fmt: str) -> dict[str, Any]:
    import torch

    from hiradix.dataplane.kv_codec import PageCodec
    from hiradix.dataplane.layout import gather_pages

    layout, n = s["layout"], s["n"]
    codec = PageCodec(layout, fmt)
    pages = gather_pages(s["k"], s["v"], s["src"], layout).view(n, -1).view(torch.uint8)
    _sync(dev)
    t = time.perf_counter()
    enc = codec.encode_pages(pages)
    _sync(dev)
    enc_s = time.perf_counter() - t
    out = torch.empty_like(pages)
    t = time.perf_counter()
    codec.decode_pages(enc, out)
    _sync(dev)
    dec_s = time.perf_counter() - t
    cpu_enc = codec.encode_pages(pages.cpu())
    cpu_out = torch.empty(pages.shape, dtype=torch.uint8)
    codec.decode_pages(cpu_enc, cpu_out)
    diff = (out.cpu().view(layout.dtype).float() - cpu_out.view(layout.dtype).float()).abs().max()
    src_bytes = n * layout.page_bytes
    return {"encoded_page_bytes": codec.encoded_bytes, "ratio": _r(layout.page_bytes / codec.encoded_bytes, 3),
            "device_cpu_identical_byte_share": _r(float((enc.cpu() == cpu_enc).float().mean()), 6),
            "device_cpu_decode_max_abs_diff": _r(float(diff), 6),
            "encode_GBps": _gbps(src_bytes, enc_s), "decode_GBps": _gbps(src_bytes, dec_s)}


def _mover(dev, s: dict[str, Any], fmt: str | None) -> dict[str, Any]:
    """Backup then promote ``n`` pages through the production mover (``fmt`` None: the exact one)."""
    import torch
    from sglang.srt.managers.cache_controller import LayerDoneCounter

    from hiradix.core.ledger import Kind, Transfer
    from hiradix.dataplane.encoded_mover import EncodedHostMover
    from hiradix.dataplane.kv_codec import PageCodec
    from hiradix.dataplane.layerwise import LayerwiseLoader
    from hiradix.dataplane.movers import HostMover
    from hiradix.tiers.dram import DramPool

    layout, n, ps = s["layout"], s["n"], s["layout"].page_size
    codec = PageCodec(layout, fmt) if fmt else None
    pool = DramPool.create_anonymous(layout, n, page_bytes=codec.encoded_bytes if codec else None)
    try:
        pinned = pool.pin_for_cuda() if dev.type == "cuda" else False
        kv = types.SimpleNamespace(k_buffer=s["k"], v_buffer=s["v"])
        loader = LayerwiseLoader(layout.num_layers, dev, LayerDoneCounter if dev.type == "cuda" else None)
        mover = EncodedHostMover(kv, pool, loader, codec) if codec else HostMover(kv, pool, loader)
        ids, first = list(range(n)), s["src"][::ps].tolist()
        backup = Transfer(1, Kind.BACKUP, [], first, ids, hbm_parts=[s["src"]], dst_of=dict(zip(first, ids)))
        mover.backup(backup)
        mover.flush()
        dst_first = s["dst"][::ps].tolist()
        promote = Transfer(2, Kind.PROMOTE, [], ids, dst_first, hbm_parts=[s["dst"]], dst_of=dict(zip(ids, dst_first)))
        _sync(dev)
        t = time.perf_counter()
        mover.promote(promote)
        loader.set_consumer(mover.start_loading())
        loader.wait_until(layout.num_layers - 1)
        done = mover.flush()
        _sync(dev)
        load_ms = (time.perf_counter() - t) * 1e3
        worst = 0.0
        for bufs in (s["k"], s["v"]):
            for layer in range(layout.num_layers):
                x, y = bufs[layer][s["src"]].float(), bufs[layer][s["dst"]].float()
                worst = max(worst, float((x - y).abs().max() / x.abs().max()))
        res = {"pinned": pinned, "path": mover.load_path, "promote_ms": _r(load_ms, 2), "promote_done": 2 in done,
               "pcie_bytes": n * pool.page_bytes, "max_rel_err": _r(worst, 6)}
        res["within_bound"] = worst <= BOUND[fmt] if fmt else worst == 0.0
        return res
    finally:
        pool.close()


def check_cold(ctx: Ctx) -> None:
    dev = _device(ctx)
    if dev is None:
        return
    ctx.result["layer_done_counter"] = ensure_layer_done_counter()
    s = _setup(dev, ctx.quick)
    ctx.result["pages"], ctx.result["exact_page_bytes"] = s["n"], s["layout"].page_bytes
    for fmt in ("fp8", "int4"):
        res: dict[str, Any] = {}
        ctx.result[fmt] = res
        try:
            res["codec"] = _codec(dev, s, fmt)
            res["mover"] = _mover(dev, s, fmt)
        except Exception as exc:  # one format's failure is a result; the other still runs
            res["status"], res["error"] = "failed", f"{type(exc).__name__}: {exc}"
            res["traceback"] = traceback.format_exc()[-3000:]
        ctx.save()
    try:
        ctx.result["exact_mover"] = _mover(dev, s, None)
    except Exception as exc:
        ctx.result["exact_mover"] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    failed = [f for f in ("fp8", "int4") if ctx.result[f].get("status") == "failed"]
    if failed:
        ctx.result["status"] = f"failed: {', '.join(failed)}"
