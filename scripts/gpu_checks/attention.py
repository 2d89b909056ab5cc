"""Check 3 of ``scripts/gpu_check``: paged attention over pages loaded DRAM -> HBM.

FlashInfer paged decode (and prefill when time allows), NHD, page_size 16, over pages loaded by
:func:`hiradix.dataplane.layout.load_layer`, against a float64 torch reference computed from the
DRAM pages; relative error ||out-ref||/||ref||, fresh random inputs per trial, outputs poisoned
with NaN first. The torch reference path always runs (also on the CPU).
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import time
import traceback
from typing import Any

from gpu_checks.common import Ctx, _device


def _attn_ref(q, k, v, causal_offset: int | None = None):
    """float64 attention of one request: q (Tq, Hq, D), k/v (S, Hkv, D) -> (Tq, Hq, D).

    ``causal_offset``: query i may see keys [0, causal_offset + i]; None = all keys.
    """
    import torch

    hq, hkv = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    if causal_offset is not None:
        tq, sk = q.shape[0], k.shape[0]
        mask = torch.arange(sk, device=q.device)[None, :] > (causal_offset + torch.arange(tq, device=q.device))[:, None]
        s = s.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def _rel_err(out, ref) -> float:
    import torch

    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("nan")
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def check_flashinfer(ctx: Ctx) -> None:
    import torch

    dev = _device(ctx)
    if dev is None:
        return
    res = ctx.result
    cuda = dev.type == "cuda"
    from hiradix.dataplane.layout import KVLayout, load_layer

    dtype = torch.bfloat16
    L, ps, H, D, Hq = 2, 16, 8, 128, 32
    B = 3 if ctx.quick else 8
    max_len = 80 if ctx.quick else 2000
    layer = 1
    layout = KVLayout(L, ps, H, D, dtype)
    res["config"] = dict(layers_in_pool=L, layer_checked=layer, page_size=ps, kv_heads=H, q_heads=Hq, head_dim=D,
                         batch=B, max_kv_len=max_len, dtype="bfloat16", kv_layout="NHD")

    def make_case(seed: int) -> dict[str, Any]:
        """Fresh DRAM pages, loaded DRAM -> HBM by load_layer into a NaN-poisoned device pool."""
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(1, max_len + 1, (B,), generator=g)
        pages_per = (lens + ps - 1) // ps
        npg = int(pages_per.sum())
        pool_pages = npg + 13
        dram = torch.randn(layout.dram_shape(pool_pages), generator=g).to(dtype)
        dram_ids = torch.randperm(pool_pages, generator=g)[:npg]
        dev_pages = npg + 7
        dev_ids = torch.randperm(dev_pages, generator=g)[:npg]
        slots = (dev_ids[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1).to(dev)
        k_buf = torch.full((dev_pages * ps, H, D), float("nan"), dtype=dtype, device=dev)
        v_buf = torch.full_like(k_buf, float("nan"))
        load_layer(k_buf, v_buf, layer, dram, dram_ids, slots, layout)
        if cuda:
            torch.cuda.synchronize()
        # the reference reads the DRAM pages directly (not the device pool)
        kv_src = dram[:, layer].to(dev)  # (pool_pages, 2, ps, H, D)
        refs_k, refs_v = [], []
        start = 0
        for b in range(B):
            p = dram_ids[start : start + int(pages_per[b])]
            start += int(pages_per[b])
            refs_k.append(kv_src[p.to(dev), 0].reshape(-1, H, D)[: int(lens[b])])
            refs_v.append(kv_src[p.to(dev), 1].reshape(-1, H, D)[: int(lens[b])])
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages_per.cumsum(0)]).to(torch.int32)
        return dict(lens=lens, pages_per=pages_per, k_buf=k_buf, v_buf=v_buf, refs_k=refs_k, refs_v=refs_v,
                    indptr=indptr.to(dev), indices=dev_ids.to(torch.int32).to(dev),
                    last=((lens - 1) % ps + 1).to(torch.int32).to(dev), gen=g)

    def paged_kv(case):
        return case["k_buf"].view(-1, ps, H, D), case["v_buf"].view(-1, ps, H, D)

    # ---- torch reference path (always)
    t = time.time()
    torch_res: dict[str, Any] = {"trials": []}
    res["torch_reference"] = torch_res
    for trial in range(2):
        case = make_case(100 + trial)
        kc, vc = paged_kv(case)
        q = torch.randn(B, Hq, D, generator=case["gen"]).to(dtype).to(dev)
        err_sdpa, err_pool, exact = [], [], True
        for b in range(B):
            pages = case["indices"][int(case["indptr"][b]) : int(case["indptr"][b + 1])].long()
            k_pool = kc[pages].reshape(-1, H, D)[: int(case["lens"][b])]
            v_pool = vc[pages].reshape(-1, H, D)[: int(case["lens"][b])]
            exact &= torch.equal(k_pool.view(torch.int16), case["refs_k"][b].view(torch.int16)) and torch.equal(
                v_pool.view(torch.int16), case["refs_v"][b].view(torch.int16))
            ref = _attn_ref(q[b : b + 1], case["refs_k"][b], case["refs_v"][b])
            err_pool.append(_rel_err(_attn_ref(q[b : b + 1], k_pool, v_pool), ref))
            sd = torch.nn.functional.scaled_dot_product_attention(
                q[b : b + 1].transpose(0, 1)[None], k_pool.repeat_interleave(Hq // H, 1).transpose(0, 1)[None],
                v_pool.repeat_interleave(Hq // H, 1).transpose(0, 1)[None])[0].transpose(0, 1)
            err_sdpa.append(_rel_err(sd, ref))
        torch_res["trials"].append({"seed": 100 + trial, "kv_lens": case["lens"].tolist(),
                                    "pages_loaded_bit_exact": bool(exact),
                                    "fp64_from_pool_vs_fp64_from_dram_max_rel_err": max(err_pool),
                                    "torch_sdpa_bf16_vs_fp64_max_rel_err": max(err_sdpa)})
    torch_res["s"] = round(time.time() - t, 2)
    ctx.save()

    # ---- FlashInfer
    fi: dict[str, Any] = {}
    res["flashinfer"] = fi
    if not cuda:
        fi.update(status="skipped", reason="no CUDA device")
        res["status"] = "ok"
        return
    # tvm-ffi (FlashInfer's binding layer) JIT-builds a torch addon at import when torch lacks the
    # DLPack C exchange API; keep that unbudgeted build out (the plain DLPack path still works).
    fi["torch_has_dlpack_c_exchange_api"] = hasattr(torch.Tensor, "__dlpack_c_exchange_api__") or hasattr(
        torch.Tensor, "__c_dlpack_exchange_api__")
    if not fi["torch_has_dlpack_c_exchange_api"]:
        os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    fi["TVM_FFI_DISABLE_TORCH_C_DLPACK"] = os.environ.get("TVM_FFI_DISABLE_TORCH_C_DLPACK")
    t = time.time()
    try:
        import flashinfer
    except Exception as exc:
        fi.update(status="skipped", reason=f"import flashinfer failed: {type(exc).__name__}: {exc}")
        res["status"] = "ok"
        return
    fi["version"] = getattr(flashinfer, "__version__", "?")
    fi["import_s"] = round(time.time() - t, 2)
    fi["nvcc"] = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "?"), "bin/nvcc")
    fi["ninja"] = shutil.which("ninja")
    workspace = torch.zeros(128 * 2**20, dtype=torch.uint8, device=dev)

    def run_decode(trial_seed: int, wrapper) -> dict[str, Any]:
        case = make_case(trial_seed)
        q = torch.randn(B, Hq, D, generator=case["gen"]).to(dtype).to(dev)
        t0 = time.time()
        wrapper.plan(case["indptr"], case["indices"], case["last"], Hq, H, D, ps,
                     pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=dtype)
        plan_s = time.time() - t0
        out = torch.full((B, Hq, D), float("nan"), dtype=dtype, device=dev)
        wrapper.run(q, paged_kv(case), out=out)
        torch.cuda.synchronize()
        errs = [_rel_err(out[b : b + 1], _attn_ref(q[b : b + 1], case["refs_k"][b], case["refs_v"][b])) for b in range(B)]
        r = {"seed": trial_seed, "plan_s": round(plan_s, 2), "all_written_finite": bool(torch.isfinite(out).all()),
             "max_rel_err": max(errs), "rel_err_all": _rel_err(out, torch.cat(
                 [_attn_ref(q[b : b + 1], case["refs_k"][b], case["refs_v"][b]) for b in range(B)]))}
        # timing (after the check): median of 20 event-timed runs
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        times = []
        for _ in range(23):
            ev[0].record()
            wrapper.run(q, paged_kv(case), out=out)
            ev[1].record()
            torch.cuda.synchronize()
            times.append(ev[0].elapsed_time(ev[1]))
        r["kernel_median_us"] = round(statistics.median(times[3:]) * 1e3, 1)
        return r

    try:
        dec = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        fi["decode"] = {"trials": []}
        ctx.save()
        ctx.log("FlashInfer decode: plan (JIT compile on first use) ...")
        for seed in (200, 201):
            fi["decode"]["trials"].append(run_decode(seed, dec))
            ctx.save()
        fi["decode"]["first_plan_includes_jit_s"] = fi["decode"]["trials"][0]["plan_s"]
        fi["decode"]["status"] = "ok"
    except Exception as exc:
        fi["decode"] = {"status": "failed", "reason": f"{type(exc).__name__}: {str(exc)[-2000:]}",
                        "traceback": traceback.format_exc()[-3000:]}
        fi["status"] = "failed"
        res["status"] = "ok"
        return
    ctx.save()

    # ---- prefill (append) with paged KV, causal, when time allows
    need = float(ctx.opts.get("prefill_min_s") or 150)
    if ctx.left() < need:
        fi["prefill"] = {"status": "skipped", "reason": f"time budget: {ctx.left():.0f}s left, a JIT prefill build needs ~{need:.0f}s"}
    else:
        try:
            ctx.log("FlashInfer prefill (fa2): plan (JIT compile on first use) ...")
            pre = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
            fi["prefill"] = {"trials": []}
            for seed in (300, 301):
                case = make_case(seed)
                qo = torch.minimum(case["lens"], torch.full_like(case["lens"], 64))
                qo_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), qo.cumsum(0)]).to(torch.int32).to(dev)
                q = torch.randn(int(qo.sum()), Hq, D, generator=case["gen"]).to(dtype).to(dev)
                t0 = time.time()
                pre.plan(qo_indptr, case["indptr"], case["indices"], case["last"], Hq, H, D, ps, causal=True,
                         q_data_type=dtype, kv_data_type=dtype)
                plan_s = time.time() - t0
                out = torch.full_like(q, float("nan"))
                pre.run(q, paged_kv(case), out=out)
                torch.cuda.synchronize()
                refs = []
                for b in range(B):
                    a, z = int(qo_indptr[b]), int(qo_indptr[b + 1])
                    refs.append(_attn_ref(q[a:z], case["refs_k"][b], case["refs_v"][b],
                                          causal_offset=int(case["lens"][b]) - (z - a)))
                ref = torch.cat(refs)
                fi["prefill"]["trials"].append({"seed": seed, "qo_lens": qo.tolist(), "plan_s": round(plan_s, 2),
                                                "all_written_finite": bool(torch.isfinite(out).all()),
                                                "rel_err": _rel_err(out, ref)})
                ctx.save()
            fi["prefill"]["status"] = "ok"
        except Exception as exc:
            fi["prefill"] = {"status": "failed", "reason": f"{type(exc).__name__}: {str(exc)[-2000:]}",
                             "traceback": traceback.format_exc()[-3000:]}
    fi["status"] = "ok"
    res["status"] = "ok"


