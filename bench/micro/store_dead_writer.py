"""A writer killed inside a Mooncake PUT: how long other writers' PUTs of its keys store nothing.

Run from the repository root (nothing else running)::

    .venv/bin/python -m bench.micro.store_dead_writer            # ~45 s
    .venv/bin/python -m bench.micro.store_dead_writer --kill-after-s 0.1 --checks-s 5,12,35

One store (a master and one holder on loopback, :class:`hiradix.testing.mooncake.MooncakeCluster`).
A child process puts ``--objects`` pages of 1 MiB through
:class:`hiradix.tiers.store.mooncake.MooncakeStore` and is SIGKILLed ``--kill-after-s`` into that
PUT. A survivor (another client) then puts the same keys at once and again at each of
``--checks-s`` seconds after the kill, and after each PUT asks ``exists`` which keys are
readable. Mooncake's batch put reports an already existing key as stored, and its master keeps
a dead writer's unfinished claim on a key for ``put_start_discard_timeout_sec`` (30 s by
default): until then the survivor's PUTs of those keys report success and store nothing.
Prints one line per check and writes ``store_dead_writer.json`` to
``runs/store-dead-writer-<timestamp>/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from hiradix.testing.mooncake import MooncakeCluster
from hiradix.tiers.store import StoreConfig, make_backend

PAGE_BYTES = 1 << 20
KEY_PREFIX = "dead-writer/"


def _pages(count: int) -> tuple[np.ndarray, list[str], list[memoryview]]:
    buf = np.random.default_rng(1).integers(0, 255, count * PAGE_BYTES, dtype=np.uint8)
    keys = [f"{KEY_PREFIX}{i:05d}" for i in range(count)]
    return buf, keys, [memoryview(buf[i * PAGE_BYTES:(i + 1) * PAGE_BYTES]) for i in range(count)]


def writer_main(config_json: str, count: int) -> None:
    """The child: register its pages, say ready, put them all (it is killed during the put)."""
    store = make_backend("mooncake", StoreConfig.parse(config_json, "--config"))
    buf, keys, views = _pages(count)
    store.register(buf.ctypes.data, buf.nbytes)
    print("ready", flush=True)
    store.put(keys, views)
    print("done", flush=True)


def run(count: int, kill_after_s: float, checks_s: list[float], out: Path) -> dict:
    with MooncakeCluster(num_holders=1, holder_segment_bytes=max(256 << 20, 2 * count * PAGE_BYTES),
                         log_dir=out / "store") as cluster:
        child = subprocess.Popen([sys.executable, "-m", "bench.micro.store_dead_writer", "--writer",
                                  cluster.config_json(), "--objects", str(count)],
                                 stdout=subprocess.PIPE, text=True)
        try:
            if child.stdout.readline().strip() != "ready":
                raise RuntimeError("the writer did not start")
            time.sleep(kill_after_s)
        finally:
            child.kill()
            child.wait()
        killed_at = time.monotonic()
        with make_backend("mooncake", cluster.config()) as survivor:
            buf, keys, views = _pages(count)
            survivor.register(buf.ctypes.data, buf.nbytes)
            rows = [{"after_kill_s": None, "readable_before_put": sum(survivor.exists(keys))}]
            for at_s in [0.0, *checks_s]:
                time.sleep(max(0.0, killed_at + at_s - time.monotonic()))
                stored = survivor.put(keys, views)
                readable = survivor.exists(keys)
                rows.append({"after_kill_s": round(time.monotonic() - killed_at, 1), "put_reported_stored": sum(stored),
                             "readable": sum(readable), "unreadable_keys": [k for k, r in zip(keys, readable) if not r][:32]})
    return {"objects": count, "page_bytes": PAGE_BYTES, "kill_after_s": kill_after_s, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.store_dead_writer", description=__doc__.split("\n")[0])
    parser.add_argument("--objects", type=int, default=256, help="pages the writer puts (1 MiB each)")
    parser.add_argument("--kill-after-s", type=float, default=0.3, help="how far into its PUT the writer dies")
    parser.add_argument("--checks-s", default="5,12,35", help="seconds after the kill at which the survivor puts again")
    parser.add_argument("--out", default=None, help="default runs/store-dead-writer-<timestamp>")
    parser.add_argument("--writer", default=None, help=argparse.SUPPRESS)  # the child's role
    args = parser.parse_args(argv)
    if args.writer is not None:
        writer_main(args.writer, args.objects)
        return 0
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or f"runs/store-dead-writer-{stamp}")
    out.mkdir(parents=True, exist_ok=True)
    result = run(args.objects, args.kill_after_s, [float(x) for x in args.checks_s.split(",") if x], out)
    for row in result["rows"]:
        print(json.dumps({k: v for k, v in row.items() if k != "unreadable_keys"}))
    (out / "store_dead_writer.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'store_dead_writer.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
