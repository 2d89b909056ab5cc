"""Where the scheduler's time goes on cached turns: py-spy over an SGLang + hiradix server.

Starts SGLang + hiradix (same CPU settings as `bench.ab.run`), replays ShareGPT sessions round-robin
with one request in flight (turn t of every session, then turn t+1) so histories leave HBM
between turns and come back from DRAM/NVMe, and records the scheduler process with py-spy
(`record --format raw --idle`) during turns >= `--profile-from-turn` only. Prints the share of
samples by inclusive frame (model forward, attention, hiradix code, prefix matching, ...) and
the top leaf functions, and the turns' mean prompt/cached tokens and TTFT.

    python -m bench.ttft.profile                      # models/small, 6 sessions x 4 turns
    python -m bench.ttft.profile --model models/tiny --sessions 3 --turns 3

Writes `runs/profile-ttft-<timestamp>/` (pyspy.raw.txt, profile.json, server.log).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

from bench.common.conversations import load_sessions
from bench.ttft.by_tier import replay_round_robin
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env

REPO_ROOT = Path(__file__).resolve().parents[2]
# Inclusive buckets: a sample counts for every bucket whose pattern appears in its stack.
BUCKETS = {
    "model forward (prefill+decode)": "ModelRunner.forward (",
    "prefill attention": "_run_sdpa_forward_extend",
    "decode attention": "_run_sdpa_forward_decode",
    "hiradix (any)": "hiradix/",
    "hiradix layer-wise load": "layerwise.py",
    "hiradix match/insert": "hiradix/core/tree.py",
    "hiradix tier controller": "hiradix/core/controller.py",
    "scheduler batch building": "get_new_batch_prefill",
    "waiting for requests": "recv_requests",
    "idle sleep": "maybe_sleep_on_idle",
}


def scheduler_pid(server: ServerProcess) -> int:
    """The scheduler subprocess (SGLang titles it ``sglang::scheduler``).

    Raises:
        RuntimeError: no such process under the server.
    """
    for proc in server.descendants():
        if "sglang::scheduler" in " ".join(proc.cmdline()) or proc.name().startswith("sglang::schedul"):
            return proc.pid
    raise RuntimeError("no sglang::scheduler process found")


def summarize(raw_path: Path) -> dict:
    """Sample shares of the scheduler's main thread (idle included, so ~wall time) by bucket
    (inclusive) and by leaf function (self), from py-spy raw output."""
    total, buckets, leaves = 0, collections.Counter(), collections.Counter()
    for line in raw_path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        if not stack.startswith("<module>"):
            continue  # other threads (watchdog, ZMQ, ...): only the scheduler's main thread
        count = int(count_text)
        total += count
        for name, pattern in BUCKETS.items():
            if pattern in stack:
                buckets[name] += count
        leaves[stack.split(";")[-1]] += count
    share = {name: buckets[name] / total for name in BUCKETS} if total else {}
    top = [(leaf, n / total) for leaf, n in leaves.most_common(15)] if total else []
    return {"samples": total, "inclusive_share": share, "top_self": top}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="models/small")
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--profile-from-turn", type=int, default=2)
    parser.add_argument("--max-total-tokens", type=int, default=2048)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-message-chars", type=int, default=600)
    parser.add_argument("--dram-gb", type=float, default=0.02)
    parser.add_argument("--nvme-gb", type=float, default=2.0)
    parser.add_argument("--out-dir", default=None)
    args = parser.parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(__file__).resolve().parents[2] / ".venv/bin/py-spy")
    out = Path(args.out_dir or REPO_ROOT / "runs" / time.strftime("profile-ttft-%Y%m%d-%H%M%S"))
    (out / "nvme").mkdir(parents=True, exist_ok=True, mode=0o700)
    sessions = load_sessions(args.sessions, args.turns, 0, args.max_message_chars, "auto")
    flags = cpu_args(args.max_total_tokens) + [
        "--enable-hiradix", "--hiradix-dram-gb", str(args.dram_gb),
        "--hiradix-nvme-path", str(out / "nvme"), "--hiradix-nvme-gb", str(args.nvme_gb)]  # fmt: skip
    with ServerProcess(REPO_ROOT / args.model, extra_args=flags, env=cpu_env(), log_path=out / "server.log") as server:
        asyncio.run(replay_round_robin(server.base_url, sessions, "hiradix", args.max_tokens, range(0, args.profile_from_turn)))
        raw = out / "pyspy.raw.txt"
        spy = subprocess.Popen([py_spy, "record", "--format", "raw", "--idle", "--rate", "200", "-o", str(raw),
                                "-p", str(scheduler_pid(server))], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            records = asyncio.run(replay_round_robin(server.base_url, sessions, "hiradix", args.max_tokens,
                                                     range(args.profile_from_turn, args.turns)))
        finally:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
    report = summarize(raw)
    report["turns"] = {
        "n": len(records), "mean_prompt_tokens": statistics.mean(r.prompt_tokens for r in records),
        "mean_cached_tokens": statistics.mean(r.cached_tokens for r in records),
        "mean_ttft_ms": 1e3 * statistics.mean(r.ttft_s for r in records)}
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report["turns"]))
    for name, share in report["inclusive_share"].items():
        print(f"{name:<28} {share:6.1%}")
    print("top self (leaf) frames:")
    for leaf, share in report["top_self"]:
        print(f"  {share:6.1%}  {leaf}")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
