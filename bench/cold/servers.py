"""The servers of the cold-tier quality benchmark: one hiradix server per cold format, all up at once.

| system | ``--hiradix-cold-format`` | tiers (identical for all)                                        |
|--------|---------------------------|------------------------------------------------------------------|
| exact  | exact                     | small device pool, tiny DRAM, NVMe (cold format applies there)    |
| fp8    | fp8                       | same                                                              |
| int4   | int4                      | same                                                              |

No cluster store: ``--hiradix-cold-tiers`` keeps its default (``nvme,store``), of which only NVMe
exists here, so every history that leaves DRAM is written to (and read back from) NVMe in the
system's format. Servers are stopped by PID through the caller's ``ExitStack``, also when one
fails to start.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from hiradix.testing.server import ServerProcess, cpu_args, cpu_env

logger = logging.getLogger(__name__)

FORMATS = ("exact", "fp8", "int4")


@dataclass(frozen=True)
class ColdPlan:
    """Flags shared by every system of a run."""

    page_size: int = 16
    pool_tokens: int = 2048  # --max-total-tokens (device KV pool)
    dram_gb: float = 0.004  # --hiradix-dram-gb (~980 tokens of fp32 KV of models/trained: 4 KiB a token)
    nvme_gb: float = 1.0  # --hiradix-nvme-gb


def server_flags(fmt: str, plan: ColdPlan, nvme_dir: Path) -> list[str]:
    """The ``launch_server`` flags of cold format ``fmt`` (after ``cpu_args``).

    Raises:
        ValueError: an unknown format.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown cold format {fmt!r}; known: {', '.join(FORMATS)}")
    return ["--page-size", str(plan.page_size), "--enable-hiradix", "--hiradix-dram-gb", str(plan.dram_gb),
            "--hiradix-nvme-path", str(nvme_dir), "--hiradix-nvme-gb", str(plan.nvme_gb),
            "--hiradix-cold-format", fmt]


def start_servers(stack: contextlib.ExitStack, formats: Sequence[str], model_path: Path, plan: ColdPlan,
                  out: Path, startup_timeout_s: float = 600.0) -> dict[str, ServerProcess]:
    """Start one server per format at once (each on a fresh NVMe directory under ``out``) and wait
    until all are healthy (``stack`` stops them).

    Raises:
        hiradix.testing.server.ServerStartError: one did not come up (the message has its log).
    """
    servers: dict[str, ServerProcess] = {}
    for fmt in formats:
        nvme_dir = out / f"nvme-{fmt}"
        shutil.rmtree(nvme_dir, ignore_errors=True)  # no page of an earlier run may be restored
        nvme_dir.mkdir(parents=True)
        flags = cpu_args(plan.pool_tokens) + server_flags(fmt, plan, nvme_dir)
        logger.info("[%s] starting: %s", fmt, " ".join(flags))
        server = ServerProcess(model_path, extra_args=flags, env=cpu_env(), log_path=out / f"{fmt}.server.log",
                               startup_timeout_s=startup_timeout_s)
        stack.callback(server.stop)
        servers[fmt] = server.start(wait=False)
    for fmt, server in servers.items():
        server.wait_healthy()
        logger.info("[%s] healthy on %s (pid %s) after %.1f s", fmt, server.base_url, server.pid, server.startup_s)
    return servers
