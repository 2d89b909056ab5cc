"""Data movement between the DRAM and NVMe tiers, in a separate I/O worker process.

- :mod:`hiradix.io.protocol`: the messages, their msgpack codec, the spawn spec, socket names.
- :mod:`hiradix.io.worker`: the worker process (``python -m hiradix.io.worker``).
- :mod:`hiradix.io.client`: :class:`IOWorkerClient`, the scheduler-side handle.
"""

from hiradix.io.client import IOWorkerClient, WorkerStartError
from hiradix.io.protocol import (
    JobDone,
    LoadPages,
    ProtocolError,
    StorePages,
    WorkerSpec,
)

__all__ = [
    "IOWorkerClient",
    "JobDone",
    "LoadPages",
    "ProtocolError",
    "StorePages",
    "WorkerSpec",
    "WorkerStartError",
]
