"""Every system's fleet of `bench.cluster.run`, all up at once: N SGLang servers, a Mooncake Store
where the kind has one, and SGLang's router (`smg`, `hiradix.testing.router.RouterProcess`) in front.

Start order: the HiCache servers first and alone (SGLang sizes HiCache's host pool against the RAM
available at its start minus a 10 GiB reserve, so they must start before the other servers take
that memory), then every other server at once; then the routers, each waited for until it lists
its N workers healthy. Everything is stopped by PID (an `ExitStack`), also on failure.

A `KIND:cache_aware+events` system's servers run in SGLang's SMG gRPC mode with KV events
(`bench.cluster.smg_grpc.GrpcServerProcess`: worker URL `grpc://...`, `/metrics` on SGLang's HTTP
sidecar, health by the gRPC health service) and its router gets `--tokenizer-path` the model
directory (in gRPC mode smg tokenizes and applies the chat template itself).

Router figures (`RouterSnapshot`): per-worker request counts (`smg_worker_requests_total`) and the
router-side TTFT histogram (`smg_router_ttft_seconds`, buckets summed over label sets; smg 1.13.0 does
not expose it in HTTP mode) and its request-duration histogram (`smg_router_request_duration_seconds`,
which for a streaming request ends when the stream starts), read before and after a repetition and
subtracted.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from bench.cluster.systems import PAGE_TOKENS, FleetSystem, server_launch
from hiradix.testing.mooncake import MooncakeCluster
from hiradix.testing.router import RouterProcess
from hiradix.testing.server import ServerProcess, stop_all
from bench.cluster.smg_grpc import GrpcServerProcess

logger = logging.getLogger("bench.cluster.fleet")
ROUTER_TTFT = "smg_router_ttft_seconds"  # not exposed by smg 1.13.0 in HTTP (regular-worker) mode
# smg 1.13.0 stops this clock when a streaming response starts: a router-side TTFT in practice
ROUTER_DURATION = "smg_router_request_duration_seconds"


@dataclass
class Fleet:
    """One system's processes."""

    system: FleetSystem
    servers: list[ServerProcess]
    router: Optional[RouterProcess] = None
    store: Optional[MooncakeCluster] = None


@dataclass(frozen=True)
class FleetSettings:
    """What every fleet shares."""

    model_path: Path
    servers_per_system: int
    max_total_tokens: int
    dram_ratio: float
    store_bytes: int
    run_dir: Path
    startup_timeout_s: float
    router_args: tuple[str, ...] = ()


@dataclass
class RouterSnapshot:
    """A router's counters at one time: requests per worker URL, router TTFT buckets (le in s -> count)."""

    requests: dict = field(default_factory=dict)
    ttft_buckets: dict = field(default_factory=dict)
    ttft_available: bool = False
    duration_buckets: dict = field(default_factory=dict)  # smg_router_request_duration_seconds, le (s) -> count

    def minus(self, before: "RouterSnapshot") -> "RouterSnapshot":
        return RouterSnapshot({w: n - before.requests.get(w, 0.0) for w, n in self.requests.items()},
                              {le: n - before.ttft_buckets.get(le, 0.0) for le, n in self.ttft_buckets.items()},
                              self.ttft_available,
                              {le: n - before.duration_buckets.get(le, 0.0) for le, n in self.duration_buckets.items()})


def router_snapshot(router: RouterProcess) -> RouterSnapshot:
    """`RouterSnapshot` of `router` now (its Prometheus port)."""
    snap = RouterSnapshot(requests=router.requests_per_worker())
    for labels, value in router.samples(ROUTER_TTFT + "_bucket"):
        le = float(labels["le"])
        snap.ttft_buckets[le] = snap.ttft_buckets.get(le, 0.0) + value
        snap.ttft_available = True
    for labels, value in router.samples(ROUTER_DURATION + "_bucket"):
        le = float(labels["le"])
        snap.duration_buckets[le] = snap.duration_buckets.get(le, 0.0) + value
    return snap


def router_args(system: FleetSystem, settings: FleetSettings) -> list[str]:
    """More `smg launch` flags of `system`'s router: `--router-args`, and for an events system the
    tokenizer (gRPC workers get token ids from the router) and the KV block size (the page size)."""
    args = list(settings.router_args)
    if system.events:
        if "--tokenizer-path" not in args and "--model-path" not in args:
            args += ["--tokenizer-path", str(settings.model_path)]
        if "--block-size" not in args:
            args += ["--block-size", str(PAGE_TOKENS)]
    return args


def _make_fleet(stack: contextlib.ExitStack, system: FleetSystem, settings: FleetSettings) -> Fleet:
    fleet_dir = settings.run_dir / "fleets" / system.slug
    fleet_dir.mkdir(parents=True, exist_ok=True)
    store = None
    if system.has_store:
        store = stack.enter_context(MooncakeCluster(num_holders=1, holder_segment_bytes=settings.store_bytes,
                                                    log_dir=fleet_dir / "store"))  # fmt: skip
    servers = []
    stack.callback(stop_all, servers)  # side by side: each stop waits for its processes
    for i in range(settings.servers_per_system):
        args, env = server_launch(system, store.config() if store else None, settings.model_path,
                                  settings.max_total_tokens, settings.dram_ratio, fleet_dir, i)  # fmt: skip
        server_class = GrpcServerProcess if system.events else ServerProcess
        server = server_class(str(settings.model_path), extra_args=args, env=env,
                              log_path=fleet_dir / f"server-{i}.log", startup_timeout_s=settings.startup_timeout_s)
        servers.append(server)
    logger.info("[%s] %d servers: %s", system.name, len(servers), " ".join(servers[0].extra_args))
    return Fleet(system, servers, None, store)


def _start_and_wait(fleets: Sequence[Fleet]) -> None:
    for fleet in fleets:
        for server in fleet.servers:
            server.start(wait=False)
    for fleet in fleets:
        for server in fleet.servers:
            server.wait_healthy()
        logger.info("[%s] servers healthy (%s s)", fleet.system.name,
                    ", ".join(f"{s.startup_s:.0f}" for s in fleet.servers))


def start_fleets(stack: contextlib.ExitStack, systems: Sequence[FleetSystem], settings: FleetSettings) -> list[Fleet]:
    """Start every system's store, servers and router (see the module docstring); `stack` stops them.

    Raises:
        hiradix.testing.ServerStartError, hiradix.testing.mooncake.StoreStartError,
        hiradix.testing.router.RouterStartError: a process did not come up (the message has its log).
    """
    t0 = time.perf_counter()
    fleets = [_make_fleet(stack, system, settings) for system in systems]
    _start_and_wait([f for f in fleets if f.system.base_kind == "hicache"])
    _start_and_wait([f for f in fleets if f.system.base_kind != "hicache"])
    for fleet in fleets:
        router = RouterProcess(settings.run_dir / "fleets" / fleet.system.slug / "router.log",
                               worker_urls=[s.base_url for s in fleet.servers], policy=fleet.system.policy,
                               extra_args=router_args(fleet.system, settings))  # fmt: skip
        stack.callback(router.stop)
        fleet.router = router.start(timeout_s=settings.startup_timeout_s)
        logger.info("[%s] router %s (%s) lists %d workers", fleet.system.name, router.base_url,
                    fleet.system.policy, router.healthy_workers())
    logger.info("all %d fleets up after %.0f s", len(fleets), time.perf_counter() - t0)
    return fleets
