"""An SGLang server in smg's gRPC mode, publishing KV events that SGLang's router (smg) consumes.

How smg 1.13.0 consumes an engine's KV events: only from a gRPC worker (``--worker-urls
grpc://HOST:PORT``; an HTTP worker gets no subscription), by the server-streaming RPC
``sglang.grpc.scheduler.SglangScheduler/SubscribeKvEvents``. SGLang 0.5.23 serves that service only
in its legacy SMG gRPC mode (``--smg-grpc-mode``, alias ``--grpc-mode``), whose server is the
separate PyPI package ``smg-grpc-servicer`` (SGLang's ``entrypoints/grpc_server.py`` imports
``smg_grpc_servicer.sglang.server``; without it the launcher dies with "gRPC mode requires the
smg-grpc-servicer package"). SGLang's native gRPC server (``--grpc-port``, beside HTTP) speaks
``sglang.runtime.v1.SglangService``, which smg does not speak. The servicer subscribes to SGLang's
own ZMQ publisher (``--kv-events-config``: PUB + replay ROUTER, per DP rank), turns each event's
``medium`` into a tier (GPU -> DEVICE, CPU_PINNED -> HOST, DISK -> DISK, EXTERNAL -> EXTERNAL;
an unknown medium is dropped) and relays the batches; the router applies them to its per-model
block index (``--kv-index``), which ``--policy cache_aware`` then routes by. That index holds a
block once per worker whichever media hold it: measured with hiradix (HBM 106 pages, DRAM and store
123 each), smg_kv_index_blocks read 123 for that worker, not 106; a page evicted from HBM but kept
in DRAM or the store still routes to that worker, and no tier is preferred over another.

A server here (:class:`GrpcServerProcess`) is ``python -m sglang.launch_server ... --smg-grpc-mode
--smg-http-sidecar-port S --kv-events-config '{"publisher": "zmq", "endpoint":
"tcp://127.0.0.1:E", "bind": true, "replay_endpoint": "tcp://127.0.0.1:R"}'``:

* the gRPC server listens on ``--port`` (the router's worker URL ``grpc://127.0.0.1:PORT``,
  :attr:`GrpcServerProcess.base_url`); there is no HTTP API (no ``/health``, ``/flush_cache``,
  ``/v1/...``): the router's ``POST /flush_cache`` flushes its gRPC workers (``FlushCache``);
* SGLang's HTTP sidecar on port S serves ``/metrics`` (with ``--enable-metrics``; hiradix's
  tier gauges included, but no tokenizer-manager series: the servicer has no tokenizer manager)
  in the OpenMetrics format (:func:`fetch_server_metrics` gives back the ``sglang:`` names) and
  the profiling endpoints (:attr:`GrpcServerProcess.metrics_url`);
* healthy = the standard gRPC health service answers SERVING for the scheduler service;
* the servicer's own planned warm-up is off (``SMG_SGLANG_SERVICER_WARMUP=off``, see
  :data:`SERVICER_WARMUP_ENV`);
* the publisher binds loopback ports of its own (``"bind": true``; without it a concrete
  address is connected to, not bound), so a test can also subscribe to it directly
  (:attr:`GrpcServerProcess.kv_events_endpoint`).

The chat template, tokenization and the OpenAI API are the router's in this mode: it loads the
tokenizer (``--tokenizer-path`` the model directory) and sends token ids. The gRPC response carries
``cached_tokens`` but no per-tier split and no SGLang extensions (``sglext``).
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Mapping, Optional, Sequence

from hiradix.testing.server import ServerProcess, pick_free_port

SERVICER_PACKAGE = "smg_grpc_servicer"  # PyPI smg-grpc-servicer (0.14.1 with smg 1.13.0)
SERVICER_PIP = "smg-grpc-servicer==0.14.1"
GRPC_MODE_FLAG = "--smg-grpc-mode"  # SGLang 0.5.23's name; --grpc-mode is its deprecated alias
SCHEDULER_SERVICE = "sglang.grpc.scheduler.SglangScheduler"  # the service smg speaks (and its health name)
# The servicer's own "planned warm-up" (0.14.1: on by default, level full, budget 300 s) draws token
# ids below the vocabulary size it advertises, which it takes from SGLang's scheduler info; SGLang
# 0.5.23 puts none there, so the servicer assumes 128,256, and a model with a smaller vocabulary (the
# tiny model: 4,096) dies in its first warm-up batch (IndexError in the embedding). Off here; the
# benchmark warms up with its own requests.
SERVICER_WARMUP_ENV = "SMG_SGLANG_SERVICER_WARMUP"


def servicer_problem() -> Optional[str]:
    """Why a gRPC-mode server cannot start with this interpreter, or None: the servicer package
    (and the gRPC health stubs this module probes with) must be importable here, and so by the
    server, which inherits this process's environment (``PYTHONPATH`` included)."""
    missing = [name for name in (SERVICER_PACKAGE, "grpc_health") if importlib.util.find_spec(name) is None]
    if missing:
        return (f"SGLang's SMG gRPC mode needs {', '.join(missing)} importable: pip install {SERVICER_PIP} "
                f"(it brings smg-grpc-proto and grpcio-reflection)")
    return None


def kv_events_config(port: int, replay_port: Optional[int] = None, topic: str = "") -> str:
    """``--kv-events-config`` for SGLang's ZMQ publisher bound on loopback ``port`` (and its replay
    ROUTER on ``replay_port``)."""
    config: dict = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "bind": True, "topic": topic}
    if replay_port is not None:
        config["replay_endpoint"] = f"tcp://127.0.0.1:{replay_port}"
    return json.dumps(config)


def grpc_health(host: str, port: int, timeout_s: float = 5.0, service: str = SCHEDULER_SERVICE) -> bool:
    """True if the gRPC health service at ``host:port`` answers SERVING for ``service`` now."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(f"{host}:{port}")
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=timeout_s)  # fmt: skip
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
    finally:
        channel.close()


class GrpcServerProcess(ServerProcess):
    """``ServerProcess`` in SGLang's SMG gRPC mode with KV events on (see the module docstring).

    Args: those of ``ServerProcess``; ``extra_args`` must not set ``--kv-events-config`` or the
    gRPC flags (this class sets them). ``env`` must let the server import ``smg_grpc_servicer``.
    """

    def __init__(self, model_path: str | os.PathLike, port: Optional[int] = None, extra_args: Sequence[str] = (),
                 env: Optional[Mapping[str, str]] = None, log_path: str | os.PathLike | None = None, **kwargs):
        taken = [a for a in extra_args if a in ("--kv-events-config", "--grpc-mode", GRPC_MODE_FLAG,
                                                 "--smg-http-sidecar-port", "--grpc-port")]  # fmt: skip
        if taken:
            raise ValueError(f"GrpcServerProcess sets {', '.join(taken)} itself")
        self.sidecar_port = pick_free_port()
        self.kv_events_port, self.kv_replay_port = pick_free_port(), pick_free_port()
        flags = [GRPC_MODE_FLAG, "--smg-http-sidecar-port", str(self.sidecar_port),
                 "--kv-events-config", kv_events_config(self.kv_events_port, self.kv_replay_port)]  # fmt: skip
        env = {SERVICER_WARMUP_ENV: "off", **(env or {})}
        super().__init__(model_path, port, [*extra_args, *flags], env, log_path, **kwargs)

    @property
    def base_url(self) -> str:
        """``grpc://host:port``: the worker URL for ``smg launch --worker-urls``."""
        return f"grpc://{self.host}:{self.port}"

    @property
    def metrics_url(self) -> str:
        """``http://host:sidecar``: SGLang's HTTP sidecar (``/metrics``)."""
        return f"http://{self.host}:{self.sidecar_port}"

    @property
    def kv_events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_events_port}"

    @property
    def kv_replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.kv_replay_port}"

    @property
    def label(self) -> str:
        return f"sglang grpc :{self.port}"

    def is_healthy(self, timeout_s: float = 5.0) -> bool:
        """True if the scheduler service answers SERVING on the gRPC health service now."""
        return grpc_health(self.host, self.port, timeout_s)


def metrics_url(server: ServerProcess) -> str:
    """Where a server's ``/metrics`` is: its sidecar in gRPC mode, else its HTTP base URL."""
    return getattr(server, "metrics_url", server.base_url)


def prometheus_names(text: str) -> str:
    """The sidecar's exposition with SGLang's metric names as its HTTP server writes them.

    SGLang's gRPC-mode sidecar (``entrypoints/grpc_server.py``) serves the OpenMetrics format, in
    which prometheus_client writes a name's ``:`` as ``_`` in the samples (``# HELP
    sglang:hiradix_tier_used_tokens`` over ``sglang_hiradix_tier_used_tokens{...}``): a Prometheus
    text parser then finds no ``sglang:...`` sample. Each sample of a family whose HELP name has a
    ``:`` gets that name back."""
    families = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") and ":" in line.split(" ", 3)[2]:
            name = line.split(" ", 3)[2]
            families[name.replace(":", "_")] = name
    if not families:
        return text
    out = []
    for line in text.splitlines():
        if line and not line.startswith("#"):
            sample = line.split("{", 1)[0].split(" ", 1)[0]
            for escaped, name in families.items():
                if sample.startswith(escaped) and sample[len(escaped):] in ("", "_total", "_created", "_sum",
                                                                               "_count", "_bucket"):  # fmt: skip
                    line = name + line[len(escaped):]
                    break
        out.append(line)
    return "\n".join(out) + "\n"


def fetch_server_metrics(server: ServerProcess, timeout_s: float = 10.0) -> str:
    """A server's ``/metrics`` text ("" if it does not answer in time), in the Prometheus names of
    SGLang's HTTP server also in gRPC mode (:func:`prometheus_names`)."""
    import urllib.request

    try:
        with urllib.request.urlopen(metrics_url(server) + "/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return prometheus_names(text) if isinstance(server, GrpcServerProcess) else text
