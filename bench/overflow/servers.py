"""The servers of the context-overflow benchmarks: one hiradix server per system, all up at once.

| system | ``--hiradix-context-overflow`` | ``--context-length`` | what it is (AttentionStore §3.4 / §5.4 names) |
|--------|--------------------------------|----------------------|-----------------------------------------------|
| CA     | shift                          | small (1,024)        | cached KV of the kept tail re-rotated         |
| TT     | recompute                      | small                | token truncation: the kept tail prefilled     |
| NKVT   | noshift                        | small                | kept tail reused at its old positions (wrong) |
| FULL   | shift (never cuts)             | large (8,192)        | no truncation where it fits (quality)         |
| IDEAL  | shift (never cuts)             | large                | whole history cached (TTFT's limit)           |

A name followed by digits (``CA2``) is a duplicate: the A/A control. Every server gets the same
page size, ``--hiradix-keep-tokens`` and device pool (``hiradix.testing.server.cpu_args``), so the
systems differ only in the mode and the context. Servers are stopped by PID through the caller's
``ExitStack``, also when one fails to start.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from hiradix.testing.server import ServerProcess, cpu_args, cpu_env

logger = logging.getLogger(__name__)

MODES = {"CA": "shift", "TT": "recompute", "NKVT": "noshift", "FULL": "shift", "IDEAL": "shift"}
UNCUT = ("FULL", "IDEAL")  # systems whose context holds every chat


@dataclass(frozen=True)
class ServerPlan:
    """Flags shared by every system of a run."""

    context_tokens: int  # --context-length of the cutting systems
    uncut_context_tokens: int  # --context-length of FULL / IDEAL
    keep_tokens: int  # --hiradix-keep-tokens
    page_size: int = 16
    pool_tokens: int = 65536  # --max-total-tokens (device KV pool)
    dram_gb: float = 0.5  # --hiradix-dram-gb


def cut_threshold_tokens(context_tokens: int) -> int:
    """The C for which a server with ``--context-length context_tokens`` cuts a prompt of n tokens
    asking for one new token exactly when ``n + 1 > C``.

    SGLang 0.5.23 (``managers/tp_worker.py``): ``max_req_len = context_len - 1`` and
    ``max_req_input_len = max_req_len - 5``; hiradix cuts when ``n + new > min(max_req_len,
    max_req_input_len - 1 + new)`` (``hiradix.sglang_plugin.overflow.ContextOverflow.cut``), so with
    ``new = 1``: ``C = context_len - 6``.
    """
    return context_tokens - 6


def base_name(name: str) -> str:
    """``CA2`` -> ``CA``.

    Raises:
        ValueError: an unknown system.
    """
    base = re.sub(r"\d+$", "", name)
    if base not in MODES:
        raise ValueError(f"unknown system {name!r}; known: {', '.join(MODES)} (digits appended: a duplicate)")
    return base


def server_flags(name: str, plan: ServerPlan) -> list[str]:
    """The ``launch_server`` flags of system ``name`` (after ``cpu_args``)."""
    base = base_name(name)
    context = plan.uncut_context_tokens if base in UNCUT else plan.context_tokens
    return ["--context-length", str(context), "--page-size", str(plan.page_size), "--enable-hiradix",
            "--hiradix-dram-gb", str(plan.dram_gb), "--hiradix-context-overflow", MODES[base],
            "--hiradix-keep-tokens", str(plan.keep_tokens)]


def start_servers(stack: contextlib.ExitStack, names: Sequence[str], model_path: Path, plan: ServerPlan,
                  log_dir: Path, startup_timeout_s: float = 600.0) -> dict[str, ServerProcess]:
    """Start one server per system at once and wait until all are healthy (``stack`` stops them).

    Raises:
        hiradix.testing.server.ServerStartError: one did not come up (the message has its log).
    """
    servers: dict[str, ServerProcess] = {}
    for name in names:
        flags = cpu_args(plan.pool_tokens) + server_flags(name, plan)
        logger.info("[%s] starting: %s", name, " ".join(flags))
        server = ServerProcess(model_path, extra_args=flags, env=cpu_env(), log_path=log_dir / f"{name}.server.log",
                               startup_timeout_s=startup_timeout_s)
        stack.callback(server.stop)
        servers[name] = server.start(wait=False)
    for name, server in servers.items():
        server.wait_healthy()
        logger.info("[%s] healthy on %s (pid %s) after %.1f s", name, server.base_url, server.pid, server.startup_s)
    return servers
