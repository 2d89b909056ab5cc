"""SGLang's router (the Shepherd Model Gateway, PyPI ``smg``) as a process for tests and benchmarks.

``smg launch`` in front of SGLang servers on loopback: regular mode (``--worker-urls``) or PD mode
(``--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL``). The router says it is up
before its workers are healthy, so :meth:`RouterProcess.start` waits until ``/workers`` lists every
worker healthy and ready. Its health checks call the workers' ``/health``; the interval and timeout are set long enough
for CPU workers. Stopped by PID (its process group), also on failure.
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

from hiradix.testing.server import pick_free_port


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

    def start(self, timeout_s: float = 120.0) -> "RouterProcess":
        """Start it and wait until ``/workers`` lists every worker healthy and ready (``/readiness``
        answers 200 before the workers are registered).

        Raises:
            RouterStartError: it exited, or was not ready within ``timeout_s``.
        """
        self._log = open(self.log_path, "ab")
        env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
        self._proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True)
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
