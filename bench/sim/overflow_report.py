"""Context overflow on the Mooncake conversation trace: recompute vs shift (issue 20, item 6).

Replays the trace (``bench/sim/simulate.py``'s engine, the ``dram`` scenario: HBM + DRAM, one
policy, the cost model on) at each ``--contexts`` length with the kept tail recomputed and with it
shifted (``bench/sim/overflow.py`` states the model), plus the unlimited context (the reference),
at each ``--dram-tokens`` capacity. Prints a markdown table and writes ``overflow.json``.

    .venv/bin/python -m bench.sim.overflow_report                      # 8192 and 16384, DRAM 4M and 32M
    .venv/bin/python -m bench.sim.overflow_report --limit 3000 --contexts 4096

Columns: ``overflowed`` = requests cut (a new cut; share of all requests); ``dropped`` = tokens
those cuts drop; ``shifted`` = tokens re-used after a shift; ``sent`` = prompt tokens sent (cut
prompts); ``prefill`` = sent - hit (tokens prefilled); ``hit %`` = hit / sent; ``saved %`` =
modelled prefill time saved against no cache for the same prompts (``bench/sim/cost.py``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.sim.overflow import ConversationCuts  # noqa: E402
from bench.sim.simulate import DEFAULT_TRACE, SimConfig, load_trace, run_scenario  # noqa: E402

MODES = ("unlimited", "recompute", "shift")


def runs(contexts: Sequence[int], dram_tokens: Sequence[int]) -> list[tuple[int, Optional[int], str]]:
    """(DRAM tokens, context tokens or None, mode) of every run, the reference first per capacity."""
    out = []
    for dram in dram_tokens:
        out.append((dram, None, "unlimited"))
        out += [(dram, ctx, mode) for ctx in contexts for mode in MODES[1:]]
    return out


def row(dram: int, ctx: Optional[int], mode: str, r: dict) -> dict:
    """The table's figures of one run (``run_scenario``'s summary ``r``)."""
    hit = sum(r["hit_tokens"].values())
    ov = r.get("overflow", {})
    return {"dram_tokens": dram, "context_tokens": ctx, "mode": mode, "requests": r["requests"],
            "overflowed_requests": ov.get("overflowed_requests", 0), "dropped_tokens": ov.get("dropped_tokens", 0),
            "shifted_tokens": ov.get("shifted_tokens", 0), "rejected": r["rejected"], "sent_tokens": r["prompt_tokens"],
            "hit_tokens": hit, "prefill_tokens": r["prompt_tokens"] - hit, "hit_rate": r["hit_rate"],
            "time_saved": r["time_saved"], "time_saved_s": r["time_saved_s"], "wall_s": r["wall_s"]}


def format_table(rows: Sequence[dict]) -> str:
    """Markdown table of :func:`row` dicts."""
    head = ("| DRAM | context | mode | overflowed | dropped | shifted | sent | prefill | hit % | saved % |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for x in rows:
        ctx = f"{x['context_tokens']:,}" if x["context_tokens"] else "unlimited"
        lines.append(
            f"| {x['dram_tokens'] / 1e6:g} M | {ctx} | {x['mode']} | {x['overflowed_requests']:,} "
            f"({100 * x['overflowed_requests'] / max(x['requests'], 1):.1f}%) | {x['dropped_tokens'] / 1e6:.2f} M "
            f"| {x['shifted_tokens'] / 1e6:.2f} M | {x['sent_tokens'] / 1e6:.2f} M | {x['prefill_tokens'] / 1e6:.2f} M "
            f"| {100 * x['hit_rate']:.1f} | {100 * x['time_saved']:.1f} |")
    return "\n".join(lines)


def trace_shares(trace: Sequence, contexts: Sequence[int], cfg: SimConfig) -> dict:
    """Per context: share of requests whose trace prompt + output exceeds it, and the model's cuts."""
    out = {}
    for ctx in contexts:
        cuts = ConversationCuts(trace, dataclasses.replace(cfg, context_tokens=ctx))
        cut = [c is not None for c in cuts.cuts]
        continuing = [c and n > cuts.head_blocks * 512 for c, n in zip(cut, cuts.shared_view_tokens)]
        out[ctx] = {"exceeds": sum(t.input_len + t.output_len > ctx for t in trace) / len(trace),
                    "cut": sum(cut) / len(trace), "cut_continuing": sum(continuing) / len(trace),
                    "shift_bound_tokens": cuts.shift_bound_tokens(),
                    "continuing": cuts.continuing_share(), "head_tokens": cuts.head_blocks * 512}
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run every (capacity, context, mode); print the table; write ``overflow.json``; returns 0."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--contexts", default="8192,16384", help="context lengths, tokens (comma list)")
    p.add_argument("--dram-tokens", default="4e6,32e6", help="DRAM capacities, tokens (comma list)")
    p.add_argument("--hbm-tokens", type=lambda s: int(float(s)), default=SimConfig().hbm_tokens)
    p.add_argument("--policy", default="lru")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    contexts = [int(float(c)) for c in args.contexts.split(",")]
    drams = [int(float(d)) for d in args.dram_tokens.split(",")]
    base = SimConfig(hbm_tokens=args.hbm_tokens, cost_model=True)
    start = time.perf_counter()
    trace = load_trace(args.trace, args.limit)
    shares = trace_shares(trace, contexts, base)
    rows = []
    for dram, ctx, mode in runs(contexts, drams):
        cfg = dataclasses.replace(base, dram_tokens=dram, context_tokens=ctx,
                                  context_overflow=mode if ctx else "recompute")
        rows.append(row(dram, ctx, mode, run_scenario(trace, cfg, "dram", args.policy)))
    wall_s = time.perf_counter() - start
    out_dir = args.out_dir or Path("runs") / time.strftime("overflow-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"trace": str(args.trace), "requests": len(trace), "policy": args.policy, "scenario": "dram",
               "config": dataclasses.asdict(base), "trace_shares": shares, "rows": rows, "wall_s": wall_s,
               "nproc": os.cpu_count(), "loadavg": os.getloadavg()}
    (out_dir / "overflow.json").write_text(json.dumps(summary, indent=2))
    print(format_table(rows))
    for ctx, s in shares.items():
        print(f"context {ctx:,}: {100 * s['exceeds']:.1f}% of requests exceed it as traced; the model cuts "
              f"{100 * s['cut']:.1f}% ({100 * s['cut_continuing']:.1f}% in a continuing conversation; "
              f"{100 * s['continuing']:.1f}% of requests continue one); kept head {s['head_tokens']} tokens; "
              f"an infinite cache could shift {s['shift_bound_tokens'] / 1e6:.2f} M tokens")
    print(f"{len(trace)} requests, {len(rows)} runs, HBM {args.hbm_tokens:,} tokens, policy {args.policy}, "
          f"cost model on: {wall_s:.1f} s; wrote {out_dir / 'overflow.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
