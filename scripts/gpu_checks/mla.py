"""Check 4 of ``scripts/gpu_check``: MLA latent pages DRAM -> HBM, and FlashInfer's paged MLA over them.

DeepSeek-V3-sized latent rows (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64, bf16) in hiradix's
MLA page layout (``KVLayout.rope_dim``: per layer page, ``ckv [ps, 512]`` rows then ``kpe [ps, 64]``
rows) are loaded into an ``MLATokenToKVPool``-shaped device buffer ``(rows, 1, 576)`` through each
DRAM -> HBM path of ``hiradix.dataplane.device_copy`` (``gather`` and ``runs`` from a pinned pool,
``host`` from a pageable one): GB/s per layer, bit-exactness. Then absorbed MLA decode attention
over the loaded pages: FlashInfer's ``BatchMLAPagedAttentionWrapper`` (when importable) against a
float64 torch reference (``softmax((q_nope ckv^T + q_pe kpe^T) * scale) ckv``), given both SGLang's
device rows and hiradix's off-device pages unchanged (FlashInfer's ``ckv`` / ``kpe`` cache views of
them); the reference path always runs (also on the CPU).
"""

from __future__ import annotations

import math
import time
import traceback
from typing import Any

from gpu_checks.common import Ctx, _device, _gbps, _median, _r, _sync

LORA, ROPE = 512, 64  # DeepSeek-V3 / R1 / Kimi K2


def _mla_ref(q_nope, q_pe, ckv, kpe, scale: float):
    """float64 absorbed MLA of one request: q (Hq, 512|64), ckv (S, 512), kpe (S, 64) -> (Hq, 512)."""
    import torch

    s = (q_nope.double() @ ckv.double().T + q_pe.double() @ kpe.double().T) * scale
    return torch.softmax(s, dim=-1) @ ckv.double()


def _setup(ctx: Ctx, dev, quick: bool) -> dict[str, Any]:
    import torch

    from hiradix.dataplane.layout import KVLayout
    from hiradix.tiers.dram import DramPool

    L, ps = (2, 16) if quick else (8, 64)
    n = 64 if quick else 1024  # pages loaded: 1,024 x 64 tokens = a 64k-token prefix per layer
    layout = KVLayout(L, ps, 1, LORA + ROPE, torch.bfloat16, rope_dim=ROPE)
    pool_pages = n + n // 4
    gen = torch.Generator().manual_seed(7)
    ids = torch.randperm(pool_pages, generator=gen)[:n].tolist()
    dev_pages = n + 8
    dev_page_ids = torch.randperm(dev_pages, generator=gen)[:n]
    slots = (dev_page_ids[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1).to(dev)
    pinned = DramPool.create_anonymous(layout, pool_pages)
    pageable = DramPool.create_anonymous(layout, pool_pages)
    pinned.tensor.view(-1).copy_(torch.randn(pinned.tensor.numel(), generator=gen).to(layout.dtype))
    pageable.tensor.copy_(pinned.tensor)
    ctx.result["pinned"] = pinned.pin_for_cuda() if dev.type == "cuda" else False
    ctx.result["layout"] = {"layers": L, "page_size": ps, "pages": n, "row": LORA + ROPE,
                            "layer_page_bytes": layout.layer_page_bytes, "load_MiB": _r(n * layout.page_bytes / 2**20, 1)}
    kv = [torch.zeros(dev_pages * ps, 1, LORA + ROPE, device=dev, dtype=layout.dtype) for _ in range(L)]
    return dict(layout=layout, n=n, ids=ids, slots=slots, pinned=pinned, pageable=pageable, kv=kv)


def _expected(s: dict[str, Any], pool, layer: int):
    """What the device rows of ``layer`` must hold: the DRAM pages' ckv and kpe rows side by side."""
    import torch

    layout = s["layout"]
    pages = pool.tensor[s["ids"], layer] if layout.page_major else pool.tensor[layer, s["ids"]]  # (n, E)
    ps = layout.page_size
    ckv = pages[:, : ps * LORA].reshape(-1, LORA)
    kpe = pages[:, ps * LORA :].reshape(-1, ROPE)
    return torch.cat([ckv, kpe], dim=1)


def _load_paths(ctx: Ctx, dev, s: dict[str, Any]) -> None:
    """Each DRAM -> HBM path into the latent buffer: ms and GB/s per layer, bit-exact."""
    import torch

    from hiradix.dataplane import device_copy
    from hiradix.dataplane.layout import load_layer

    layout, out = s["layout"], {}
    cuda = dev.type == "cuda"
    for path in ("gather", "runs", "host"):
        pool = s["pageable"] if path == "host" else s["pinned"]
        rec: dict[str, Any] = {"status": "ok"}
        try:
            source = pool.tensor
            if path == "gather" and cuda:
                source, why = device_copy.mapped_view(pool.tensor, dev)
                if source is None:
                    out[path] = {"status": "skipped", "reason": why}
                    continue
            times = []
            for _ in range(2 if ctx.quick else 5):
                for buf in s["kv"]:
                    buf.zero_()
                _sync(dev)
                t = time.perf_counter()
                if path == "host":
                    for layer in range(layout.num_layers):
                        load_layer(s["kv"][layer], None, layer, pool.tensor, s["ids"], s["slots"], layout)
                else:
                    load = device_copy.LayerLoad(pool.tensor, s["ids"], s["slots"], layout, path, source)
                    for layer in range(layout.num_layers):
                        load.copy_layer(layer, s["kv"][layer], None)
                _sync(dev)
                times.append(time.perf_counter() - t)
            ms = _median(times) * 1e3 / layout.num_layers
            rec.update(load_ms_per_layer=_r(ms, 3), load_GBps=_gbps(s["n"] * layout.layer_page_bytes, ms * 1e-3))
            rec["verified_bit_exact"] = all(
                torch.equal(s["kv"][layer][s["slots"], 0].cpu().view(torch.int16),
                            _expected(s, pool, layer).view(torch.int16)) for layer in range(layout.num_layers))
        except Exception as exc:
            rec = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
        out[path] = rec
        ctx.save()
    ctx.result["load_paths"] = out


def _attention(ctx: Ctx, dev, s: dict[str, Any]) -> None:
    """Decode attention of one request over the loaded pages: torch fp64 reference vs bf16 torch,
    and FlashInfer's paged MLA (ckv / kpe views of the pages) where it imports."""
    import torch

    layout, ps, hq = s["layout"], s["layout"].page_size, 16
    scale = 1.0 / math.sqrt(128 + ROPE)
    gen = torch.Generator().manual_seed(11)
    q_nope = torch.randn(hq, LORA, generator=gen).to(dev, torch.bfloat16)
    q_pe = torch.randn(hq, ROPE, generator=gen).to(dev, torch.bfloat16)
    rows = s["kv"][0][s["slots"], 0]  # (S, 576) in token order, as the request's pages hold it
    ckv, kpe = rows[:, :LORA], rows[:, LORA:]
    ref = _mla_ref(q_nope, q_pe, ckv, kpe, scale)
    bf16 = torch.softmax((q_nope.float() @ ckv.float().T + q_pe.float() @ kpe.float().T) * scale, -1) @ ckv.float()
    res = {"tokens": int(rows.shape[0]), "torch_fp32_vs_fp64_rel_err": _r(float((bf16.double() - ref).norm() / ref.norm()), 6)}
    if dev.type != "cuda":
        res["flashinfer"] = {"status": "skipped", "reason": "no CUDA device"}
        ctx.result["attention"] = res
        return
    # Two inputs: SGLang's device rows (ckv / kpe column views of the latent buffer), and hiradix's
    # off-device pages as they are (each page: ckv rows, then kpe rows), copied up unchanged.
    device_pages = s["kv"][0].view(-1, ps, LORA + ROPE)
    device_idx = (s["slots"].view(-1, ps)[:, 0] // ps).to(torch.int32)
    pool = s["pinned"].tensor
    staged = (pool[s["ids"], 0] if layout.page_major else pool[0, s["ids"]]).to(dev)  # (n, ps*576)
    inputs = {
        "sglang_device_rows": (device_pages[..., :LORA], device_pages[..., LORA:], device_idx),
        "hiradix_pages": (staged[:, : ps * LORA].view(-1, ps, LORA), staged[:, ps * LORA :].view(-1, ps, ROPE),
                          torch.arange(staged.shape[0], dtype=torch.int32, device=dev)),
    }
    res["flashinfer"] = {}
    for name, (ckv_cache, kpe_cache, page_idx) in inputs.items():
        try:
            res["flashinfer"][name] = _flashinfer_mla(dev, q_nope, q_pe, ckv_cache, kpe_cache, page_idx, rows.shape[0],
                                                      ps, scale, ref)
        except Exception as exc:
            res["flashinfer"][name] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
    ctx.result["attention"] = res


def _flashinfer_mla(dev, q_nope, q_pe, ckv_cache, kpe_cache, page_idx, kv_tokens: int, ps: int, scale: float, ref):
    """FlashInfer's paged MLA decode of one request (``flashinfer.mla.BatchMLAPagedAttentionWrapper``)."""
    import flashinfer
    import torch

    hq = q_nope.shape[0]
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace)
    qo_indptr = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    kv_indptr = torch.tensor([0, page_idx.numel()], dtype=torch.int32, device=dev)
    kv_len = torch.tensor([kv_tokens], dtype=torch.int32, device=dev)
    wrapper.plan(qo_indptr, kv_indptr, page_idx, kv_len, hq, LORA, ROPE, ps, False, scale,
                 torch.bfloat16, torch.bfloat16)
    out = wrapper.run(q_nope[None], q_pe[None], ckv_cache, kpe_cache)[0]
    return {"status": "ok", "rel_err_vs_fp64": _r(float((out.double() - ref).norm() / ref.norm()), 6)}


def check_mla(ctx: Ctx) -> None:
    dev = _device(ctx)
    if dev is None:
        return
    s = _setup(ctx, dev, ctx.quick)
    try:
        _load_paths(ctx, dev, s)
        _attention(ctx, dev, s)
    finally:
        s["pinned"].close()
        s["pageable"].close()
