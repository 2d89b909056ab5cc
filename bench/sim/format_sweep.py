"""Compressed NVMe tier at the same bytes (``bench/sim/simulate.py --sweep --cold-formats exact,fp8,int4``; issue 21).

At each capacity point of the sweep (:func:`bench.sim.sweep.points`: DRAM ``dram_share`` of it, NVMe
the rest, both in bytes of the model's dtype), every ``--policies`` policy runs the ``nvme``
scenario once per page format of the NVMe tier (:mod:`bench.sim.cold_tier`): the same NVMe bytes
hold ``1 / ratio`` times the tokens, and reads and writes move ``ratio`` times the bytes (plus the
codec's time when ``--cold-decode-bytes-per-s`` / ``--cold-encode-bytes-per-s`` are set). Per point
and format: the NVMe tier's size in tokens, and per policy the block hit %, prefill time saved %
(``--cost-model`` times the NVMe reads; without it only the misses' prefill counts), the share of
hits ready at the first admission try and the NVMe wait per request. Outputs: ``formats.json`` and
the table. No Belady or DRAM-only references (``--sweep`` without ``--cold-formats`` has them).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Sequence

from bench.sim import sweep
from bench.sim.cold_tier import bytes_ratio, nvme_slots


def run_format_sweep(trace: Sequence, base_cfg, policies: Sequence[str], formats: Sequence[str],
                     fractions: Sequence[float], dram_share: float, jobs: int) -> dict:
    """Simulate every (point, format, policy); returns the JSON-ready summary.

    Per point: ``formats[fmt]`` = ``{"ratio", "nvme_slots", "nvme_tokens_held", "results": {policy: summary}}``.
    Raises ValueError (from :class:`SimConfig`) for an unknown format.
    """
    pts = sweep.points(trace, fractions, dram_share)
    work, cfgs = [], {}
    for i, p in enumerate(pts):
        for fmt in formats:
            cfg = dataclasses.replace(base_cfg, dram_tokens=p["dram_tokens"], nvme_tokens=p["nvme_tokens"], cold_format=fmt)
            cfgs[i, fmt] = cfg
            work += [(cfg, "nvme", pol) for pol in policies]
    start = time.perf_counter()
    sweep._TRACE = trace  # read by sweep._run in the forked workers
    with ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=mp.get_context("fork")) as pool:
        it = iter(list(pool.map(sweep._run, work)))
    for i, p in enumerate(pts):
        p["formats"] = {}
        for fmt in formats:
            cfg = cfgs[i, fmt]
            p["formats"][fmt] = {"ratio": bytes_ratio(cfg), "nvme_slots": nvme_slots(cfg),
                                 "nvme_tokens_held": nvme_slots(cfg) * cfg.page_size,
                                 "results": {pol: next(it) for pol in policies}}
    return {"points": pts, "policies": list(policies), "formats": list(formats), "dram_share": dram_share,
            "config": dataclasses.asdict(base_cfg), "wall_s": time.perf_counter() - start}


def format_table(summary: dict) -> str:
    """One row per (point, format): NVMe tokens held, then per policy block hit %, saved %, ready %, wait ms."""
    pols = summary["policies"]
    head = f"{'capacity':>10}{'% uniq':>7}{'format':>8}{'ratio':>7}{'NVMe tok':>10}"
    for p in pols:
        q = p[:4]
        head += f"{'blk% ' + q:>11}{'saved% ' + q:>13}{'ready% ' + q:>13}{'wait ms ' + q:>14}"
    lines = [head, "-" * len(head)]
    for pt in summary["points"]:
        for fmt, f in pt["formats"].items():
            row = f"{pt['tokens'] / 1e6:>9.2f}M{100 * pt['fraction']:>7.0f}{fmt:>8}{f['ratio']:>7.3f}{f['nvme_tokens_held'] / 1e6:>9.2f}M"
            for pol in pols:
                r = f["results"][pol]
                row += (f"{100 * r['block_hit_rate']:>11.1f}{100 * r['time_saved']:>13.1f}"
                        f"{100 * r['ready_share']:>13.1f}{r['nvme_wait_s']['per_request_ms']:>14.1f}")
            lines.append(row)
    cfg = summary["config"]
    lines += [
        "capacity: DRAM + NVMe in tokens of the model's dtype (the same bytes for every format); ratio: encoded / source",
        "bytes of an NVMe page; NVMe tok: tokens the NVMe tier holds; blk%: block hit % (nvme scenario); saved%: prefill",
        "time saved vs no cache (" + ("cost model: reads + prefill, load or recompute" if cfg["cost_model"]
                                       else "no cost model: prefill of the misses only") + "); ready%: hits in HBM or",
        f"DRAM at the first admission try; wait ms: NVMe wait per request. Codec: decode {cfg['cold_decode_bytes_per_s']:.3g} B/s,"
        f" encode {cfg['cold_encode_bytes_per_s']:.3g} B/s (inf = free).",
    ]
    return "\n".join(lines)


def format_sweep_main(args, cfg, trace: Sequence) -> int:
    """``simulate.py --sweep --cold-formats ...``: run, print the table, write ``formats.json``; returns 0."""
    policies = args.policies.split(",")
    formats = args.cold_formats.split(",")
    for fmt in formats:
        dataclasses.replace(cfg, cold_format=fmt)  # raises ValueError listing the formats
    fractions = [float(f) for f in args.fractions.split(",")]
    summary = run_format_sweep(trace, cfg, policies, formats, fractions, args.dram_share, args.jobs)
    summary["trace"] = str(args.trace)
    out_dir = args.out_dir or Path("runs") / time.strftime("formats-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "formats.json").write_text(json.dumps(summary, indent=2))
    print(format_table(summary))
    print(f"{len(trace)} requests, {len(fractions)} points x {len(formats)} formats x {len(policies)} policies on "
          f"{args.jobs} processes: {summary['wall_s']:.1f} s; wrote {out_dir / 'formats.json'}")
    return 0
