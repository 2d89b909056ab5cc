"""Graceful stop in SGLang's processes: a scheduler lets its tier writes land before SIGTERM ends it.

What SGLang 0.5.23 does on SIGTERM (``managers/tokenizer_manager.py``, ``managers/scheduler.py``,
``utils/watchdog.py``, ``utils/common.py``):

* SIGTERM to the launcher alone (``kill <pid>``, a container runtime): the tokenizer manager's
  handler sets ``gracefully_exit``; its ``sigterm_watchdog`` (polling every 5 s) waits for the
  requests still running, sends ``ShutdownReq`` to the schedulers, which leave their event loop
  and call ``tree_cache.release_host_resources()`` (hiradix drains its writes there, then closes
  its tiers), waits up to 15 s for them and SIGKILLs the children left (``kill_process_tree``).
* SIGTERM to the whole process group (systemd, ``hiradix.testing.server.ServerProcess.stop``):
  the scheduler and the detokenizer install no handler and die at once (exit -15); within a
  second the launcher's ``SubprocessWatchdog`` sees a child that did not exit 0 and SIGQUITs the
  launcher, whose handler SIGKILLs every descendant, hiradix's I/O worker with its writes.

With hiradix's tiers below DRAM and ``--hiradix-stop-timeout-s`` > 0:

* scheduler (:class:`SchedulerStop`): on SIGTERM with no write in flight (TP 1) it does at once
  what was there before (hiradix's handler removes the private shared-memory directory, then the
  process dies of SIGTERM). Otherwise it asks the tier controller for a stop; at the next
  scheduler step (about once a second when idle) the TP ranks agree on it and drain
  (:mod:`hiradix.core.graceful_stop`: writes land or are counted lost, bounded), close the tiers
  (the durable index is synced once) and die of SIGTERM as before; under TP with nothing in
  flight each rank logs the stop line (no wait) and ends at that step's end. A second SIGTERM
  ends it at once.
* I/O worker: SIGTERM does not end it (:mod:`hiradix.io.worker`); its scheduler's Shutdown does.
* launcher (:func:`around_check_processes`): while it stops on SIGTERM itself and a scheduler
  still runs, a child that died of SIGTERM (the detokenizer) is not a crash; once the schedulers
  are gone SGLang's watchdog does what it did (SIGQUIT, then SIGKILL of what is left).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from hiradix.core.graceful_stop import writes_in_flight
from hiradix.sglang_plugin import hooks

logger = logging.getLogger(__name__)

LAUNCHER_HOOKS = hooks.specs_of(__name__)
SIGTERM_RACE_S = 2.0  # a child that died of SIGTERM: how long the launcher's own SIGTERM may take to show

_launcher_stopping = threading.Event()  # the launcher got SIGTERM (after_sigterm_handler)


class SchedulerStop:
    """SIGTERM in one scheduler process (see the module docstring). Install from the main thread.

    Args:
        cache: the scheduler's ``TieredRadixCache`` (``tiers``: its tier controller or None).
    """

    def __init__(self, cache: Any):
        self.cache = cache
        self.previous = signal.getsignal(signal.SIGTERM)  # hiradix's shm-directory handler, or SIG_DFL
        self._asked = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """Ask for a stop (two attribute writes: the next step agrees on it and drains); with one
        rank and no write in flight, end at once. Under TP a rank never ends here: its peers would
        be left alone in a collective; the step decides."""
        tiers = self.cache.tiers
        if self._asked or tiers is None or (tiers.sync.size == 1 and not writes_in_flight(tiers.books)):
            self._end(signum, frame)
            return
        self._asked = True
        tiers.stop.request()

    def after_step(self) -> bool:
        """After the tiers' step: once the ranks agreed on a stop, drain, close and end the process;
        a stop asked for here with no write in flight (TP: at a step end, as on the other ranks) ends too.

        Returns:
            True if the process is ending (the caller does nothing more).
        """
        tiers = self.cache.tiers
        if tiers is None:
            return False
        if tiers.stop.agreed:
            self.cache.release_host_resources()  # drains, then closes the tiers
        elif not self._asked or writes_in_flight(tiers.books):
            return False
        else:
            tiers.drain()  # nothing to wait for: logs what the durable index lists
        self._end(signal.SIGTERM, None)
        return True

    def _end(self, signum: int, frame: Any) -> None:
        """Do what SIGTERM did before this handler: the previous handler, or die of the signal."""
        signal.signal(signal.SIGTERM, self.previous)
        if callable(self.previous):
            self.previous(signum, frame)
        elif self.previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


def install_scheduler_stop(cache: Any, stop_timeout_s: float) -> SchedulerStop | None:
    """:class:`SchedulerStop` for ``cache`` when it has tiers below DRAM to drain and a bound > 0,
    on the main thread (signal handlers are set there); None otherwise."""
    tiers = getattr(cache, "tiers", None)
    if stop_timeout_s <= 0 or tiers is None or tiers.client is None:
        return None
    if threading.current_thread() is not threading.main_thread():
        logger.warning("hiradix: the cache is built off the main thread: SIGTERM stops it without draining")
        return None
    return SchedulerStop(cache)


def after_sigterm_handler(result: Any, handler: Any, *args: Any, **kwargs: Any) -> None:
    """Launcher: AFTER SGLang's SIGTERM handler (``SignalHandler.sigterm_handler``): note the stop."""
    _launcher_stopping.set()
    return None


def around_check_processes(original: Any, watchdog: Any, *args: Any, **kwargs: Any) -> Any:
    """Launcher: SGLang's ``SubprocessWatchdog._check_processes``, except that while the launcher
    stops on SIGTERM and a scheduler still runs (draining its tier writes), children that died of
    SIGTERM are no crash (False: keep watching). A child's SIGTERM death waits up to
    ``SIGTERM_RACE_S`` for the launcher's own SIGTERM (the same group signal, handled in its loop)."""
    procs = list(zip(getattr(watchdog, "_processes", None) or (), getattr(watchdog, "_names", None) or ()))
    ended = [p for p, _ in procs if not p.is_alive() and p.exitcode != 0]
    if ended and all(p.exitcode == -signal.SIGTERM for p in ended) and _launcher_stopping.wait(SIGTERM_RACE_S):
        if any(p.is_alive() for p, name in procs if str(name).startswith("scheduler")):
            return False
    return original(watchdog, *args, **kwargs)
