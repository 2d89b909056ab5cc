"""SGLang's router (the Shepherd Model Gateway, PyPI ``smg``) as a process for tests and benchmarks.

``smg launch`` in front of SGLang servers on loopback: regular mode (``--worker-urls``) or PD mode
(``--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL``). The router says it is up
before its workers are healthy, so :meth:`RouterProcess.start` waits until ``/workers`` lists every
worker healthy and ready. Its health checks call the workers' ``/health``; the interval and timeout are set long enough
for CPU workers. Its Prometheus metrics are read from its own port (:meth:`RouterProcess.samples`,
:meth:`RouterProcess.requests_per_worker`). Stopped by PID (its process group), also on failure.

Workers behind it need ``--served-model-name`` equal to the ``model`` the clients send (the router
picks workers by model id; the tests use ``default``). A request sent to a worker that died is
retried on another one (``smg_worker_retries_total``); the dead worker leaves ``/workers``' healthy
list at the next failed health check and comes back once its ``/health`` answers again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, Sequence

from prometheus_client.parser import text_string_to_metric_families

from hiradix.testing import diagnose
from hiradix.testing.server import launch_env, pick_free_port


class RouterStartError(RuntimeError):
    """The router exited or did not become ready in time (the message has its log's tail)."""


def smg_binary() -> str:
    """The ``smg`` command of this interpreter's environment (installed by scripts/setup).

    Raises:
        FileNotFoundError: smg is not installed.
    """
    here = Path(sys.executable).with_name("smg")
    found = str(here) if here.exists() else shutil.which("smg")
    if not found:
        raise FileNotFoundError("smg (SGLang's router) is not installed: pip install smg==1.13.0 (scripts/setup does)")
    return found


class RouterProcess:
    """One ``smg launch`` process.

    Args:
        worker_urls: regular mode: the workers' base URLs.
        prefill: PD mode: ``(url, bootstrap_port)`` per prefill server.
        decode: PD mode: the decode servers' URLs.
        policy: ``--policy`` (regular mode, and both roles in PD mode).
        log_path: where its stdout/stderr go.
        extra_args: more ``smg launch`` flags.
    """

    def __init__(self, log_path: Path, worker_urls: Sequence[str] = (), prefill: Sequence[tuple[str, int]] = (),
                 decode: Sequence[str] = (), policy: str = "round_robin", extra_args: Sequence[str] = ()):
        if bool(worker_urls) == bool(prefill or decode):
            raise ValueError("give worker_urls (regular mode) or prefill and decode (PD mode)")
        self.host, self.port = "127.0.0.1", pick_free_port()
        self.metrics_port = pick_free_port()
        self.log_path = Path(log_path)
        cmd = [smg_binary(), "launch", "--host", self.host, "--port", str(self.port), "--policy", policy,
               "--prometheus-host", self.host, "--prometheus-port", str(self.metrics_port),
               "--health-check-interval-secs", "5", "--health-check-timeout-secs", "60"]
        if worker_urls:
            cmd += ["--worker-urls", *worker_urls]
        else:
            cmd += ["--pd-disaggregation"]
            for url, bootstrap_port in prefill:
                cmd += ["--prefill", url, str(bootstrap_port)]
            for url in decode:
                cmd += ["--decode", url]
        self.command = cmd + list(extra_args)
        self.expected_workers = len(worker_urls) + len(prefill) + len(decode)
        self._proc: Optional[subprocess.Popen] = None
        self._log = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def label(self) -> str:
        """``smg router :PORT``, how stack dumps name it (``hiradix.testing.diagnose``)."""
        return f"smg router :{self.port}"

    def pids(self) -> list[int]:
        """Its PID while it runs ([] before start and after it exited)."""
        return [self._proc.pid] if self._proc is not None and self._proc.poll() is None else []

    def start(self, timeout_s: float = 120.0) -> "RouterProcess":
        """Start it and wait until ``/workers`` lists every worker healthy and ready (``/readiness``
        answers 200 before the workers are registered).

        Raises:
            RouterStartError: it exited, or was not ready within ``timeout_s``.
        """
        self._log = open(self.log_path, "ab")
        env = launch_env({"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"})
        self._proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
        diagnose.watch(self)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RouterStartError(f"smg exited with {self._proc.returncode}: {self.log_tail()}")
            if self._ready():
                return self
            time.sleep(0.5)
        self.stop()
        raise RouterStartError(f"smg not ready after {timeout_s:g} s: {self.log_tail()}")

    def healthy_workers(self) -> int:
        """Workers the router lists as healthy and ready (``GET /workers``); 0 when it does not answer."""
        try:
            with urllib.request.urlopen(self.base_url + "/workers", timeout=5) as resp:
                workers = json.loads(resp.read()).get("workers") or []
        except (urllib.error.URLError, OSError, ValueError):
            return 0
        return sum(1 for w in workers if w.get("is_healthy") and w.get("status") == "ready")

    def _ready(self) -> bool:
        return self.healthy_workers() >= self.expected_workers

    def wait_workers(self, count: int, timeout_s: float = 120.0, poll_s: float = 0.5) -> None:
        """Wait until exactly ``count`` workers are listed healthy and ready (after a worker was
        killed: fewer; after it was restarted: all again; the router's health checks run every 5 s).

        Raises:
            TimeoutError: not so within ``timeout_s`` (the message has the count seen last).
        """
        deadline = time.monotonic() + timeout_s
        while (seen := self.healthy_workers()) != count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"router lists {seen} healthy workers, not {count}, after {timeout_s:g} s")
            time.sleep(poll_s)

    def metrics_text(self, timeout_s: float = 10.0) -> str:
        """The router's Prometheus exposition (``GET /metrics`` on its Prometheus port)."""
        url = f"http://{self.host}:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read().decode()

    def samples(self, name: str) -> list[tuple[dict[str, str], float]]:
        """``(labels, value)`` of every sample of the metric ``name`` (e.g. ``smg_worker_requests_total``,
        ``smg_router_ttft_seconds_sum``), parsed by prometheus_client."""
        found = []
        for family in text_string_to_metric_families(self.metrics_text()):
            found += [(dict(s.labels), float(s.value)) for s in family.samples if s.name == name]
        return found

    def requests_per_worker(self) -> dict[str, float]:
        """Requests the router sent to each worker so far, by worker URL (``smg_worker_requests_total``;
        a request retried on another worker counts on both)."""
        counts: dict[str, float] = {}
        for labels, value in self.samples("smg_worker_requests_total"):
            counts[labels["worker"]] = counts.get(labels["worker"], 0.0) + value
        return counts

    def stop(self) -> Optional[int]:
        """SIGTERM to its process group, SIGKILL after 10 s; returns its exit status."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait(10)
        diagnose.unwatch(self)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self._proc.returncode

    def log_tail(self, num_bytes: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-num_bytes:].decode(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> "RouterProcess":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
