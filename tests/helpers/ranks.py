"""Simulated TP ranks for the core tests: ranks as threads, and an I/O client whose worker dies.

:class:`ThreadRanks` is a TP group whose ranks are threads of the test: :meth:`ThreadRanks.sync`
gives each rank the real agreement (:class:`hiradix.core.agreement.ReducedAgreement`) over an
all-reduce made with a barrier, as ``RankSync`` makes it over the TP CPU group. A test runs each
rank's step in its own thread (:meth:`ThreadRanks.run`); a rank that enters a collective the
others do not enter breaks the barrier (an error, not a hang).

:class:`DyingIOClient` is the simulator's I/O client with :class:`hiradix.io.client.IOWorkerClient`'s
death handling: after :meth:`DyingIOClient.kill`, the next ``check_alive`` fails every job in
flight ("worker died") and respawns, and the death after ``max_respawns`` disables the client
(every later job fails at once, "worker disabled").
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from hiradix.core.agreement import MAX, ReducedAgreement
from hiradix.io.protocol import JobDone
from hiradix.testing.sim_ports import SimIOClient

BARRIER_TIMEOUT_S = 10.0  # a rank left alone in a collective: the test fails instead of hanging


class ThreadRanks:
    """A TP group of ``size`` ranks that are threads: element-wise MAX/MIN over a barrier.

    Args:
        size: number of ranks.
    """

    def __init__(self, size: int):
        self.size = size
        self._barrier = threading.Barrier(size, timeout=BARRIER_TIMEOUT_S)
        self._values: list[list[int]] = [[] for _ in range(size)]
        self._pool = ThreadPoolExecutor(max_workers=size)

    def sync(self, rank: int) -> ReducedAgreement:
        """The agreement of ``rank`` (a ``RankAgreement`` port)."""
        return _RankOfThreads(self, rank)

    def all_reduce(self, rank: int, values: list[int], op: str) -> list[int]:
        self._values[rank] = list(values)
        self._barrier.wait()  # every rank's values are in
        lengths = {len(v) for v in self._values}
        out = [max(col) if op == MAX else min(col) for col in zip(*self._values)] if len(lengths) == 1 else None
        self._barrier.wait()  # every rank has read them
        if out is None:
            raise RuntimeError(f"all_reduce of lists of lengths {sorted(lengths)}")
        return out

    def run(self, steps: Sequence[Callable[[], Any]]) -> list[Any]:
        """Run ``steps[r]`` on rank r's thread, all at once; their results (re-raises a rank's error)."""
        futures = [self._pool.submit(step) for step in steps]
        return [f.result(timeout=2 * BARRIER_TIMEOUT_S) for f in futures]

    def close(self) -> None:
        self._pool.shutdown()


class _RankOfThreads(ReducedAgreement):
    def __init__(self, group: ThreadRanks, rank: int):
        super().__init__(group.size)
        self.group, self.rank = group, rank

    def all_reduce(self, values: list[int], op: str) -> list[int]:
        return self.group.all_reduce(self.rank, values, op)


class DyingIOClient(SimIOClient):
    """A :class:`SimIOClient` whose worker can be killed (see the module docstring).

    Args:
        *args: as :class:`SimIOClient`.
        max_respawns: deaths survived (respawned); one more disables the client.
    """

    def __init__(self, *args: Any, max_respawns: int = 3, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.max_respawns = max_respawns
        self.deaths = 0
        self._dying = False
        self._failed: list[JobDone] = []  # synthesized failures, returned by the next poll

    def kill(self) -> None:
        """The worker dies now (the client notices at the next :meth:`check_alive`)."""
        self._dying = True

    def check_alive(self) -> bool:
        if self.disabled:
            return False
        if not self._dying:
            return True
        self._dying, self.deaths = False, self.deaths + 1
        jobs = [job for _, _, job, _ in self._jobs] + [job for heap in self._waiting.values() for _, _, job, _ in heap]
        for job in sorted(jobs, key=lambda j: j.job_id):
            self._fail(job, "worker died")
        self.close()
        self.disabled = self.deaths > self.max_respawns
        return False

    def _queue(self, channel: str, job: Any, pages: int, fixed_s: float = 0.0, priority: int = 0) -> None:
        if self.disabled:
            self._fail(job, "worker disabled")
        else:
            super()._queue(channel, job, pages, fixed_s, priority)

    def _fail(self, job: Any, error: str) -> None:
        pages = len(getattr(job, "keys", None) or job.dram_pages)
        self._failed.append(JobDone(job_id=job.job_id, ok=[False] * pages, error=error))

    def poll(self) -> list[JobDone]:
        failed, self._failed = self._failed, []
        return failed + super().poll()
