"""Helpers for tests and benchmarks that run real SGLang servers.

`ServerProcess` starts `python -m sglang.launch_server` as a subprocess in its own
process session and stops the whole session on exit; `cpu_args` / `cpu_env` hold the
settings SGLang 0.5.23 needs on a CPU-only machine.
"""

from hiradix.testing.server import (
    DEFAULT_PORT_RANGE,
    ServerProcess,
    ServerStartError,
    cpu_args,
    cpu_env,
    pick_free_port,
)

__all__ = [
    "DEFAULT_PORT_RANGE",
    "ServerProcess",
    "ServerStartError",
    "cpu_args",
    "cpu_env",
    "pick_free_port",
]
