"""Helpers for tests, benchmarks and the simulator.

- `server`: `ServerProcess` starts `python -m sglang.launch_server` as a subprocess in its own
  process session and stops the whole session on exit; `cpu_args` / `cpu_env` hold the
  settings SGLang 0.5.23 needs on a CPU-only machine.
- `mooncake`: `MooncakeCluster` starts a Mooncake master and holder processes on free loopback
  ports and stops them by PID (with fault methods); flags/env of stock HiCache + Mooncake.
- `resources`: what a server's process tree holds (memory, fds, sockets, /dev/shm), for soaks.
- `sim_ports`: data-less implementations of the core's ports (virtual clock, device pool, host
  mover, I/O client) that the trace simulator drives the server's own prefix cache through.
"""

from hiradix.testing.server import (
    DEFAULT_PORT_RANGE,
    ServerProcess,
    ServerStartError,
    cpu_args,
    cpu_env,
    pick_free_port,
    pick_server_port,
)

__all__ = [
    "DEFAULT_PORT_RANGE",
    "ServerProcess",
    "ServerStartError",
    "cpu_args",
    "cpu_env",
    "pick_free_port",
    "pick_server_port",
]
