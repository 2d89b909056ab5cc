"""How long admission held each request, by cause (pure bookkeeping).

A request whose prefix continues below DRAM is skipped at admission (``should_wait``) until its
part is in DRAM, within its load timeout. Each admission attempt names why it held the request; the
time until the next attempt is charged to that cause:

* ``nvme_read`` / ``store_read``: a read of its part into DRAM is in flight;
* ``dram_room``: no read covers its part yet (DRAM had no room for it; the next attempt tries again);
* ``store_lookup``: the cluster store is asked what follows its local match.

:class:`HoldTimes` lives on the request's :class:`~hiradix.core.lookahead.QueuedKey`; the totals
go to :class:`~hiradix.core.stats.TierStats` (``admission_wait_s`` by cause, ``held_requests``).
SGLang's own queue time (``sglang:queue_time_seconds``) includes these holds.
"""

from __future__ import annotations

from typing import Optional

CAUSES = ("nvme_read", "store_read", "dram_room", "store_lookup")


class HoldTimes:
    """One request's holds: the cause of the last attempt that held it, and since when."""

    __slots__ = ("since_s", "cause")

    def __init__(self) -> None:
        self.since_s: Optional[float] = None
        self.cause: Optional[str] = None

    def attempt(self, now_s: float, cause: Optional[str]) -> tuple[Optional[str], float, bool]:
        """An admission attempt at ``now_s`` held the request for ``cause`` (None: admitted it).

        Returns:
            ``(cause, seconds, first)``: the seconds since the last attempt that held it, charged to
            that attempt's cause (``(None, 0.0, ...)`` if the last attempt did not hold it), and
            whether this is the first hold since it was last admitted.
        """
        charged = (self.cause, now_s - self.since_s) if self.cause is not None else (None, 0.0)
        first = cause is not None and self.cause is None
        self.since_s, self.cause = (now_s, cause) if cause is not None else (None, None)
        return charged[0], charged[1], first
