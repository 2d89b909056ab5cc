"""The text summary ``scripts/gpu_check`` prints at the end (every figure is in ``results.json``)."""

from __future__ import annotations

from typing import Any


def summary_lines(checks: dict[str, Any]) -> list[str]:
    """One block of lines per check, in the order they ran."""
    return (_layerwise(checks.get("layerwise", {})) + _nvme(checks.get("nvme", {})) + _cold(checks.get("cold", {}))
            + _attention(checks.get("flashinfer", {})) + _dp(checks.get("dp", {})))


def _cold(cold: dict[str, Any]) -> list[str]:
    lines = [f"cold: {cold.get('status')} {cold.get('reason', '')}".rstrip()]
    exact = cold.get("exact_mover", {})
    for fmt in ("fp8", "int4"):
        res = cold.get(fmt, {})
        codec, mover = res.get("codec", {}), res.get("mover", {})
        if not mover:
            lines.append(f"  {fmt}: {res.get('status', '-')} {str(res.get('error', ''))[:90]}")
            continue
        lines.append(f"  {fmt}: ratio {codec.get('ratio')}, device encode/decode {codec.get('encode_GBps')}/"
                     f"{codec.get('decode_GBps')} GB/s, identical to CPU {codec.get('device_cpu_identical_byte_share')}; "
                     f"promote {mover.get('promote_ms')} ms vs exact {exact.get('promote_ms')} ms, PCIe "
                     f"{mover.get('pcie_bytes')} vs {exact.get('pcie_bytes')} B, max rel err {mover.get('max_rel_err')} "
                     f"within bound {mover.get('within_bound')}")
    return lines


def _layerwise(lw: dict[str, Any]) -> list[str]:
    lines = [f"layerwise: {lw.get('status')} {lw.get('reason', '')}".rstrip()]
    if lw.get("compute_alone_ms") is None:
        return lines
    auto = lw.get("auto_path", {})
    lines.append(f"  compute alone {lw['compute_alone_ms']} ms ({lw.get('compute_TFLOPs')} TFLOP/s), load "
                 f"{lw.get('load_bytes_MiB')} MiB, pinned={lw.get('pinned')}, a server here takes: {auto.get('path')}")
    lines.append(f"  counter: {str(lw.get('layer_done_counter', '-'))[:90]}")
    lines.append(f"  {'variant':22s} {'load ms':>8s} {'GB/s':>6s} {'/memcpy':>7s} {'overlap':>8s} {'exposed':>8s} "
                 f"{'exp/load':>8s} {'ideal':>6s} {'start()':>8s} exact")
    for name, v in lw.get("variants", {}).items():
        if v.get("status") != "ok":
            lines.append(f"  {name:22s} {v.get('status')}: {str(v.get('reason'))[:90]}")
            continue
        lines.append(f"  {name:22s} {v['load_alone_ms']:8.2f} {v['load_GBps']:6.2f} "
                     f"{v.get('share_of_memcpy_GBps') or 0:7.3f} {v['overlapped_ms']:8.2f} {v['exposed_load_ms']:8.2f} "
                     f"{v['exposed_share_of_load']:8.3f} {v['ideal_exposed_share']:6.3f} {v['start_call_ms']:8.2f} "
                     f"{v.get('verified_bit_exact')}/{v.get('verified_after_overlap', '-')}")
    st = lw.get("store", {})
    if st.get("status") == "ok":
        lines.append(f"  HBM -> DRAM store ({st['pool']}): {st['GBps']} GB/s = {st['share_of_limit']} of one D2H copy "
                     f"({st['limit_d2h_GBps']} GB/s); host call {st['host_call_ms']} ms, {st['d2h_copies']} copies")
    return lines


def _nvme(nv: dict[str, Any]) -> list[str]:
    lines = [f"nvme: {nv.get('status')} {nv.get('reason', '')} fs={nv.get('fs', {}).get('fstype')} "
             f"payload={nv.get('payload_MiB')} MiB write={nv.get('write', {}).get('GBps')} GB/s".rstrip()]
    auto = nv.get("auto_device_read_path")
    if auto:
        lines.append(f"  read_slots_to_device chooses: {auto.get('path')} ({auto.get('reason')})")
    for name, m in nv.get("methods", {}).items():
        if m.get("status") != "ok":
            lines.append(f"  {name:24s} {m.get('status')}: {str(m.get('reason'))[:90]}")
            continue
        share = f" = {m['share_of_raw']} of {m['raw_limit']}" if "share_of_raw" in m else ""
        verified = f" verified={m['verified']}" if "verified" in m else ""
        lines.append(f"  {name:24s} {m.get('GBps')} GB/s (median {m.get('median_s')} s){share}{verified}")
    return lines


def _attention(fl: dict[str, Any]) -> list[str]:
    lines = [f"flashinfer: {fl.get('status')} {fl.get('reason', '')}".rstrip()]
    for tr in fl.get("torch_reference", {}).get("trials", []):
        lines.append(f"  torch ref: bit-exact load={tr['pages_loaded_bit_exact']} sdpa_bf16 rel err "
                     f"{tr['torch_sdpa_bf16_vs_fp64_max_rel_err']:.2e}")
    fi = fl.get("flashinfer", {})
    if not fi:
        return lines
    lines.append(f"  flashinfer {fi.get('version', '')}: {fi.get('status')} {str(fi.get('reason', ''))[:100]}")
    for part in ("decode", "prefill"):
        d = fi.get(part)
        if not d:
            continue
        if d.get("status") != "ok":
            lines.append(f"    {part}: {d.get('status')}: {str(d.get('reason'))[:160]}")
            continue
        for tr in d.get("trials", []):
            err = tr.get("max_rel_err", tr.get("rel_err"))
            lines.append(f"    {part}: rel err {err:.2e} finite={tr['all_written_finite']} plan {tr['plan_s']} s"
                         + (f" kernel {tr['kernel_median_us']} us" if "kernel_median_us" in tr else ""))
    return lines


def _dp(dp: dict[str, Any]) -> list[str]:
    if not dp:
        return []
    lines = [f"dp: {dp.get('status')} {dp.get('reason', '')}".rstrip()]
    if "outputs_match" in dp:
        n = dp.get("requests")
        lines.append(f"  TP 2 x DP 2 vs TP 2: sequential {dp['matching_sequential']}/{n}, parallel "
                     f"{dp['matching_parallel']}/{n} equal; DP ranks used {dp.get('dp_ranks_used')}")
    return lines
