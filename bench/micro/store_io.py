"""Mooncake Store on loopback: start-up, throughput and fault timings, next to a raw baseline.

Run from the repository root (no test or benchmark running at the same time)::

    .venv/bin/python -m bench.micro.store_io                 # ~1 minute on 2 cores
    .venv/bin/python -m bench.micro.store_io --object-mib 1 --objects 64 --repeats 7

One store (:class:`hiradix.testing.mooncake.MooncakeCluster`: a master and one holder with
``--segment-mib`` MiB) and two clients with ``global_segment_bytes`` 0, pages in a
``DramPool``. Per round, in an order rotated every round, after a discarded warm-up round:

  raw        the baseline: ``batch_put_from`` / ``batch_get_into`` of the bare pages (no trailer,
             no check), the store's own zero-copy path with its default TCP connection pool;
  raw-again  the same once more: the A/A control (its ratio to ``raw`` shows the noise);
  hiradix    :class:`hiradix.tiers.store.mooncake.MooncakeStore`: page + 40-byte trailer per
             object (``batch_put_from_multi_buffers``), gets verified (xxh3 of each page),
             over Mooncake's TCP connection lanes (its default: ``tcp_connection_pool``,
             16 lanes per holder, one key per lane per call);
  hiradix-unpooled  the same without them (``tcp_connection_pool`` false: faster to fail on a
             frozen holder, but it crashes or wedges now and then under load).

Each round puts ``--objects`` new keys, then gets them; GB/s = payload bytes / seconds
(GB = 1e9). Then, once each: master and holder start-up (median of ``--starts`` fresh
clusters) and how long a call takes to fail when the master is killed or frozen and when the
holder is killed or frozen (16 keys; ``rpc_timeout_ms`` 1000, ``transfer_timeout_s`` 2; the
frozen holder also without the connection lanes), and for how long
``exists`` still lists a killed holder's objects. Prints a table (medians, min-max) and writes
``store_io.json`` and ``store_io.png`` to ``runs/store-io-<timestamp>/`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from pathlib import Path

import torch

from hiradix.dataplane.layout import KVLayout
from hiradix.testing.mooncake import MooncakeCluster
from hiradix.tiers.dram import DramPool
from hiradix.tiers.store.mooncake import MooncakeStore, mooncake_env


def _raw_client(config):
    import os

    from mooncake.store import MooncakeDistributedStore

    os.environ.update(mooncake_env(config))
    raw = MooncakeDistributedStore()
    if raw.setup(config.local_hostname, config.metadata_server, 0, 16 << 20, "tcp", "", config.master_server_address):
        raise SystemExit("raw Mooncake client setup failed")
    return raw


def _layout(object_mib: int) -> KVLayout:
    # 2 layers x [2, 16, 8, D] float32: D = 512 gives 1 MiB pages
    return KVLayout(num_layers=2, page_size=16, num_kv_heads=8, head_dim=512 * object_mib, dtype=torch.float32)


def throughput(cluster: MooncakeCluster, args) -> dict[str, dict[str, list[float]]]:
    layout = _layout(args.object_mib)
    pool = DramPool.create_anonymous(layout, 2 * args.objects)
    pool.tensor.copy_(torch.randn(pool.tensor.shape))
    base = pool.tensor.data_ptr()
    page = layout.page_bytes
    raw = _raw_client(cluster.config(tcp_connection_pool=True))  # Mooncake's default transport
    raw.register_buffer(base, pool.dram_bytes)
    ours = MooncakeStore(cluster.config())
    ours.register(base, pool.dram_bytes)
    unpooled = MooncakeStore(cluster.config(tcp_connection_pool=False))
    unpooled.register(base, pool.dram_bytes)
    src = [pool.page_view(i) for i in range(args.objects)]
    dst = [pool.page_view(args.objects + i) for i in range(args.objects)]
    src_ptr = [base + i * page for i in range(args.objects)]
    dst_ptr = [base + (args.objects + i) * page for i in range(args.objects)]

    def raw_round(keys):
        t0 = time.monotonic()
        assert all(c == 0 for c in raw.batch_put_from(keys, src_ptr, [page] * len(keys)))
        t1 = time.monotonic()
        assert all(c == page for c in raw.batch_get_into(keys, dst_ptr, [page] * len(keys)))
        return t1 - t0, time.monotonic() - t1

    def backend_round(backend):
        def run(keys):
            t0 = time.monotonic()
            assert all(backend.put(keys, src))
            t1 = time.monotonic()
            assert all(backend.get(keys, dst))
            return t1 - t0, time.monotonic() - t1

        return run

    systems = {"raw": raw_round, "raw-again": raw_round, "hiradix": backend_round(ours),
               "hiradix-unpooled": backend_round(unpooled)}  # fmt: skip
    results = {name: {"put": [], "get": []} for name in systems}
    names = list(systems)
    for round_index in range(args.repeats + 1):
        order = names[round_index % len(names):] + names[: round_index % len(names)]
        for name in order:
            keys = [f"bench/{name}/{round_index}/{i}" for i in range(args.objects)]
            put_s, get_s = systems[name](keys)
            raw.batch_remove(keys, True)  # keep the segment from filling up
            if round_index:  # round 0 is the warm-up
                results[name]["put"].append(page * args.objects / put_s / 1e9)
                results[name]["get"].append(page * args.objects / get_s / 1e9)
    ours.close()
    unpooled.close()
    raw.close()
    pool.close()
    return results


def _timed(call):
    t0 = time.monotonic()
    result = call()
    return result, time.monotonic() - t0


def faults(args) -> dict[str, float]:
    out: dict[str, float] = {}
    layout = _layout(1)
    pool = DramPool.create_anonymous(layout, 32)
    keys = [f"fault/{i}" for i in range(16)]
    for fault in ("master killed", "master frozen", "holder killed", "holder frozen", "holder frozen, unpooled"):
        with MooncakeCluster(num_holders=1, holder_segment_bytes=64 << 20) as cluster:
            with MooncakeStore(cluster.config(tcp_connection_pool=not fault.endswith("unpooled"))) as store:
                store.register(pool.tensor.data_ptr(), pool.dram_bytes)
                assert all(store.put(keys, [pool.page_view(i) for i in range(16)]))
                {"master killed": cluster.kill_master, "master frozen": cluster.freeze_master,
                 "holder killed": lambda: cluster.kill_holder(0), "holder frozen": lambda: cluster.freeze_holder(0),
                 "holder frozen, unpooled": lambda: cluster.freeze_holder(0)}[fault]()  # fmt: skip
                for _ in range(2):  # the first call after the fault, then the next one
                    ok, seconds = _timed(lambda: store.get(keys, [pool.page_view(16 + i) for i in range(16)]))
                    assert not any(ok)
                    out.setdefault(f"{fault}: get fails after (s)", seconds)
                    out[f"{fault}: next get fails after (s)"] = seconds
                if fault == "holder killed":
                    start = time.monotonic()
                    while all(store.exists(keys)) and time.monotonic() - start < 60:
                        time.sleep(0.1)
                    out["holder killed: exists still says present for (s)"] = time.monotonic() - start
                if fault == "master frozen":
                    cluster.thaw_master()
                if fault.startswith("holder frozen"):
                    cluster.thaw_holder(0)
    pool.close()
    return out


def startups(args) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"master ready (s)": [], "holder ready (s)": []}
    for _ in range(args.starts):
        with MooncakeCluster(num_holders=1, holder_segment_bytes=64 << 20) as cluster:
            out["master ready (s)"].append(cluster.startup_s["master"])
            out["holder ready (s)"].append(cluster.startup_s["holder-0"])
    return out


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):7.3f}  [{min(values):.3f} - {max(values):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--object-mib", type=int, default=1, help="page (object payload) size, MiB")
    parser.add_argument("--objects", type=int, default=64, help="objects per put/get batch")
    parser.add_argument("--repeats", type=int, default=7, help="measured rounds per system")
    parser.add_argument("--segment-mib", type=int, default=512, help="the holder's segment, MiB")
    parser.add_argument("--starts", type=int, default=5, help="fresh clusters for the start-up times")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    out_dir = args.out or Path("runs") / f"store-io-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    out_dir.mkdir(parents=True, exist_ok=True)

    with MooncakeCluster(num_holders=1, holder_segment_bytes=args.segment_mib << 20, log_dir=out_dir / "logs") as c:
        tput = throughput(c, args)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "throughput_gb_s": tput,
              "startup_s": startups(args), "faults_s": faults(args)}  # fmt: skip

    print(f"\n{args.objects} objects of {args.object_mib} MiB per batch, {args.repeats} rounds (median [min - max])")
    print(f"{'system':10} {'put GB/s':>28} {'get GB/s':>28}  get vs raw")
    raw_get = statistics.median(tput["raw"]["get"])
    for name, r in tput.items():
        print(f"{name:10} {_summary(r['put']):>28} {_summary(r['get']):>28}  {statistics.median(r['get']) / raw_get:.2f}")
    for name, values in report["startup_s"].items():
        print(f"{name:45} {_summary(values)}")
    for name, seconds in report["faults_s"].items():
        print(f"{name:45} {seconds:7.3f}")
    (out_dir / "store_io.json").write_text(json.dumps(report, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for offset, op in ((-0.2, "put"), (0.2, "get")):
            ax.boxplot([tput[n][op] for n in tput], positions=[i + offset for i in range(len(tput))], widths=0.35)
        ax.set_xticks(range(len(tput)), [f"{n}\n(put | get)" for n in tput])
        ax.set_ylabel("GB/s (payload)")
        ax.set_title(f"Mooncake Store on loopback, {args.object_mib} MiB objects")
        fig.tight_layout()
        fig.savefig(out_dir / "store_io.png", dpi=120)
    except ImportError:
        print("matplotlib missing: no PNG")
    print(f"\nwritten: {out_dir / 'store_io.json'}")


if __name__ == "__main__":
    main()
