"""Finished I/O jobs as agreement values (pure).

Every TP rank reports each job it saw finish as one integer, and the ranks agree on the MIN
(:class:`~hiradix.core.ports.RankAgreement`). A transfer's value is its outcome
(``OK`` / ``ABORTED`` / ``FAILED``, :mod:`hiradix.core.ports`); a store lookup's is
``2 + pages found``, or ``LOOKUP_FAILED`` (0 is NOT_DONE).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from hiradix.core.ports import ABORTED, FAILED, OK

LOOKUP_FAILED = 1  # a store lookup's agreement value when it failed as a whole (0 is NOT_DONE)


def outcome_of(result: Any) -> int:
    """An I/O :class:`~hiradix.core.ports.JobResult` as an agreement outcome.

    A job-level error (worker died, disabled, shut down, job rejected) moved nothing: ABORTED,
    the source copy stays. Otherwise a page that did not verify makes it FAILED.
    """
    if all(result.ok):
        return OK
    return ABORTED if result.error else FAILED


def found_of(result: Any, read_pages: Optional[Callable[[int], int]] = None) -> int:
    """A store lookup's result as an agreement value: 2 + the leading run of keys found (MIN
    over ranks is the run every rank holds); ``LOOKUP_FAILED`` when the job failed as a whole,
    so a failure on any rank is every rank's (the store's failure count, hence its switch-off,
    stays the same on all ranks: a TP rank that maps rank 0's MLA copy never sees an error).

    ``read_pages`` (found pages -> pages worth reading, this rank's load-or-recompute choice)
    shortens the run first: the MIN over ranks is then a read every rank agrees to, so ranks
    whose estimates differ never split their books."""
    if result.error:
        return LOOKUP_FAILED
    found = 0
    for ok in result.ok:
        if not ok:
            break
        found += 1
    return 2 + (read_pages(found) if read_pages is not None and found else found)
