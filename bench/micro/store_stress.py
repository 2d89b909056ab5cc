"""Mooncake Store clients under stress, the way I/O workers use them: how often a client crashes or wedges.

Run from the repository root (nothing else running; ~1 minute per run)::

    .venv/bin/python -m bench.micro.store_stress                       # every setting, 6 runs of 50 s
    .venv/bin/python -m bench.micro.store_stress --settings default --runs 12 --core-dumps

Per run: a fresh store (:class:`hiradix.testing.mooncake.MooncakeCluster`, one holder with
``--segment-mib`` MiB, which two clients fill within seconds: puts then meet "no space" and the
store evicts) and ``--clients`` client processes, each a
:class:`hiradix.tiers.store.mooncake.MooncakeStore` with a DRAM arena, looping for
``--duration-s``: put 8 new pages, ``exists`` and get 8 keys of the next client. A client that
dies is counted as a crash (by its signal) and replaced; one whose loop makes no progress for
``--wedge-after-s`` is counted as wedged (its native stacks are saved with ``py-spy dump
--native``), killed and replaced. Every client's Python stacks go to the run's log on a
segfault (faulthandler); with ``--core-dumps`` the clients dump core in the run's folder (read
them with ``gdb -batch -ex "thread apply all bt"``).

Settings (``--settings``, comma-separated):

  default           hiradix's ``StoreConfig`` defaults (no TCP connection pool);
  no-progress-timer the same with ``MC_TCP_PROGRESS_TIMEOUT_SEC=0``;
  pooled            ``tcp_connection_pool`` with Mooncake's default 4 lanes per holder;
  pooled-16-lanes   the same with 16 lanes per holder (``MC_TCP_LANES_PER_PEER``, Mooncake's most).

Prints crashes, wedges and runs per setting and writes ``store_stress.json`` and
``store_stress.png`` (events per minute of client time, per setting) to
``runs/store-stress-<timestamp>/`` (or ``--out``). An event is rare (minutes apart), so compare
settings by their totals over many runs, not one run.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import mmap
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from hiradix.testing.mooncake import MooncakeCluster

PAGE_BYTES = 32768  # one page of the tiny model at page size 16
ARENA_PAGES = 16
BATCH = 8
SETTINGS = {  # name -> (StoreConfig overrides, MC_* variables set over mooncake_env's)
    "default": ({}, {}),
    "no-progress-timer": ({}, {"MC_TCP_PROGRESS_TIMEOUT_SEC": "0"}),
    "pooled": ({"tcp_connection_pool": True}, {"MC_TCP_LANES_PER_PEER": "4"}),  # Mooncake's default lanes
    "pooled-16-lanes": ({"tcp_connection_pool": True}, {"MC_TCP_LANES_PER_PEER": "16"}),
}


def _client(index: int, clients: int, config_json: str, env: dict, until_s: float, beat: str) -> None:
    """One client process: put, exists, get until ``until_s`` (monotonic); a heartbeat per round."""
    faulthandler.enable(all_threads=True)
    from hiradix.tiers.store import StoreConfig, mooncake

    if env:  # MooncakeStore sets mooncake_env's variables at setup: these go over them
        base = mooncake.mooncake_env
        mooncake.mooncake_env = lambda config: {**base(config), **env}
    store = mooncake.MooncakeStore(StoreConfig.parse(config_json, "config"))
    arena = mmap.mmap(-1, PAGE_BYTES * ARENA_PAGES)
    data = np.frombuffer(arena, dtype=np.uint8)
    store.register(int(data.ctypes.data), PAGE_BYTES * ARENA_PAGES)
    view = memoryview(arena)
    pages = [view[i * PAGE_BYTES:(i + 1) * PAGE_BYTES] for i in range(ARENA_PAGES)]
    rng = np.random.default_rng(index)
    round_no = 0
    while time.monotonic() < until_s:
        data[: BATCH * PAGE_BYTES] = rng.integers(0, 255, BATCH * PAGE_BYTES, dtype=np.uint8)
        store.put([f"stress/{index}/{round_no * BATCH + j}" for j in range(BATCH)], pages[:BATCH])
        other = (index + 1) % clients
        keys = [f"stress/{other}/{int(k)}" for k in rng.integers(max(0, (round_no - 8) * BATCH), (round_no + 1) * BATCH, BATCH)]
        store.exists(keys)
        store.get(keys, pages[BATCH:])
        round_no += 1
        Path(beat).write_text(f"{time.monotonic()}\n")
    os._exit(0)


def _last_beat(path: Path) -> float | None:
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None  # being rewritten


def run_once(setting: str, args: argparse.Namespace, out: Path) -> dict:
    """One fresh store and ``args.clients`` clients for ``args.duration_s``; the events seen."""
    overrides, env = SETTINGS[setting]
    ctx = mp.get_context("spawn")
    crashes, wedges, client_s = [], 0, 0.0
    out.mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(out)  # a core lands in the crashing process's working directory
    try:
        with MooncakeCluster(num_holders=1, holder_segment_bytes=args.segment_mib << 20, log_dir=out) as cluster:
            config_json = cluster.config(**overrides).to_json()
            start_s = time.monotonic()
            until_s = start_s + args.duration_s
            live: dict[int, tuple] = {}

            def spawn(index: int) -> None:
                beat = out / f"beat{index}"
                beat.write_text(f"{time.monotonic()}\n")
                proc = ctx.Process(target=_client, args=(index, args.clients, config_json, env, until_s, str(beat)))
                proc.start()
                live[index] = (proc, beat, time.monotonic())

            for index in range(args.clients):
                spawn(index)
            while live:
                time.sleep(0.5)
                for index, (proc, beat, born_s) in list(live.items()):
                    if proc.exitcode is not None:
                        client_s += time.monotonic() - born_s
                        del live[index]
                        if proc.exitcode != 0:
                            crashes.append({"client": index, "exit": proc.exitcode, "at_s": round(time.monotonic() - start_s, 1)})
                            if time.monotonic() < until_s - 5:
                                spawn(index)
                        continue
                    last = _last_beat(beat)
                    if last is not None and time.monotonic() - last > args.wedge_after_s:
                        wedges += 1
                        dump = out / f"wedge-{index}-{wedges}.txt"
                        with dump.open("w") as f:
                            subprocess.run([str(Path(sys.executable).parent / "py-spy"), "dump", "--native", "--pid",
                                            str(proc.pid)], stdout=f, stderr=subprocess.STDOUT, timeout=60, check=False)
                        proc.kill()
                        proc.join()
                        client_s += time.monotonic() - born_s
                        del live[index]
                        if time.monotonic() < until_s - 5:
                            spawn(index)
    finally:
        os.chdir(cwd)
    return {"setting": setting, "crashes": crashes, "wedges": wedges, "client_s": round(client_s, 1)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated: " + ", ".join(SETTINGS))
    parser.add_argument("--runs", type=int, default=6, help="runs per setting (a fresh store each)")
    parser.add_argument("--duration-s", type=float, default=50.0)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--segment-mib", type=int, default=64, help="the holder's segment (small: the store fills)")
    parser.add_argument("--wedge-after-s", type=float, default=30.0)
    parser.add_argument("--core-dumps", action="store_true", help="let crashing clients dump core in the run folder")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    unknown = [s for s in args.settings.split(",") if s not in SETTINGS]
    if unknown:
        parser.error(f"--settings: unknown {unknown}; choose from {list(SETTINGS)}")
    return args


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    rates = [60.0 * (r["crashes"] + r["wedges"]) / max(r["client_s"], 1.0) for r in results.values()]
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.bar(names, rates)
    ax.set_ylabel("crashes + wedges per client-minute")
    ax.set_title("Mooncake clients under stress")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or Path("runs") / f"store-stress-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    if args.core_dumps:
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    totals: dict[str, dict] = {}
    runs = []
    for run in range(args.runs):  # settings interleaved, so a noisy minute hits them alike
        for setting in args.settings.split(","):
            result = run_once(setting, args, out / f"{setting}-{run}")
            runs.append(result)
            total = totals.setdefault(setting, {"crashes": 0, "wedges": 0, "runs": 0, "client_s": 0.0})
            total["crashes"] += len(result["crashes"])
            total["wedges"] += result["wedges"]
            total["runs"] += 1
            total["client_s"] += result["client_s"]
            print(json.dumps(result), flush=True)
    print(f"{'setting':10} {'runs':>5} {'client min':>11} {'crashes':>8} {'wedges':>7}")
    for setting, total in totals.items():
        print(f"{setting:10} {total['runs']:5d} {total['client_s'] / 60:11.1f} {total['crashes']:8d} {total['wedges']:7d}")
    (out / "store_stress.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "totals": totals, "runs": runs}, indent=1))
    _plot(totals, out / "store_stress.png")
    print(f"wrote {out}/store_stress.json and store_stress.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
