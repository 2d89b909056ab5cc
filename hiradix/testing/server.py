"""Run a real `sglang.launch_server` as a subprocess, for tests and benchmarks.

Example:
    >>> from hiradix.testing.server import ServerProcess, cpu_args
    >>> with ServerProcess("models/tiny", extra_args=cpu_args(4096)) as server:
    ...     print(server.base_url)          # http://127.0.0.1:33017
    ...     ...                             # send requests
    >>> # the server and all its children (scheduler, detokenizer) are gone here

What it does:
    * starts `python -m sglang.launch_server --model-path M --host H --port P
      --nccl-port Q [extra_args...]` in a new process session (`start_new_session=True`),
      so the launcher, the scheduler and the detokenizer share one process group;
    * writes stdout and stderr to a log file (`log_path`, or a temporary file);
    * waits until `GET /health` answers 200 (SGLang answers 503 until its warm-up request
      has run) and raises `ServerStartError` with the tail of the log if the process
      exits first or the timeout passes;
    * on exit, also after an exception, sends SIGTERM to the process group, waits a grace
      period, then SIGKILLs the group and every descendant that is still alive (by PID). The
      grace period (15 s) outlasts hiradix's default `--hiradix-stop-timeout-s` (10 s), for
      which a scheduler with NVMe or store writes in flight may let them land before it ends.

Nothing is hidden: the CPU settings this machine needs are the explicit helpers
`cpu_args(max_total_tokens)` and `cpu_env()`; pass them in yourself.

Ports: when `port` is None a free port is picked from `DEFAULT_PORT_RANGE` (override with
the environment variable `HIRADIX_PORT_RANGE="33000-33099"`) with the ports SGLang derives from
it under DP attention free and reserved (`pick_server_port`); SGLang's torch.distributed port
(`--nccl-port`) is picked from the same range unless `extra_args` sets it.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Mapping, Sequence

import psutil

from hiradix.testing import diagnose, zygote

logger = logging.getLogger(__name__)

DEFAULT_PORT_RANGE: tuple[int, int] = (20000, 29999)  # inclusive; wide, so that servers of concurrent test runs rarely collide
_PORTS_HANDED_OUT: set[int] = set()  # ports picked by this process (not yet bound by SGLang)
# With DP attention SGLang 0.5.23 binds TCP ports port+233 .. port+239 next to a server's HTTP port
# (sglang/srt/server_args.py PortArgs.init_new, ZMQ_TCP_PORT_DELTA = 233: dist init, tokenizer,
# detokenizer, rpc, metrics, scheduler input, load collector); a server port keeps them reserved.
SERVER_DERIVED_PORT_OFFSETS: range = range(233, 240)
ZYGOTE_ENV = "HIRADIX_TEST_ZYGOTE"  # "1" in a server's environment: its launcher forked from a pre-imported one (hiradix.testing.zygote)


def cpu_args(max_total_tokens: int) -> list[str]:
    """SGLang 0.5.23 server flags for a CPU-only machine.

    `--device cpu --attention-backend torch_native` select the CPU path; `--max-total-tokens`
    bounds the KV pool (without it the pool takes ~15 GB); `--sleep-on-idle` stops the idle
    scheduler from spinning a core; `--dtype float32` keeps greedy outputs comparable with
    HF transformers; `--enable-cache-report` fills `usage.prompt_tokens_details.cached_tokens`;
    `--enable-metrics` serves Prometheus metrics on `/metrics`.

    Args:
        max_total_tokens: Capacity of the device KV pool, in tokens (> 0).

    Returns:
        The flags, to pass as (part of) `ServerProcess(extra_args=...)`.

    Raises:
        ValueError: If `max_total_tokens` is not positive.
    """
    if max_total_tokens <= 0:
        raise ValueError(f"max_total_tokens must be > 0, got {max_total_tokens}")
    return [
        "--device", "cpu",
        "--attention-backend", "torch_native",
        "--max-total-tokens", str(max_total_tokens),
        "--sleep-on-idle",
        "--dtype", "float32",
        "--enable-cache-report",
        "--enable-metrics",
    ]  # fmt: skip


# Variables of a Mooncake client (transfer engine and store: `MC_TCP_STATUS_TIMEOUT_SEC`,
# `MC_TCP_PROGRESS_TIMEOUT_SEC`, `MC_RPC_TIMEOUT_MS`, ...), read by every Mooncake client in a
# process at every transfer.
MOONCAKE_ENV_PREFIX = "MC_"
# hiradix's launcher -> scheduler channel (hiradix.config.ENV_VAR): set by a launcher for its own
# schedulers, never inherited by a server (or a zygote) the helpers start.
LAUNCHER_CONFIG_ENV = "HIRADIX_CONFIG"


def launch_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a process started by the testing helpers gets: this process's
    environment without Mooncake client variables (``MC_*``), then ``env`` on top.

    ``HIRADIX_CONFIG`` is left out too: a launcher sets it for its own schedulers, and a test that
    ran the launcher's hook in-process leaves it in this process, where a server (or a zygote,
    which installs hiradix's scheduler hooks at import when it is set) must not inherit it.
    A Mooncake Store client opened in the test process (``hiradix.tiers.store.mooncake``) sets
    its ``MC_*`` settings process-wide, and a server started after it would inherit them: a CI
    run's PD pair got the reader's 2-second TCP transfer deadlines in SGLang's own KV transfer
    engine and failed a chat when one transfer stalled for 2 s on the loaded machine. A
    server's Mooncake settings come from its own flags and ``env`` only.
    """
    inherited = {k: v for k, v in os.environ.items()
                 if not k.startswith(MOONCAKE_ENV_PREFIX) and k != LAUNCHER_CONFIG_ENV}
    return {**inherited, **(env or {})}


def cpu_env(tp_size: int = 1, threads_per_rank: int | None = 1) -> dict[str, str]:
    """Environment variables SGLang 0.5.23 needs on a CPU-only machine.

    `SGLANG_USE_CPU_ENGINE=1`: without it the rotary embedding tries to import vLLM's ops.
    `SGLANG_PYSPY_DUMP_BEFORE_CRASH=0` and `SGLANG_CUDA_COREDUMP_BEFORE_CRASH=0`: a scheduler
    that ends by a signal (which is how `ServerProcess.stop` ends a server) counts as a crash
    for SGLang 0.5.23's launcher, which then sleeps 5 s to take py-spy dumps and CUDA
    coredumps (`TokenizerManager` crash path); neither exists on a CPU-only machine, so a
    stop takes ~2 s instead of ~7 s.
    `OMP_NUM_THREADS` (``threads_per_rank``, default 1; None leaves PyTorch's default, one
    thread per core): measured here (2 cores), 40 tiny-model chat requests took 1.5 s with
    PyTorch's two threads and 42.7 s once one other process kept a core busy (each parallel
    region waits for the descheduled thread); with one thread, 1.75 s and 1.9 s. Tests run
    several servers and clients at once, so they keep it at 1.
    `TORCHDYNAMO_DISABLE=1`: SGLang's MoE top-k functions (DeepSeek, Kimi) are `torch.compile`d,
    and on this CPU path each scheduler compiled them in its warm-up request: 5-11 s of CPU per
    MoE server (measured, tiny-deepseek-v3 alone: warm-up 12 s cold inductor cache, 6 s warm, 1 s
    eager), 60-130 s of the MLA module's start. Eager top-k is the same function; stock and
    hiradix servers of a test run it alike. (Read when SGLang is imported: a zygote's key.)
    With `--tp-size N` > 1, `SGLANG_CPU_OMP_THREADS_BIND` gives each rank its CPUs ("0|1" for
    two ranks on cores 0 and 1; the cores are shared round-robin when there are fewer):
    without it stock SGLang fails in `init_threads_binding`.

    Args:
        tp_size: the server's `--tp-size`.
        threads_per_rank: PyTorch/OpenMP threads of each scheduler process; None: PyTorch's default.

    Returns:
        Variables to merge into the server's environment (`ServerProcess(env=...)`).
    """
    env = {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
           "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0", "TORCHDYNAMO_DISABLE": "1"}
    if threads_per_rank is not None:
        if threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1 or None, got {threads_per_rank}")
        env["OMP_NUM_THREADS"] = str(threads_per_rank)
    if tp_size > 1:
        cores = max(1, os.cpu_count() or 1)
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(rank % cores) for rank in range(tp_size))
    return env


def _port_range_from_env() -> tuple[int, int]:
    text = os.environ.get("HIRADIX_PORT_RANGE")
    if not text:
        return DEFAULT_PORT_RANGE
    try:
        low_text, high_text = text.split("-")
        low, high = int(low_text), int(high_text)
    except ValueError as exc:
        raise ValueError(f"HIRADIX_PORT_RANGE must look like '33000-33099', got {text!r}") from exc
    if not 0 < low <= high < 65536:
        raise ValueError(f"HIRADIX_PORT_RANGE out of order or bounds: {text!r}")
    return low, high


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def pick_free_port(port_range: tuple[int, int] | None = None) -> int:
    """Pick a TCP port that is free now, from an inclusive range, in random order.

    Ports returned earlier by this process are skipped, so two servers started from one
    process never get the same port. Another process can still take the port before
    SGLang binds it; the server then fails to start and says so in its log.

    Args:
        port_range: `(low, high)`, inclusive. Default: `HIRADIX_PORT_RANGE` or
            `DEFAULT_PORT_RANGE`.

    Returns:
        A port number.

    Raises:
        RuntimeError: If no port in the range is free.
    """
    return _pick(port_range, ())


def pick_server_port(port_range: tuple[int, int] | None = None) -> int:
    """Pick an HTTP port for an SGLang server, with the ports SGLang derives from it free too.

    Like `pick_free_port`, but the port is returned only if `port + SERVER_DERIVED_PORT_OFFSETS`
    (bound by SGLang with DP attention) are free now and not handed out by this process; all of
    them are then marked handed out, so no later `pick_free_port` (an nccl port, a store's, a
    router's) lands on a port a server binds later.

    Raises:
        RuntimeError: If no port in the range qualifies.
    """
    return _pick(port_range, SERVER_DERIVED_PORT_OFFSETS)


def _pick(port_range: tuple[int, int] | None, offsets: Sequence[int]) -> int:
    """A random port of the range that, with `port + offset` for each offset, is free now and not
    handed out; all of them are marked handed out."""
    low, high = port_range or _port_range_from_env()
    candidates = list(range(low, high + 1))
    random.shuffle(candidates)
    for port in candidates:
        window = [port, *(port + offset for offset in offsets)]
        if any(p in _PORTS_HANDED_OUT or p > 65535 for p in window) or not all(map(_port_is_free, window)):
            continue
        _PORTS_HANDED_OUT.update(window)
        return port
    needs = " with its DP-attention ports free" if offsets else ""
    raise RuntimeError(f"no free TCP port in {low}-{high}{needs}")


def reserve_server_ports(port: int) -> None:
    """Mark a given server `port` and the ports SGLang derives from it as handed out."""
    _PORTS_HANDED_OUT.update([port, *(port + offset for offset in SERVER_DERIVED_PORT_OFFSETS)])


class ServerStartError(RuntimeError):
    """The server process exited, or did not become healthy in time; the message has the log tail."""


class ServerProcess:
    """A `python -m sglang.launch_server` subprocess, used as a context manager.

    Attributes:
        model_path: Path (or HF id) passed as `--model-path`.
        host: Address the server binds and clients use.
        port: HTTP port of the server.
        nccl_port: torch.distributed port passed as `--nccl-port` (None if in `extra_args`).
        log_path: File that receives the server's stdout and stderr.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        *,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 300.0,
        stop_grace_s: float = 15.0,
        python: str = sys.executable,
    ) -> None:
        """Describe the server; nothing starts until `start()` or `with`.

        Args:
            model_path: Model directory (or HF id) for `--model-path`.
            port: HTTP port; None picks a free one (see `pick_server_port`).
            extra_args: More `launch_server` flags, e.g. `cpu_args(4096) + ["--enable-hiradix"]`.
            env: Variables added to (and overriding) this process's environment (less its
                Mooncake client variables: `launch_env`), e.g. `cpu_env()`.
            log_path: Where to write the server log; None uses a temporary file (kept).
            host: Bind address.
            startup_timeout_s: Seconds to wait for `/health` before giving up.
            stop_grace_s: Seconds between SIGTERM and SIGKILL when stopping.
            python: Interpreter used to run `-m sglang.launch_server`.
        """
        self.model_path = str(model_path)
        self.host = host
        if port is None:
            port = pick_server_port()
        else:
            reserve_server_ports(port)
        self.port = port
        self.extra_args = list(extra_args)
        self.nccl_port = None if "--nccl-port" in self.extra_args else pick_free_port()
        self.env = dict(env or {})
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"sglang-{self.port}-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.python = python
        self._proc: subprocess.Popen | None = None
        self._log_file = None
        self.startup_s: float | None = None  # seconds from spawn to healthy

    @property
    def base_url(self) -> str:
        """`http://host:port`, without a trailing slash."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """PID of the launcher process (also the process-group id), or None before start."""
        return self._proc.pid if self._proc is not None else None

    @property
    def label(self) -> str:
        """``sglang :PORT``, how stack dumps name it (``hiradix.testing.diagnose``)."""
        return f"sglang :{self.port}"

    def pids(self) -> list[int]:
        """The launcher (if alive) and its live descendants (scheduler, detokenizer, I/O worker)."""
        if self._proc is None:
            return []
        launcher = [self._proc.pid] if self._proc.poll() is None else []
        return launcher + [p.pid for p in self.descendants()]

    def snapshot(self) -> str:
        """Stacks of its processes (py-spy) and its log's tail, as text (``hiradix.testing.diagnose``)."""
        return diagnose.snapshot([self])

    def command(self) -> list[str]:
        """The full command line that `start()` runs."""
        cmd = [self.python, "-m", "sglang.launch_server", "--model-path", self.model_path,
               "--host", self.host, "--port", str(self.port)]  # fmt: skip
        if self.nccl_port is not None:
            cmd += ["--nccl-port", str(self.nccl_port)]
        return cmd + self.extra_args

    def start(self, wait: bool = True) -> "ServerProcess":
        """Spawn the server (in a new session) and, by default, wait until it is healthy.

        A stopped server (its launcher exited) can be started again, on the same port with the
        same flags and log: a restart.

        Returns:
            self.

        Raises:
            RuntimeError: If it is running.
            ServerStartError: If the process exits before it is healthy or the timeout passes
                (the process group is stopped first).
        """
        if self._proc is not None and self._proc.poll() is None:
            raise RuntimeError("server already started")
        if self._log_file is not None:  # a launcher that died on its own, never stopped
            self._log_file.close()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(self.log_path, "ab")
        cmd = self.command()
        self._log_file.write(("$ " + " ".join(cmd) + "\n").encode())
        self._log_file.flush()
        self._spawn_t = time.monotonic()
        env = launch_env(self.env)
        if env.get(ZYGOTE_ENV) == "1" and cmd[0] == sys.executable and env.get("PYTHONPATH") == os.environ.get("PYTHONPATH"):
            # forked from a pre-imported launcher (hiradix.testing.zygote), ~14 s of CPU less
            self._proc = zygote.launch(cmd[3:], env, self.log_path)
        else:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        diagnose.watch(self)
        logger.info("started sglang pid=%d on %s (log %s)", self._proc.pid, self.base_url, self.log_path)
        if wait:
            try:
                self.wait_healthy()
            except BaseException:
                self.stop()
                raise
        return self

    def wait_healthy(self, timeout_s: float | None = None, poll_s: float = 0.5) -> None:
        """Block until `GET /health` returns 200.

        Args:
            timeout_s: Seconds to wait; default `startup_timeout_s`.
            poll_s: Seconds between probes.

        Raises:
            RuntimeError: If not started.
            ServerStartError: If the process exits or the timeout passes.
        """
        if self._proc is None:
            raise RuntimeError("server not started")
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.startup_timeout_s)
        while True:
            code = self._proc.poll()
            if code is not None:
                raise ServerStartError(
                    f"sglang exited with code {code} before becoming healthy; log {self.log_path}:\n"
                    + self.log_tail()
                )
            if self.is_healthy() and self._listens_on_port():
                self.startup_s = time.monotonic() - self._spawn_t
                logger.info("sglang on %s healthy after %.1f s", self.base_url, self.startup_s)
                return
            if time.monotonic() > deadline:
                # what every process of the server is doing, before a caller stops it
                raise ServerStartError(
                    f"sglang not healthy after {timeout_s or self.startup_timeout_s:.0f} s; "
                    f"log {self.log_path}; its processes:\n" + self.snapshot()
                )
            time.sleep(poll_s)

    def _listens_on_port(self) -> bool:
        """Whether the answer came from this server: one of its processes listens on the port
        (another process that took the port before SGLang bound it may answer /health too)."""
        for proc in [psutil.Process(self._proc.pid), *self.descendants()]:
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == self.port
                       for c in proc.net_connections(kind="tcp")):
                    return True
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return False

    def is_healthy(self, timeout_s: float = 5.0) -> bool:
        """True if `GET /health` answers 200 now."""
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            return False

    def descendants(self) -> list[psutil.Process]:
        """Live processes started by the server: its descendants and its process group.

        Children orphaned by a dead launcher are no longer its descendants but stay in its
        process group, so both are collected. Empty before `start()`.
        """
        if self._proc is None:
            return []
        found: dict[int, psutil.Process] = {}
        try:
            for child in psutil.Process(self._proc.pid).children(recursive=True):
                found[child.pid] = child
        except psutil.NoSuchProcess:
            pass
        for process in psutil.process_iter():
            try:
                if process.pid != self._proc.pid and os.getpgid(process.pid) == self._proc.pid:
                    found.setdefault(process.pid, process)
            except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
                continue
        return [p for p in found.values() if _is_alive(p)]

    def stop(self) -> int | None:
        """Stop the launcher and all its descendants; safe to call more than once.

        SIGTERM goes to the whole process group; after `stop_grace_s`, SIGKILL goes to the
        group and to every descendant (collected before SIGTERM) that is still alive.

        Returns:
            The launcher's exit code (negative: killed by that signal), or None if never started.
        """
        if self._proc is None:
            return None
        proc, pgid = self._proc, self._proc.pid  # new session: the pgid is the launcher's pid
        tracked = self.descendants()
        if proc.poll() is None or tracked:
            # The launcher is not reaped yet (no wait() so far), so its pgid cannot be reused.
            _signal_group(pgid, signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                pass
            alive = _wait_ended(tracked, timeout_s=max(1.0, self.stop_grace_s / 3))
            if proc.poll() is None or alive:
                logger.warning("sglang pid=%d: %d process(es) ignored SIGTERM; sending SIGKILL",
                               pgid, len(alive) + (proc.poll() is None))
                if proc.poll() is None:
                    _signal_group(pgid, signal.SIGKILL)
                for child in alive:
                    _kill_quietly(child)
                _wait_ended(alive, timeout_s=5)
        code = proc.wait()
        diagnose.unwatch(self)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return code

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the server's whole process group (as Ctrl-C in a terminal does)."""
        if self._proc is not None:
            _signal_group(self._proc.pid, sig)

    def wait_exit(self, timeout_s: float) -> int | None:
        """Wait up to ``timeout_s`` for the launcher to exit; its exit code, or None if it runs on."""
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def log_text(self) -> str:
        """The whole server log so far (decoded as UTF-8, undecodable bytes replaced)."""
        try:
            return self.log_path.read_bytes().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, num_lines: int = 40) -> str:
        """The last `num_lines` lines of the server log."""
        return "\n".join(self.log_text().splitlines()[-num_lines:])

    def __enter__(self) -> "ServerProcess":
        if self._proc is None:
            self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop()


def stop_all(servers: "Iterable[ServerProcess]") -> list[int | None]:
    """Stop several servers at once (each :meth:`ServerProcess.stop` in its own thread: a stop
    waits up to the grace period for its processes); their exit codes, in order."""
    servers = list(servers)
    if not servers:
        return []
    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        return list(pool.map(lambda server: server.stop(), servers))


def freeze_process(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid``, then wait until every thread of it is stopped: ``kill`` returns before the
    stop reaches a thread running on another core, which could still act right after.

    Raises:
        TimeoutError: a thread was not stopped within ``timeout_s``.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid={pid} not stopped {timeout_s} s after SIGSTOP")
        time.sleep(0.005)


def _all_threads_stopped(pid: int) -> bool:
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:  # "pid (comm) S ...": the state follows the last ')'
            states.append(task.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that just exited
    return bool(states) and all(state in "tT" for state in states)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_ended(processes: list[psutil.Process], timeout_s: float, poll_s: float = 0.02) -> list[psutil.Process]:
    """Wait until each of ``processes`` has ended; those still alive after ``timeout_s``.

    A zombie has ended (its memory, sockets and files are freed): only its parent or, once that
    has exited, init reaps it. ``psutil.wait_procs`` waits for the reaping, and this machine's
    init (a Firecracker ``process_api``) reaps orphans ~1.5 s late: every server stop took
    ~2 s, of which ~1.5 s was a dead scheduler or detokenizer waiting for init (measured).
    """
    deadline = time.monotonic() + timeout_s
    alive = [p for p in processes if _is_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(poll_s)
        alive = [p for p in alive if _is_alive(p)]
    return alive


def _is_alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_quietly(process: psutil.Process) -> None:
    try:
        process.kill()
    except psutil.NoSuchProcess:
        pass
