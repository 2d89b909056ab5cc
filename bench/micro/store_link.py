"""Load or recompute over a shaped store link: TTFT of store-hit turns, always vs never vs auto.

Run as root from the repository root, alone on the machine (issue 19, item 4)::

    flock -x /tmp/hiradix-machine.lock .venv/bin/python -m bench.micro.store_link   # ~10 min

The outer process makes a network namespace ``hiradix-shaped-<pid>`` with only its loopback up,
runs itself inside it (``ip netns exec``: master, holder, servers and client all talk over that
loopback), and removes the namespace at the end, also on failure. Inside: one Mooncake master +
one holder, a writer server (computes each conversation's history and puts it, write-through)
and four readers (``--hiradix-store-read always``, ``never``, ``auto``, ``auto`` again: the A/A
control), readers with ``--hiradix-store-write-policy write_back`` and a pool that never evicts,
so they put nothing on the link while others read. For each link rate (``tc tbf`` on the
namespace's loopback: 10, 1, 0.1 Gbit/s) and trial: a fresh history of ``--history-tokens``
random token ids goes to the writer (its pages land in the store), then the next turn (history
+ ``--new-tokens``) goes to every reader, one at a time, in an order rotated per trial; TTFT is
the latency of a 1-token generation. ``--warmup`` trials per rate are not recorded (the auto
readers' estimates settle). The ideal is the per-trial better of always and never (an oracle).
Prints per rate x behaviour the median TTFT with its bootstrap interval, the paired ratio
auto / better-of-the-two with its interval, the A/A ratio and the estimates the auto reader
exported; writes ``store_link.json`` and ``store_link.png`` to ``runs/store-link-<time>/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import requests

from bench.common.server_metrics import fetch_metrics
from bench.common.stats import bootstrap_ci, paired_ratio_ci, paired_ratios
from hiradix.testing.mooncake import MooncakeCluster
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env

READERS = ("always", "never", "auto", "auto-again")
RATES_GBIT = (10.0, 1.0, 0.1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/tiny")
    p.add_argument("--rates-gbit", type=float, nargs="+", default=list(RATES_GBIT))
    p.add_argument("--trials", type=int, default=14, help="recorded trials per rate")
    p.add_argument("--warmup", type=int, default=3, help="unrecorded trials per rate")
    p.add_argument("--history-tokens", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    return p


# ---------------------------------------------------------------- namespace (outer process)
def run_in_namespace(argv: list[str]) -> int:
    """Make the namespace, run this module inside it with ``argv``, remove it (always)."""
    ns = f"hiradix-shaped-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        # MTU 9000: tbf drops a packet larger than its burst (>= 64 KiB), and loopback's MTU is 64 KiB
        # (the drops showed as 1-2 s stalls of GETs: TCP retransmissions).
        subprocess.run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "mtu", "9000", "up"], check=True)
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "bench.micro.store_link", "--inside", *argv]
        return subprocess.run(cmd, env={**os.environ, "NO_PROXY": "127.0.0.1,localhost"}).returncode
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def burst_bytes(rate_gbit: float) -> int:
    """tbf's bucket: 5 ms of the rate, at least 64 KiB. A fixed 64 KiB bucket caps the link near
    bucket x timer ticks per second (tens of MB/s), far below 1-10 Gbit/s: the first run of this
    benchmark read 5 MB/s at every rate."""
    return max(64 << 10, int(rate_gbit * 1e9 / 8 * 0.005))


def shape(rate_gbit: float) -> None:
    """tbf on this namespace's loopback (replaces the previous rate)."""
    subprocess.run(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", f"{rate_gbit * 1000:g}mbit",
                    "burst", str(burst_bytes(rate_gbit)), "latency", "50ms"], check=True)


# ---------------------------------------------------------------- servers and requests
def start_servers(args, cluster: MooncakeCluster, run_dir: Path) -> dict[str, ServerProcess]:
    store = ["--hiradix-store", "mooncake", "--hiradix-store-config", cluster.config_json()]
    common = ["--enable-hiradix", "--hiradix-dram-gb", "1", "--served-model-name", "default", *store]
    pool = (args.trials + args.warmup) * len(args.rates_gbit) * (args.history_tokens + args.new_tokens + 64) + 8192
    servers = {"writer": ServerProcess(args.model, extra_args=cpu_args(pool) + common,
                                       env=cpu_env(), log_path=run_dir / "writer.log")}
    for name in READERS:
        mode = name.split("-")[0]
        extra = common + ["--hiradix-store-read", mode, "--hiradix-store-write-policy", "write_back"]
        servers[name] = ServerProcess(args.model, extra_args=cpu_args(pool) + extra, env=cpu_env(),
                                      log_path=run_dir / f"{name}.log")
    for s in servers.values():
        s.start(wait=False)
    for s in servers.values():
        s.wait_healthy()
    return servers


def generate(url: str, ids: list[int]) -> tuple[float, int]:
    """One 1-token greedy generation: (seconds, cached tokens)."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    start = time.perf_counter()
    r = requests.post(f"{url}/generate", json=body, timeout=120)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    return elapsed, int(r.json()["meta_info"].get("cached_tokens", 0))


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in fetch_metrics(url).splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def wait_puts(writer: ServerProcess, before: float, pages: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while metric(writer.base_url, "sglang:hiradix_store_pages_total", op="put") < before + pages:
        if time.monotonic() > deadline:
            print("warning: the writer's PUTs did not all land in time", flush=True)
            return
        time.sleep(0.05)


def trial(args, servers: dict, rng: random.Random, order: list[str]) -> dict:
    history = [rng.randrange(100, 4000) for _ in range(args.history_tokens)]
    turn = history + [rng.randrange(100, 4000) for _ in range(args.new_tokens)]
    writer = servers["writer"]
    before = metric(writer.base_url, "sglang:hiradix_store_pages_total", op="put")
    generate(writer.base_url, history)
    wait_puts(writer, before, args.history_tokens // 16)
    out = {}
    for name in order:
        seconds, cached = generate(servers[name].base_url, turn)
        out[name] = {"ttft_s": seconds, "cached_tokens": cached}
    return out


def estimates(url: str) -> dict:
    return {"store_read_bytes_per_s": metric(url, "sglang:hiradix_store_read_bytes_per_s"),
            "prefill_tokens_per_s": metric(url, "sglang:hiradix_prefill_tokens_per_s"),
            "skipped_slow_pages": metric(url, "sglang:hiradix_store_pages_total", op="skipped_slow"),
            "get_pages": metric(url, "sglang:hiradix_store_pages_total", op="get")}


def warm(args, servers: dict, rng: random.Random) -> None:
    """Cold prompts of several lengths to every server (first-call costs, prefill-rate samples)."""
    for n in (256, 1024, 2048, args.history_tokens, 512, 3072):
        for s in servers.values():
            generate(s.base_url, [rng.randrange(100, 4000) for _ in range(n)])


def run_inside(args) -> int:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(args.out or f"runs/store-link-{stamp}")
    run_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    results = {"args": vars(args), "rates": {}}
    with MooncakeCluster(1, holder_segment_bytes=2 << 30, log_dir=run_dir / "mooncake") as cluster:
        shape(max(args.rates_gbit))
        servers = start_servers(args, cluster, run_dir)
        try:
            warm(args, servers, rng)
            for rate in args.rates_gbit:
                shape(rate)
                rows = []
                for t in range(args.warmup + args.trials):
                    order = READERS[t % len(READERS):] + READERS[: t % len(READERS)]
                    row = trial(args, servers, rng, list(order))
                    if t >= args.warmup:
                        rows.append(row)
                    print(f"{rate:g} Gbit/s trial {t}: " + " ".join(f"{k}={v['ttft_s'] * 1e3:.0f}ms/{v['cached_tokens']}"
                                                                  for k, v in row.items()), flush=True)
                results["rates"][f"{rate:g}"] = {"trials": rows, "estimates": {n: estimates(servers[n].base_url)
                                                                               for n in ("auto", "auto-again")}}
        finally:
            for s in servers.values():
                s.stop()
    summary = summarize(results)
    results["summary"] = summary
    (run_dir / "store_link.json").write_text(json.dumps(results, indent=1))
    print_table(summary)
    plot(summary, run_dir / "store_link.png")
    print(f"wrote {run_dir}/store_link.json and store_link.png")
    return 0


# ---------------------------------------------------------------- report
def summarize(results: dict) -> dict:
    out = {}
    for rate, data in results["rates"].items():
        trials = data["trials"]
        ttft = {n: {i: r[n]["ttft_s"] for i, r in enumerate(trials)} for n in READERS}
        ttft["ideal"] = {i: min(r["always"]["ttft_s"], r["never"]["ttft_s"]) for i, r in enumerate(trials)}
        cell = {}
        for n, values in ttft.items():
            v = list(values.values())
            lo, hi = bootstrap_ci(v)
            cell[n] = {"median_ms": float(1e3 * np.median(v)), "ci_ms": [1e3 * lo, 1e3 * hi]}
        better = min(("always", "never"), key=lambda n: cell[n]["median_ms"])
        ratio = paired_ratio_ci(paired_ratios(ttft["auto"], ttft[better]))
        aa = paired_ratio_ci(paired_ratios(ttft["auto-again"], ttft["auto"]))
        out[rate] = {"ttft": cell, "better": better, "auto_vs_better": list(ratio), "aa": list(aa),
                     "auto_within": bool(ratio[1] <= 1.0), "estimates": data["estimates"]}
    return out


def print_table(summary: dict) -> None:
    print(f"{'Gbit/s':>7} {'always ms':>20} {'never ms':>20} {'auto ms':>20} {'ideal ms':>20} "
          f"{'auto/better':>22} {'A/A':>20} {'read MB/s':>10} {'prefill tok/s':>13} {'skipped':>8}")
    for rate, s in summary.items():
        cells = [f"{s['ttft'][n]['median_ms']:.0f} [{s['ttft'][n]['ci_ms'][0]:.0f}, {s['ttft'][n]['ci_ms'][1]:.0f}]"
                 for n in ("always", "never", "auto", "ideal")]
        r, aa, e = s["auto_vs_better"], s["aa"], s["estimates"]["auto"]
        print(f"{rate:>7} " + " ".join(f"{c:>20}" for c in cells)
              + f" {r[0]:.2f} [{r[1]:.2f}, {r[2]:.2f}] {s['better']:>6} {aa[0]:.2f} [{aa[1]:.2f}, {aa[2]:.2f}]".rjust(20)
              + f" {e['store_read_bytes_per_s'] / 1e6:>10.1f} {e['prefill_tokens_per_s']:>13.0f} {e['skipped_slow_pages']:>8.0f}")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rates = list(summary)
    for k, n in enumerate(("always", "never", "auto", "auto-again", "ideal")):
        med = [summary[r]["ttft"][n]["median_ms"] for r in rates]
        err = [[m - summary[r]["ttft"][n]["ci_ms"][0] for r, m in zip(rates, med)],
               [summary[r]["ttft"][n]["ci_ms"][1] - m for r, m in zip(rates, med)]]
        ax.errorbar([i + (k - 2) * 0.08 for i in range(len(rates))], med, yerr=err, fmt="o", label=n, capsize=3)
    ax.set_xticks(range(len(rates)), [f"{r} Gbit/s" for r in rates])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT of the store-hit turn, ms (median, 95% CI)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.inside:
        return run_inside(args)
    return run_in_namespace(argv)


if __name__ == "__main__":
    raise SystemExit(main())
