"""TTFT of turns served from each tier, next to the same turns recomputed (one request at a time).

Starts, one after the other, stock SGLang and SGLang + hiradix with the same model and the same
small HBM pool (`--max-total-tokens`), and replays the same ShareGPT sessions round-robin: turn t
of every session, then turn t+1, one request at a time (no queue, so TTFT is prefill, not
waiting). Between two turns of a session every other session runs, so histories leave HBM; with
hiradix they come back from DRAM or NVMe, on stock they are recomputed. Each hiradix request is
classed by where its hit came from (`cached_tokens_details`: storage > 0 -> NVMe, else host > 0
-> DRAM, else HBM/miss) and compared with the same request (same session and turn, same prompt)
on stock: mean TTFT per class and the ratio.

    python -m bench.ttft.by_tier                     # models/small, 10 sessions x 4 turns
    python -m bench.ttft.by_tier --model models/tiny --sessions 4 --turns 3

Writes `runs/ttft-by-tier-<timestamp>/` (records.json, summary.json, ttft_by_tier.png).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import aiohttp

from bench.common.conversations import load_sessions
from bench.common.multiturn import RequestRecord, WorkloadConfig, fetch_model_id, send_chat_request
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env

REPO_ROOT = Path(__file__).resolve().parents[2]


async def replay_round_robin(base_url: str, sessions, system: str, max_tokens: int,
                             turns: range | None = None) -> list[RequestRecord]:
    """Turn t of every session, then turn t+1 (all turns, or those in ``turns``); one request in flight."""
    config = WorkloadConfig(max_tokens=max_tokens, system=system, progress=False)
    records = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=config.request_timeout_s)) as http:
        model = await fetch_model_id(http, base_url)
        for turn in turns if turns is not None else range(min(s.num_turns for s in sessions)):
            for index, session in enumerate(sessions):
                record = RequestRecord(system, session.session_id, index, turn)
                await send_chat_request(http, base_url, session.prompt_messages(turn), model, config, record)
                if record.error:
                    raise RuntimeError(f"{system} {session.session_id} turn {turn}: {record.error}")
                records.append(record)
    return records


def hit_class(record: RequestRecord) -> str:
    """Where a hiradix request's history came from."""
    if (record.cached_storage_tokens or 0) > 0:
        return "NVMe"
    if (record.cached_host_tokens or 0) > 0:
        return "DRAM"
    return "HBM or miss"


def summarize(stock: list[RequestRecord], hiradix: list[RequestRecord]) -> dict:
    """Mean TTFT per hit class, hiradix vs the same requests on stock (turns >= 2)."""
    paired = {(r.session_index, r.turn_index): r for r in stock}
    classes: dict[str, list[tuple[RequestRecord, RequestRecord]]] = {}
    for r in hiradix:
        if r.turn_index > 0:
            classes.setdefault(hit_class(r), []).append((r, paired[(r.session_index, r.turn_index)]))
    out = {}
    for name, pairs in sorted(classes.items()):
        h = statistics.mean(x.ttft_s for x, _ in pairs)
        s = statistics.mean(y.ttft_s for _, y in pairs)
        out[name] = {
            "requests": len(pairs),
            "prompt_tokens_mean": statistics.mean(x.prompt_tokens for x, _ in pairs),
            "hiradix_cached_tokens_mean": statistics.mean(x.cached_tokens or 0 for x, _ in pairs),
            "stock_cached_tokens_mean": statistics.mean(y.cached_tokens or 0 for _, y in pairs),
            "hiradix_ttft_ms": 1000 * h,
            "stock_ttft_ms": 1000 * s,
            "ratio": h / s,
        }
    return out


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    xs = range(len(names))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([x - 0.2 for x in xs], [summary[n]["stock_ttft_ms"] for n in names], 0.4, label="stock (recomputed)")
    ax.bar([x + 0.2 for x in xs], [summary[n]["hiradix_ttft_ms"] for n in names], 0.4, label="hiradix")
    ax.set_xticks(list(xs), [f"{n}\n(n={summary[n]['requests']})" for n in names])
    ax.set_ylabel("mean TTFT (ms)")
    ax.set_title("Turns >= 2 by where hiradix found the history")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_system(model: Path, name: str, flags: list[str], max_total_tokens: int, sessions, out: Path, max_tokens: int):
    with ServerProcess(model, extra_args=cpu_args(max_total_tokens) + flags, env=cpu_env(), log_path=out / f"{name}.server.log") as srv:
        return asyncio.run(replay_round_robin(srv.base_url, sessions, name, max_tokens))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=REPO_ROOT / "models" / "small")
    p.add_argument("--sessions", type=int, default=10)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-total-tokens", type=int, default=2048, help="HBM pool of both systems, tokens")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--dram-gb", type=float, default=0.02, help="hiradix DRAM tier (small: histories reach NVMe)")
    p.add_argument("--nvme-gb", type=float, default=2.0)
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    out = args.out_dir or REPO_ROOT / "runs" / time.strftime("ttft-by-tier-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "nvme").mkdir(exist_ok=True)
    sessions = load_sessions(args.sessions, args.turns, seed=0)
    hiradix_flags = ["--enable-hiradix", "--hiradix-policy", "lru", "--hiradix-dram-gb", str(args.dram_gb),
                     "--hiradix-nvme-path", str(out / "nvme"), "--hiradix-nvme-gb", str(args.nvme_gb)]  # fmt: skip
    stock = run_system(args.model, "stock", [], args.max_total_tokens, sessions, out, args.max_tokens)
    hiradix = run_system(args.model, "hiradix", hiradix_flags, args.max_total_tokens, sessions, out, args.max_tokens)
    same = sum(a.output_token_ids == b.output_token_ids for a, b in zip(stock, hiradix))
    summary = summarize(stock, hiradix)
    (out / "records.json").write_text(json.dumps([r.__dict__ for r in stock + hiradix], indent=1))
    (out / "summary.json").write_text(json.dumps({"by_class": summary, "identical_outputs": same, "requests": len(stock)}, indent=1))
    plot(summary, out / "ttft_by_tier.png")
    print(f"\n{args.model.name}, {args.sessions} sessions x {args.turns} turns round-robin, HBM {args.max_total_tokens} tokens")
    print(f"{'served from':<12} {'n':>3} {'prompt':>7} {'cached h/s':>12} {'hiradix ms':>11} {'stock ms':>9} {'ratio':>6}")
    for name, row in summary.items():
        print(f"{name:<12} {row['requests']:>3} {row['prompt_tokens_mean']:>7.0f} "
              f"{row['hiradix_cached_tokens_mean']:>5.0f}/{row['stock_cached_tokens_mean']:<6.0f} "
              f"{row['hiradix_ttft_ms']:>11.0f} {row['stock_ttft_ms']:>9.0f} {row['ratio']:>6.2f}")  # fmt: skip
    hits = {t: sum(getattr(r, f"cached_{t}_tokens") or 0 for r in hiradix) for t in ("device", "host", "storage")}
    print(f"hiradix hit tokens by tier: HBM {hits['device']} / DRAM {hits['host']} / NVMe {hits['storage']}")
    print(f"token-identical outputs: {same}/{len(stock)}; results in {out}")


if __name__ == "__main__":
    main()
