"""A pre-imported SGLang launcher for tests: server processes forked instead of started cold.

``python -m sglang.launch_server`` spends ~14.5 s of CPU importing SGLang, torch and
transformers before it parses a flag (measured here, idle: 14.5-14.9 s wall for the imports
alone, of 16.6 s to a healthy tiny-model server with 15.0 s of CPU in its processes). A test
session starts ~65 servers and ~15 refused launchers. A zygote imports all that once, then
forks one child per launch; the child takes the launch's environment, working directory, output
files and arguments and runs ``-m sglang.launch_server`` (or another ``-m`` module, or ``-c``
code) as ``__main__`` would.

On in the tests (``HIRADIX_TEST_ZYGOTE=1``, set by ``tests/conftest.py`` and read by
:class:`hiradix.testing.server.ServerProcess`); a server whose environment says ``0`` starts
cold, as the session's shared servers do (what users run).
What a forked child cannot change: a module already imported (a ``hiradix`` folder in its
working directory does not shadow the package, as it would cold), and anything read while the
zygote imported, so one zygote serves only launches whose :data:`IMPORT_TIME_ENV` values equal
its own; another set starts another zygote. The zygote holds no thread when it forks (checked:
it refuses to fork with more than one).

Protocol: a Unix stream socket, one connection per request, a JSON line each way; the zygote
handles one request at a time, reaps its children before each answer and ends when its stdin
(a pipe from the test process) closes:

    {"op": "spawn", "args": ["-m", "sglang.launch_server", ...] | ["-c", code, ...], "env": {...},
     "cwd": "...", "stdout": path, "stderr": path} -> {"pid": N}   (the same path: one file)
    {"op": "status", "pid": N}  -> {"returncode": null | int}   (negative: killed by that signal)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from hiradix.testing.process_group import kill_group

# sglang.srt.models.registry: every scheduler imports all of SGLang's model classes (~1.2 s of CPU).
PRELOAD = ("sglang.launch_server", "sglang.srt.entrypoints.http_server", "sglang.srt.models.registry")
# Read by libraries while they are imported (so fixed in a zygote): a launch with other values
# goes to a zygote of its own.
IMPORT_TIME_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "SGLANG_USE_CPU_ENGINE", "PYTHONPATH",
                   "CUDA_VISIBLE_DEVICES", "TORCH_DEVICE_BACKEND_AUTOLOAD", "TORCHDYNAMO_DISABLE")
READY_TIMEOUT_S = 180.0
UNKNOWN_EXIT = -255  # the exit status of a child whose zygote ended first
STATUS_POLL_S = 0.1


# ------------------------------------------------------------------------------------ zygote side

def _reap(exited: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exited[pid] = os.waitstatus_to_exitcode(status)


def _redirect(request: dict) -> None:
    """stdin from /dev/null, stdout and stderr to the request's files (appended)."""
    def open_out(path: str) -> int:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    out_fd = open_out(request["stdout"])
    err_fd = out_fd if request["stderr"] == request["stdout"] else open_out(request["stderr"])
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    for fd in {null_fd, out_fd, err_fd}:
        os.close(fd)


def _run_main(args: list[str], cwd: str) -> None:
    """Run ``python *args`` (``-m module ...`` or ``-c code ...``) in this process as ``__main__``."""
    kind, target, rest = args[0], args[1], args[2:]
    if kind == "-m":
        sys.argv = [target, *rest]
        sys.path[0] = cwd
        sys.modules.pop(target, None)  # run as __main__ (its imports stay loaded)
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "-c":  # as a script file (what -m does with a module's file, runpy does with it)
        with tempfile.NamedTemporaryFile("w", suffix=".py", prefix="hiradix-zygote-c-") as script:
            script.write(target)
            script.flush()
            sys.argv = ["-c", *rest]
            sys.path[0] = ""
            runpy.run_path(script.name, run_name="__main__")
    else:
        raise ValueError(f"zygote runs -m MODULE or -c CODE, not {kind!r}")


def _child(request: dict) -> None:
    """In the forked child: become ``python *request["args"]`` (never returns)."""
    code = 1
    try:
        os.setsid()
        _redirect(request)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        import setproctitle  # claimed by the zygote (serve): the title a cold process would have

        setproctitle.setproctitle(" ".join([sys.executable, *request["args"]]))
        _run_main(request["args"], request["cwd"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child's traceback belongs in its log
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _answer(request: dict, exited: dict[int, int], server: socket.socket, conn: socket.socket) -> dict:
    _reap(exited)
    if request.get("op") == "status":
        return {"returncode": exited.get(request["pid"])}
    if request.get("op") != "spawn":
        return {"error": f"unknown op {request.get('op')!r}"}
    if threading.active_count() > 1:
        return {"error": f"{threading.active_count()} threads; refusing to fork"}
    pid = os.fork()
    if pid == 0:  # the launcher keeps none of the zygote's sockets
        server.close()
        os.close(conn.detach())  # (its makefile would keep a plain close() from closing it)
        _child(request)
    return {"pid": pid}


def serve(socket_path: str) -> None:
    """Import :data:`PRELOAD`, say ``ready`` on stdout, answer one request per connection until
    stdin closes (the test process ended)."""
    import gc
    import importlib
    import select

    for name in PRELOAD:
        importlib.import_module(name)
    # What the imports made lives as long as the children: out of the collector's reach, so that
    # a child's collections and SGLang's freeze_gc (which lists every tracked object, ~1 s of
    # CPU and copy-on-write faults per start, measured) do not walk it.
    gc.collect()
    gc.freeze()
    # setproctitle claims the argv + environ memory on first use and gives up where the environ
    # strings are not where the process started them, as after a child's os.environ.clear():
    # claim it here, before any fork, so the children's titles ("sglang::scheduler") work.
    import setproctitle

    setproctitle.getproctitle()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen(8)
    print("ready", flush=True)
    exited: dict[int, int] = {}
    while True:
        readable, _, _ = select.select([server, sys.stdin], [], [])
        if sys.stdin in readable and not sys.stdin.buffer.read1(1):
            return
        if server in readable:
            conn, _ = server.accept()
            with conn, conn.makefile("rw") as stream:
                line = stream.readline()
                answer = _answer(json.loads(line), exited, server, conn) if line else {"error": "empty request"}
                stream.write(json.dumps(answer) + "\n")
                stream.flush()


# ------------------------------------------------------------------------------------ client side

def _pid_alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class ZygoteError(RuntimeError):
    """The zygote did not start or refused a request."""


class Zygote:
    """One zygote process (thread-safe: a connection per request)."""

    def __init__(self, env: dict[str, str], log_path: Path):
        self.env = dict(env)
        self._dir = tempfile.mkdtemp(prefix="hiradix-zygote-")
        self.socket_path = os.path.join(self._dir, "zygote.sock")
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "hiradix.testing.zygote", "--socket", self.socket_path],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=self.env,
                                     start_new_session=True)  # fmt: skip
        line = self._read_ready()
        if line != "ready":
            self.close()
            raise ZygoteError(f"zygote did not start (said {line!r}; log {log_path})")

    def _read_ready(self) -> str:
        result: list[str] = []
        reader = threading.Thread(target=lambda: result.append(self.proc.stdout.readline().decode().strip()), daemon=True)
        reader.start()
        reader.join(READY_TIMEOUT_S)
        return result[0] if result else ""

    def request(self, **request) -> dict:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn, conn.makefile("rw") as stream:
            conn.connect(self.socket_path)
            stream.write(json.dumps(request) + "\n")
            stream.flush()
            answer = json.loads(stream.readline() or "{}")
        if "error" in answer or not answer:
            raise ZygoteError(f"zygote refused {request.get('op')}: {answer.get('error', 'no answer')}")
        return answer

    def spawn(self, args: list[str], env: dict[str, str], cwd: str, stdout_path: Path,
              stderr_path: Path | None = None) -> ZygoteChild:
        """Fork ``python *args`` with ``env`` in ``cwd``, its output appended to ``stdout_path``
        (and its stderr to ``stderr_path``; None: the same file)."""
        stderr_path = stdout_path if stderr_path is None else stderr_path
        pid = self.request(op="spawn", args=list(args), env=dict(env), cwd=str(cwd), stdout=str(stdout_path),
                           stderr=str(stderr_path))["pid"]  # fmt: skip
        return ZygoteChild(self, pid)

    def close(self) -> None:
        """End the zygote (its children are the tests' to stop) and remove its socket."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()
        Path(self.socket_path).unlink(missing_ok=True)
        os.rmdir(self._dir)


class ZygoteChild:
    """A forked launcher, as much of ``subprocess.Popen`` as ``ServerProcess`` uses."""

    def __init__(self, zygote: Zygote, pid: int):
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self.zygote.request(op="status", pid=self.pid)["returncode"]
            except OSError:  # the zygote is gone (its children went to init): alive or not
                if not _pid_alive(self.pid):
                    self.returncode = UNKNOWN_EXIT
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline_s = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline_s is not None and time.monotonic() >= deadline_s:
                raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout)
            time.sleep(STATUS_POLL_S)
        return self.returncode


_ZYGOTES: dict[tuple, Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()


@functools.cache
def _log_dir() -> Path:
    """Where zygotes started by :func:`run` log (one folder per test process)."""
    return Path(tempfile.mkdtemp(prefix="hiradix-zygote-logs-"))


def for_env(env: dict[str, str], log_dir: Path) -> Zygote:
    """The zygote for ``env``'s import-time values (started on first use, with ``env``, its log in
    ``log_dir``; it ends with the test process)."""
    key = tuple(env.get(name) for name in IMPORT_TIME_ENV)
    with _ZYGOTES_LOCK:
        zygote = _ZYGOTES.get(key)
        if zygote is None or zygote.proc.poll() is not None:
            zygote = _ZYGOTES[key] = Zygote(env, Path(log_dir) / f"zygote-{len(_ZYGOTES)}.log")
    return zygote


def pids() -> set[int]:
    """PIDs of the zygotes this process started that still run (harness processes that live as
    long as the test process: not a leak of the test that happened to start one)."""
    with _ZYGOTES_LOCK:
        return {z.proc.pid for z in _ZYGOTES.values() if z.proc.poll() is None}


@dataclasses.dataclass
class Finished:
    """A forked process that ran to its end: exit status, output, seconds from its fork."""

    returncode: int
    stdout: str
    stderr: str
    elapsed_s: float


def run(args: list[str], env: dict[str, str], cwd: str | os.PathLike, timeout_s: float) -> Finished:
    """Fork ``python *args`` (``-m module ...`` or ``-c code ...``) from the zygote for ``env`` and
    wait for its end, as ``subprocess.run(..., capture_output=True, text=True)`` would.

    Raises:
        subprocess.TimeoutExpired: It ran past ``timeout_s`` (its process group is killed first).
    """
    forked = for_env(env, _log_dir())
    with tempfile.TemporaryDirectory(prefix="hiradix-zygote-run-") as out_dir:
        out = Path(out_dir)
        start_s = time.monotonic()  # from the fork: the zygote's own start is not the process's
        child = forked.spawn(args, env, str(cwd), out / "stdout", out / "stderr")
        try:
            child.wait(timeout=timeout_s)
        finally:
            kill_group(child)
            child.wait(timeout=READY_TIMEOUT_S)
        elapsed_s = time.monotonic() - start_s
        return Finished(child.returncode, (out / "stdout").read_text(), (out / "stderr").read_text(), elapsed_s)


def launch(argv: list[str], env: dict[str, str], log_path: Path) -> ZygoteChild:
    """Fork ``python -m sglang.launch_server *argv`` (in this process's working directory, its
    output in ``log_path``) from the zygote for ``env``."""
    return for_env(env, log_path.parent).spawn(["-m", "sglang.launch_server", *argv], env, os.getcwd(), log_path)


def close_all() -> None:
    """End every zygote this process started."""
    with _ZYGOTES_LOCK:
        for zygote in _ZYGOTES.values():
            zygote.close()
        _ZYGOTES.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hiradix.testing.zygote", description=__doc__.split("\n")[0])
    parser.add_argument("--socket", required=True)
    args = parser.parse_args(argv)
    serve(args.socket)
    return 0


if __name__ == "__main__":
    sys.exit(main())
