"""Answer perplexity when the chat history comes back from a compressed cold tier (issue 21, item 3).

Three hiradix servers of ``models/trained`` (``bench.cold.servers``): cold format ``exact``,
``fp8`` and ``int4`` on NVMe, with the same small device pool and tiny DRAM. ShareGPT chats
(``bench.cold.chats``: the tokenizer's chat template, a fixed system message, the dataset's answers
as history, every input within 1,000 tokens) are sent round by round: turn t of every chat, then
filler prompts (random token ids) until the round has pushed ``--flush-tokens`` tokens through, so
when a chat's next turn comes its history has left the device pool and DRAM and sits on NVMe in the
server's format. Each turn after the first is one ``/generate`` of ``prompt ‖ answer`` with
``return_logprob``, ``top_logprobs_num 1`` and ``logprob_start_len = L - len(answer) - 1``
(``bench.overflow.client``; SGLang 0.5.23 returns None at the start position): each answer
token's log-probability given the (cached) history, and the top-1 prediction there.
``meta_info.cached_tokens_details["storage"]`` says how much of the history came from NVMe; a turn
counts only if, on every server, it returned exactly the answer's tokens and at least
``--min-storage-share`` of its history (whole pages) came from NVMe.

Perplexity, agreement with ``exact`` and intervals: ``bench.cold.report``.

    flock -x /tmp/hiradix-machine.lock .venv/bin/python -m bench.cold.quality --chats 40
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Sequence

from bench.cold.chats import fitting_chats
from bench.cold.report import format_table, quality_table
from bench.cold.servers import FORMATS, ColdPlan, start_servers
from bench.overflow.chats import Chat, ChatRenderer, Turn
from bench.overflow.client import generate

logger = logging.getLogger(__name__)


def measure_turn(base_url: str, turn: Turn, history_tokens: int, min_storage_share: float) -> dict:
    """One teacher-forced request of a measured turn; see the module doc."""
    num_answer, length = len(turn.answer_ids), len(turn.input_ids)
    b = generate(base_url, turn.input_ids, logprob_start_len=length - num_answer - 1)
    logprobs, top1 = b.token_logprobs[1:], b.top1[1:]  # position L - n - 1 comes back as None
    storage = int(b.cached_details.get("storage", 0) or 0)
    rec = {"prompt_tokens": b.prompt_tokens, "cached_tokens": b.cached_tokens, "history_tokens": history_tokens,
           "storage_tokens": storage, "host_tokens": int(b.cached_details.get("host", 0) or 0),
           "device_tokens": int(b.cached_details.get("device", 0) or 0), "elapsed_s": b.elapsed_s,
           "nll": [-lp for lp, _ in logprobs if lp is not None], "top1": [t[1] if t else None for t in top1],
           "ok": False, "why": ""}
    if b.prompt_tokens != length or [tid for _, tid in logprobs] != list(turn.answer_ids) \
            or len(top1) != num_answer or any(lp is None for lp, _ in logprobs) or any(t is None for t in top1):
        rec["why"] = f"returned {len(logprobs)} positions, not the {num_answer} answer tokens"
    elif storage < min_storage_share * history_tokens:
        rec["why"] = f"{storage} of {history_tokens} history tokens from NVMe"
    else:
        rec["ok"] = True
    return rec


def send_filler(urls: dict[str, str], rng: random.Random, num_tokens: int, vocab_tokens: int) -> None:
    """One prompt of ``num_tokens`` random token ids (no shared prefix) to every server."""
    ids = [rng.randrange(10, vocab_tokens) for _ in range(num_tokens)]
    for url in urls.values():
        generate(url, ids)


def run_rounds(urls: dict[str, str], chats: Sequence[Chat], page_size: int, flush_tokens: int,
               filler_tokens: int, min_storage_share: float, vocab_tokens: int, seed: int) -> tuple[list[dict], int]:
    """Round t sends turn t of every chat (that has it) to every server, then fillers until the
    round's tokens reach ``flush_tokens``. Returns the records of turns >= 1 and the filler count."""
    rng = random.Random(seed + 1)
    records, fillers = [], 0
    for t in range(max(len(c.turns) for c in chats)):
        started, sent = time.perf_counter(), 0
        for chat in (c for c in chats if len(c.turns) > t):
            turn = chat.turns[t]
            sent += len(turn.input_ids)
            if t == 0:
                for url in urls.values():
                    generate(url, turn.input_ids)
                continue
            history = len(chat.turns[t - 1].input_ids) // page_size * page_size
            for name, url in urls.items():
                rec = measure_turn(url, turn, history, min_storage_share)
                records.append({"system": name, "chat": chat.chat_id, "turn": t,
                                "answer_tokens": len(turn.answer_ids), **rec})
                if not rec["ok"]:
                    logger.warning("[%s] %s turn %d flagged: %s", name, chat.chat_id, t, rec["why"])
        while sent < flush_tokens:
            send_filler(urls, rng, filler_tokens, vocab_tokens)
            sent, fillers = sent + filler_tokens, fillers + 1
        logger.info("round %d: %d chats, %d tokens in %.1f s", t, sum(len(c.turns) > t for c in chats), sent,
                    time.perf_counter() - started)
    return records, fillers


def machine_state() -> dict:
    """``nproc`` and the load averages (1, 5, 15 min) now."""
    return {"nproc": os.cpu_count(), "loadavg": list(os.getloadavg())}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=Path("models/trained"))
    p.add_argument("--chats", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-input-tokens", type=int, default=1000)
    p.add_argument("--min-turns", type=int, default=3)
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--pool-tokens", type=int, default=2048)
    p.add_argument("--dram-gb", type=float, default=0.004)
    p.add_argument("--nvme-gb", type=float, default=1.0)
    p.add_argument("--flush-tokens", type=int, default=8192, help="tokens each round pushes through (fillers add)")
    p.add_argument("--filler-tokens", type=int, default=512)
    p.add_argument("--min-storage-share", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=Path("runs/cold/quality"))
    p.add_argument("--report-only", action="store_true", help="no servers: recompute from --out's records.json")
    return p


def report(records: list[dict], extra: dict, out: Path) -> dict:
    """Table, JSON (``result.json``, ``records.json``)."""
    result = quality_table(records, FORMATS)
    result.update(flagged=[{k: r[k] for k in ("system", "chat", "turn", "why")} for r in records if not r["ok"]],
                  **extra)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    (out / "records.json").write_text(json.dumps(records))
    print(format_table(result))
    print(f"{result['turns']} turns of {result['chats']} chats, {result['answer_tokens']} answer tokens counted; "
          f"flagged {len(result['flagged'])} (system, turn) records; {extra.get('fillers', 0)} fillers; "
          f"{extra.get('elapsed_s', 0):.0f} s; JSON {out / 'result.json'}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        saved = json.loads((args.out / "result.json").read_text())
        extra = {k: saved[k] for k in saved if k not in ("systems", "turns", "chats", "answer_tokens", "flagged")}
        report(json.loads((args.out / "records.json").read_text()), extra, args.out)
        return 0
    renderer = ChatRenderer(args.model)
    chats = fitting_chats(renderer, args.chats, args.max_input_tokens, args.min_turns, args.max_turns, seed=args.seed)
    plan = ColdPlan(args.page_size, args.pool_tokens, args.dram_gb, args.nvme_gb)
    vocab = len(renderer.tokenizer)
    state_before, started = machine_state(), time.perf_counter()
    with contextlib.ExitStack() as stack:
        servers = start_servers(stack, FORMATS, args.model, plan, args.out)
        records, fillers = run_rounds({n: s.base_url for n, s in servers.items()}, chats, args.page_size,
                                      args.flush_tokens, args.filler_tokens, args.min_storage_share, vocab, args.seed)
    extra = {"plan": plan.__dict__, "model": str(args.model), "machine_before": state_before,
             "machine_after": machine_state(), "elapsed_s": time.perf_counter() - started, "fillers": fillers,
             "argv": list(sys.argv[1:] if argv is None else argv)}
    report(records, extra, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
