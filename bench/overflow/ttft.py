"""TTFT after a context overflow: CA (shifted reuse) vs TT (recompute) vs IDEAL, paired (issue 20).

Four hiradix servers of one model up at once (``bench.overflow.servers``): CA and its duplicate
CA2 (the A/A control), TT with the same small context, and IDEAL, whose context holds every chat
(nothing cut, the whole history cached: the limit). Chats: ``bench.overflow.chats`` (the dataset's
answers as history). The paired design of ``bench.ab``: every turn is one round; the round's
request (the turn's prompt, greedy, one new token) goes to each system in turn, in the order of
``bench.ab.paired.rotation`` (a Williams design), never two systems at once. TTFT = the wall time of
that 1-token ``/generate``. Repetitions flush every cache first (``bench.ab.run.flush_caches``).

Measured: the turns whose prompt overflows the small context (every turn after the chat first
overflows). Per pair, the median of the per-request ratios and its 95% cluster bootstrap interval
over (repetition, chat) (``bench.common.stats.paired_ratio_ci``); per system the median TTFT and
the hit share (cached / prompt tokens as the server ran it).

    flock -x /tmp/hiradix-machine.lock .venv/bin/python -m bench.overflow.ttft --chats 20 --repeats 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import random
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from bench.ab.paired import rotation
from bench.ab.run import flush_caches
from bench.common.stats import bootstrap_ci, paired_ratio_ci, paired_ratio_items
from bench.overflow.chats import Chat, ChatRenderer, keep_tokens_for, overflowing_chats
from bench.overflow.client import generate
from bench.overflow.quality import machine_state
from bench.overflow.servers import ServerPlan, cut_threshold_tokens, start_servers

logger = logging.getLogger(__name__)

SYSTEMS = ("CA", "TT", "IDEAL", "CA2")
PAIRS = (("CA", "TT"), ("CA", "IDEAL"), ("TT", "IDEAL"), ("CA2", "CA"))  # the last: the A/A control


def warm_up(urls: dict[str, str], context_tokens: int, seed: int = 12345) -> None:
    """Two overflowing turns of a made-up chat on every server (lazy set-up of cutting and shifting)."""
    rng = random.Random(seed)
    first = [rng.randrange(10, 4000) for _ in range(context_tokens + 64)]
    second = first + [rng.randrange(10, 4000) for _ in range(64)]
    for url in urls.values():
        generate(url, first)
        generate(url, second)


def run_repeat(urls: dict[str, str], chats: Sequence[Chat], context_tokens: int, repeat: int) -> list[dict]:
    """One pass over every chat's turns, each turn sent to every system in rotated order."""
    names, records, round_index = list(urls), [], 0
    for chat in chats:
        for t, turn in enumerate(chat.turns):
            measured = len(turn.prompt_ids) + 1 > cut_threshold_tokens(context_tokens)
            for position, name in enumerate(rotation(names, round_index)):
                a = generate(urls[name], turn.prompt_ids)
                records.append({"system": name, "repeat": repeat, "chat": chat.chat_id, "turn": t, "measured": measured,
                                "round": round_index, "position": position, "ttft_s": a.elapsed_s,
                                "input_tokens": len(turn.prompt_ids), "prompt_tokens": a.prompt_tokens,
                                "cached_tokens": a.cached_tokens, "truncated_tokens": a.truncated_tokens,
                                "shifted_tokens": a.shifted_tokens})
            round_index += 1
        logger.info("repeat %d: %s done (%d rounds)", repeat, chat.chat_id, round_index)
    return records


def summarize(records: Sequence[dict], systems: Sequence[str]) -> dict:
    """Median TTFT and hit share per system; paired ratios (``PAIRS``) with intervals."""
    rows = [r for r in records if r["measured"]]
    ttft = {n: {(r["repeat"], r["chat"], r["turn"]): r["ttft_s"] for r in rows if r["system"] == n} for n in systems}
    out: dict = {"systems": {}, "ratios": {}, "requests_per_system": len(ttft[systems[0]])}
    for n in systems:
        mine = [r for r in rows if r["system"] == n]
        values = list(ttft[n].values())
        lo, hi = bootstrap_ci(values)
        prompt = sum(r["prompt_tokens"] for r in mine)
        out["systems"][n] = {"median_ttft_s": float(np.median(values)), "median_ttft_ci": [lo, hi],
                             "hit_share": sum(r["cached_tokens"] for r in mine) / prompt,
                             "median_prompt_tokens": float(np.median([r["prompt_tokens"] for r in mine])),
                             "shifted_tokens": sum(r["shifted_tokens"] for r in mine),
                             "cut_requests": sum(r["truncated_tokens"] > 0 for r in mine)}
    for a, b in PAIRS:
        if a in systems and b in systems:
            items = paired_ratio_items(ttft[a], ttft[b])
            median, lo, hi = paired_ratio_ci([x for _, x in items], groups=[k[:2] for k, _ in items])
            out["ratios"][f"{a}/{b}"] = {"median": median, "ci": [lo, hi], "n": len(items)}
    return out


def format_tables(summary: dict) -> str:
    """Markdown: per-system medians and hit shares, then the paired ratios."""
    lines = ["| system | median TTFT ms [95% CI] | hit share (cached / prompt) | median prompt tokens "
             "| shifted tokens |",
             "|---|---|---|---|---|"]
    for n, s in summary["systems"].items():
        lo, hi = s["median_ttft_ci"]
        lines.append(f"| {n} | {s['median_ttft_s'] * 1e3:.1f} [{lo * 1e3:.1f}, {hi * 1e3:.1f}] | {s['hit_share']:.1%} "
                     f"| {s['median_prompt_tokens']:.0f} | {s['shifted_tokens']} |")
    lines += ["", "| paired ratio | median [95% CI] | requests |", "|---|---|---|"]
    for pair, r in summary["ratios"].items():
        lines.append(f"| {pair} | {r['median']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] | {r['n']} |")
    return "\n".join(lines)


def plot_ratios(summary: dict, path: Path) -> None:
    """Median paired TTFT ratios with their 95% intervals (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = list(summary["ratios"])
    med = [summary["ratios"][p]["median"] for p in pairs]
    err = np.array([[m - summary["ratios"][p]["ci"][0], summary["ratios"][p]["ci"][1] - m]
                    for p, m in zip(pairs, med)]).T
    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.barh(pairs, med, xerr=err, capsize=5, color="#4c72b0")
    ax.axvline(1.0, color="k", lw=0.8)
    for y, p in enumerate(pairs):
        ax.text(summary["ratios"][p]["ci"][1], y, f"  {med[y]:.2f}", va="center")
    ax.set_xlabel("median per-request TTFT ratio (95% CI)")
    ax.set_title(f"TTFT after context overflow ({summary['requests_per_system']} paired requests)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=Path("models/trained"))
    p.add_argument("--chats", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--full-context-tokens", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-message-chars", type=int, default=1500)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("runs/overflow/ttft"))
    p.add_argument("--figure", type=Path, default=Path("bench/figures/overflow_ttft.png"))
    p.add_argument("--report-only", action="store_true", help="no servers: redo the tables and figure from --out")
    return p


def report(records: list[dict], extra: dict, out: Path, figure: Path) -> dict:
    """Tables, JSON and PNG of a run's records."""
    summary = summarize(records, SYSTEMS)
    summary.update(extra)
    (out / "result.json").write_text(json.dumps(summary, indent=1))
    (out / "records.json").write_text(json.dumps(records))
    figure.parent.mkdir(parents=True, exist_ok=True)
    plot_ratios(summary, figure)
    print(format_tables(summary))
    print(f"{summary['elapsed_s']:.0f} s; JSON {out / 'result.json'}, PNG {figure}")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        saved = json.loads((args.out / "result.json").read_text())
        extra = {k: saved[k] for k in ("plan", "model", "chats", "repeats", "machine_before", "machine_after",
                                       "elapsed_s") if k in saved}
        report(json.loads((args.out / "records.json").read_text()), extra, args.out, args.figure)
        return 0
    chats = overflowing_chats(ChatRenderer(args.model), args.chats, cut_threshold_tokens(args.context_tokens),
                              cut_threshold_tokens(args.full_context_tokens), args.max_message_chars,
                              max_turns=args.max_turns, seed=args.seed)
    plan = ServerPlan(args.context_tokens, args.full_context_tokens, keep_tokens_for(chats, args.page_size),
                      args.page_size)
    state_before, started, records = machine_state(), time.perf_counter(), []
    with contextlib.ExitStack() as stack:
        servers = start_servers(stack, SYSTEMS, args.model, plan, args.out)
        urls = {n: s.base_url for n, s in servers.items()}
        for repeat in range(args.repeats):
            flush_caches(servers)
            if repeat == 0:
                warm_up(urls, args.context_tokens)
                flush_caches(servers)
            records += run_repeat(urls, chats, args.context_tokens, repeat)
    report(records, {"plan": plan.__dict__, "model": str(args.model), "chats": len(chats), "repeats": args.repeats,
                     "machine_before": state_before, "machine_after": machine_state(),
                     "elapsed_s": time.perf_counter() - started}, args.out, args.figure)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
