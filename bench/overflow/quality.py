"""Answer perplexity after a context overflow: CA (shifted reuse) vs TT vs NKVT vs FULL (issue 20).

Four hiradix servers of one model (``bench.overflow.servers``): CA, TT, NKVT with a small
context, FULL with a context that holds every chat. Every chat (``bench.overflow.chats``: ShareGPT,
the tokenizer's chat template, a fixed system prompt, the dataset's answers as history) is sent
turn by turn to every server. Each turn: step A sends ``prompt ‖ answer`` for one new token (the
server cuts it and, for CA, reuses the kept tail shifted; ``prompt_tokens`` = the cut length L).
From the turn where the chat first overflows the small context on, step B sends the same input
again with ``logprob_start_len = L - len(answer) - 1`` (SGLang leaves that first position's
log-probability None; ``bench.overflow.client``): the server cuts it the same way (it reuses the
earlier cut) and returns each answer token's log-probability given the (cut) history and the
top-1 prediction there. A turn whose step B cut differently from step A, or that did not return
exactly the answer's tokens, is flagged and left out (for every system).

Perplexity, agreement with TT and intervals: ``bench.overflow.quality_report``.

    flock -x /tmp/hiradix-machine.lock .venv/bin/python -m bench.overflow.quality --chats 20
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Sequence

from bench.overflow.chats import Chat, ChatRenderer, Turn, keep_tokens_for, overflowing_chats
from bench.overflow.client import generate
from bench.overflow.quality_report import format_table, plot_quality, quality_table, reuse_figures
from bench.overflow.servers import UNCUT, ServerPlan, cut_threshold_tokens, start_servers

logger = logging.getLogger(__name__)

SYSTEMS = ("TT", "CA", "NKVT", "FULL")


def measure_turn(base_url: str, turn: Turn, measured: bool) -> dict:
    """Step A (and, for a measured turn, step B) of one turn on one server; see the module doc."""
    a = generate(base_url, turn.input_ids)
    rec = {"measured": measured, "prompt_tokens": a.prompt_tokens, "truncated_tokens": a.truncated_tokens,
           "shifted_tokens": a.shifted_tokens, "cached_tokens": a.cached_tokens, "ok": False, "why": ""}
    if not measured:
        return rec
    num_answer = len(turn.answer_ids)
    b = generate(base_url, turn.input_ids, logprob_start_len=a.prompt_tokens - num_answer - 1)
    logprobs, top1 = b.token_logprobs[1:], b.top1[1:]  # position L - n - 1 comes back as None
    ids = [tid for _, tid in logprobs]
    if b.truncated_tokens != a.truncated_tokens or b.prompt_tokens != a.prompt_tokens:
        rec["why"] = f"step B cut {b.truncated_tokens} ({b.prompt_tokens} kept), step A {a.truncated_tokens}"
    elif ids != list(turn.answer_ids) or len(top1) != num_answer or any(lp is None for lp, _ in logprobs):
        rec["why"] = f"step B returned {len(ids)} positions, not the {num_answer} answer tokens"
    elif any(t is None or t[0] < lp - 1e-3 or (t[1] == tid and abs(t[0] - lp) > 1e-3)
             for t, (lp, tid) in zip(top1, logprobs)):
        rec["why"] = "top-1 predictions do not line up with the answer tokens' log-probabilities"
    else:
        rec["ok"] = True
    rec.update(nll=[-lp for lp, _ in logprobs if lp is not None], top1=[t[1] if t else None for t in top1],
               step_b_cached_tokens=b.cached_tokens)
    return rec


def run_chats(urls: dict[str, str], chats: Sequence[Chat], context_tokens: int) -> list[dict]:
    """Every turn of every chat to every server, in order; one record per (system, chat, turn).
    Measured: the turns from the first one the small-context servers cut."""
    records = []
    for c, chat in enumerate(chats):
        first = chat.first_overflow(cut_threshold_tokens(context_tokens))
        started = time.perf_counter()
        for t, turn in enumerate(chat.turns):
            for name, url in urls.items():
                rec = measure_turn(url, turn, measured=t >= first)
                records.append({"system": name, "chat": chat.chat_id, "turn": t, "since_overflow": t - first,
                                "input_tokens": len(turn.input_ids), "answer_tokens": len(turn.answer_ids), **rec})
                if rec["measured"] and name not in UNCUT and rec["truncated_tokens"] == 0:
                    rec.update(ok=False, why="the server did not cut a turn expected to overflow")
                if rec["measured"] and not rec["ok"]:
                    logger.warning("[%s] %s turn %d flagged: %s", name, chat.chat_id, t, rec["why"])
        logger.info("chat %d/%d %s: %d turns (%d measured) in %.1f s", c + 1, len(chats), chat.chat_id,
                    len(chat.turns), len(chat.turns) - first, time.perf_counter() - started)
    return records


def machine_state() -> dict:
    """``nproc`` and the load averages (1, 5, 15 min) now."""
    return {"nproc": os.cpu_count(), "loadavg": list(os.getloadavg())}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=Path("models/trained"))
    p.add_argument("--chats", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--full-context-tokens", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-message-chars", type=int, default=1500)
    p.add_argument("--max-turns", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("runs/overflow/quality"))
    p.add_argument("--figure", type=Path, default=Path("bench/figures/overflow_quality.png"))
    p.add_argument("--report-only", action="store_true",
                   help="no servers: recompute the tables and figure from --out's records.json and result.json")
    return p


def report(records: list[dict], extra: dict, out: Path, figure: Path) -> dict:
    """Tables (all turns, first cuts, later turns), reuse figures, JSON and PNG."""
    result = quality_table(records, SYSTEMS)
    result["first_cut"] = quality_table([r for r in records if r["since_overflow"] == 0], SYSTEMS)
    result["later"] = quality_table([r for r in records if r["since_overflow"] > 0], SYSTEMS)
    result.update(reuse={n: reuse_figures(records, n) for n in SYSTEMS},
                  flagged=[{k: r[k] for k in ("system", "chat", "turn", "why")}
                           for r in records if r["measured"] and not r["ok"]], **extra)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    (out / "records.json").write_text(json.dumps(records))
    figure.parent.mkdir(parents=True, exist_ok=True)
    plot_quality(result, figure)
    print(format_table(result))
    for part, title in (("first_cut", "first cut of each chat (every system cuts alike)"),
                        ("later", "later turns (CA/NKVT keep their earlier cut, TT cuts afresh)")):
        print(f"\n{title}: {result[part]['turns']} turns, {result[part]['answer_tokens']} tokens")
        print(format_table(result[part]))
    ca = result["reuse"]["CA"]
    print(f"turns {result['turns']} of {result['chats']} chats, {result['answer_tokens']} answer tokens; "
          f"CA shifted {ca['shifted_tokens']} of {ca['prompt_tokens']} cut-prompt tokens ({ca['shifted_share']:.1%}) "
          f"on {ca['turns_with_shift']}/{ca['turns']} turns, cached share {ca['cached_share']:.1%}; "
          f"flagged {len(result['flagged'])}; {result.get('elapsed_s', 0):.0f} s; "
          f"JSON {out / 'result.json'}, PNG {figure}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        saved = json.loads((args.out / "result.json").read_text())
        extra = {k: saved[k] for k in ("plan", "model", "machine_before", "machine_after", "elapsed_s", "argv")}
        report(json.loads((args.out / "records.json").read_text()), extra, args.out, args.figure)
        return 0
    renderer = ChatRenderer(args.model)
    chats = overflowing_chats(renderer, args.chats, cut_threshold_tokens(args.context_tokens),
                              cut_threshold_tokens(args.full_context_tokens),
                              args.max_message_chars, max_turns=args.max_turns, seed=args.seed)
    plan = ServerPlan(args.context_tokens, args.full_context_tokens, keep_tokens_for(chats, args.page_size),
                      args.page_size)
    state_before = machine_state()
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        servers = start_servers(stack, SYSTEMS, args.model, plan, args.out)
        records = run_chats({n: s.base_url for n, s in servers.items()}, chats, args.context_tokens)
    extra = {"plan": plan.__dict__, "model": str(args.model), "machine_before": state_before,
             "machine_after": machine_state(), "elapsed_s": time.perf_counter() - started,
             "argv": list(sys.argv[1:] if argv is None else argv)}
    result = report(records, extra, args.out, args.figure)
    return 0 if not math.isnan(result["systems"]["TT"]["perplexity"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
