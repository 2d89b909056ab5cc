"""The servers of a `bench.ab` run: started at once, warmed up, flushed between repetitions, and
their CPU seconds by role."""

from __future__ import annotations

import contextlib
import logging
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

import psutil

from bench.ab.systems import System
from bench.common import server_cpu, server_metrics
from bench.common.conversations import Session
from bench.common.multiturn import WorkloadConfig, run_workload
from hiradix.testing.server import ServerProcess, cpu_args, cpu_env, stop_all

logger = logging.getLogger("bench.ab.servers")


def warm_up(base_url: str, config: WorkloadConfig, batch: int = 1) -> None:
    """`batch` unrelated short requests at once, so lazy initialisation (of a batch of that size
    too) does not land in the first measured round.

    Raises:
        RuntimeError: If a warm-up request fails.
    """
    warm = [Session(f"warmup{i}", ({"role": "user", "content": f"Warm-up {i}: say hello."},), "synthetic")
            for i in range(max(1, batch))]
    records = run_workload(base_url, warm, config, system="warmup", progress=False,
                           max_concurrent_sessions=len(warm), session_rate_per_s=None, think_time_s=0.0)
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up request failed: {failed[0]}")


def start_servers(stack: contextlib.ExitStack, systems: Sequence[System], model_path: str, pool_tokens: int,
                  run_dir: Path, startup_timeout_s: float, tp_size: int = 1) -> dict[str, ServerProcess]:
    """Start every system's server at once, each with `--tp-size tp_size`, and wait until all are
    healthy (stopped by `stack`).

    Raises:
        hiradix.testing.ServerStartError: If one does not come up (message has its log).
    """
    servers = {}
    stack.callback(lambda: stop_all(servers.values()))  # side by side: each stop waits for its processes
    for system in systems:
        extra = cpu_args(system.max_total_tokens or pool_tokens) + ["--tp-size", str(tp_size), *system.server_args]
        logger.info("[%s] starting server: %s", system.name, " ".join(extra))
        server = ServerProcess(model_path, extra_args=extra, env=cpu_env(tp_size=tp_size),
                               startup_timeout_s=startup_timeout_s, log_path=run_dir / f"{system.name}.server.log")
        servers[system.name] = server
        server.start(wait=False)
    for name, server in servers.items():
        server.wait_healthy()
        logger.info("[%s] healthy on %s after %.1f s", name, server.base_url, server.startup_s)
    return servers


def flush_caches(servers: dict[str, ServerProcess], timeout_s: float = 120.0, poll_s: float = 0.5) -> None:
    """Empty every server's prefix cache between repetitions, as fresh servers would start.

    `POST /flush_cache` (SGLang's endpoint; it refuses while requests are queued or running, so it is
    retried), then, on hiradix servers, wait until every tier gauge reads 0 (pages of transfers in
    flight are freed when their I/O lands). HiCache's storage files stay, but each repetition has
    sessions of its own, so nothing of an earlier one can hit.

    Raises:
        TimeoutError: A server's cache is not empty after `timeout_s`.
    """
    for name, server in servers.items():
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                request = urllib.request.Request(server.base_url + "/flush_cache", method="POST")
                with urllib.request.urlopen(request, timeout=30) as resp:
                    flushed = resp.status == 200
            except urllib.error.HTTPError:
                flushed = False
            used = server_metrics.tier_used_tokens(server_metrics.fetch_metrics(server.base_url))
            if flushed and used == 0:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"[{name}] cache not empty {timeout_s:.0f} s after /flush_cache")
            time.sleep(poll_s)  # the idle scheduler steps about once a second
        logger.info("[%s] cache flushed", name)


def server_cpu_seconds(server: ServerProcess) -> dict[str, float]:
    """CPU seconds so far of the server's processes, by role (`bench.common.server_cpu`)."""
    processes = []
    for pid in server.pids():
        try:
            processes.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue  # ended meanwhile: its seconds are gone with it
    return server_cpu.cpu_seconds_by_role(processes, server.pid)


def snapshot(server: ServerProcess) -> tuple[server_metrics.MetricsSnapshot, dict[str, float]]:
    """The server's `/metrics` counters and its processes' CPU seconds now (`figures_since` takes it)."""
    return server_metrics.parse_snapshot(server_metrics.fetch_metrics(server.base_url)), server_cpu_seconds(server)


def figures_since(server: ServerProcess, before: tuple, workload_s: float) -> dict:
    """A server's figures over a workload that began at `before` (`snapshot`):
    `{startup_s, workload_s, metrics, cpu}` (`metrics` and `cpu`: the deltas)."""
    metrics, cpu = before
    after = server_metrics.parse_snapshot(server_metrics.fetch_metrics(server.base_url))
    return {"startup_s": server.startup_s or float("nan"), "workload_s": workload_s,
            "metrics": server_metrics.delta(after, metrics),
            "cpu": server_cpu.cpu_delta(server_cpu_seconds(server), cpu)}
