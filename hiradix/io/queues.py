"""A thread pool that takes its waiting jobs by priority (smallest first, in order of arrival among equals).

The I/O worker runs its NVMe jobs on one (:mod:`hiradix.io.worker`): a read a request waits for
starts on the next free thread, ahead of every write or background read still waiting. Running
jobs are never interrupted. The interface is the part of ``concurrent.futures.ThreadPoolExecutor``
the worker uses (``submit`` returns a ``Future``; ``shutdown(wait, cancel_futures)``).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from concurrent.futures import Future
from typing import Any, Callable


class PriorityExecutor:
    """``threads`` threads running submitted calls, the smallest ``priority`` first.

    Args:
        threads: number of threads, >= 1.
        thread_name_prefix: names of the threads (``<prefix>-<i>``).

    Raises:
        ValueError: ``threads`` < 1.
    """

    def __init__(self, threads: int, thread_name_prefix: str = "priority-pool"):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._waiting: list[tuple[int, int, Future, Callable[..., Any], tuple]] = []  # heap
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._shut = False
        self._threads = [threading.Thread(target=self._serve, name=f"{thread_name_prefix}-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, priority: int, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)``; the returned future holds its result (or exception).

        Raises:
            RuntimeError: after :meth:`shutdown`.
        """
        future: Future = Future()
        with self._cv:
            if self._shut:
                raise RuntimeError("cannot submit after shutdown")
            heapq.heappush(self._waiting, (priority, next(self._order), future, fn, args))
            self._cv.notify()
        return future

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._shut:
                    self._cv.wait()
                if not self._waiting:
                    return
                _, _, future, fn, args = heapq.heappop(self._waiting)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the future, as ThreadPoolExecutor does
                future.set_exception(exc)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """Take no more jobs; cancel the waiting ones if ``cancel_futures`` (their done-callbacks
        run), else let them run; join the threads if ``wait``."""
        with self._cv:
            self._shut = True
            if cancel_futures:
                for _, _, future, _, _ in self._waiting:
                    future.cancel()
                self._waiting.clear()
            self._cv.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()
