"""Tensor-parallel agreement over the TP CPU group (at most two collectives per scheduler step).

:class:`RankSync` is the real :class:`hiradix.core.ports.RankAgreement`: the encoding (one MAX
all-reduce of the in-flight count and the step's votes, one MIN all-reduce of the in-flight ops'
outcomes and deadlines, skipped when nothing is in flight) is the core's
(:class:`hiradix.core.agreement.ReducedAgreement`); this module supplies the collective, a
``torch.distributed.all_reduce`` over SGLang's TP CPU group (gloo). With TP = 1 (no group) it
makes no call.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from hiradix.core.agreement import MAX, ReducedAgreement
# Outcome codes (the core's), re-exported: OK = finished ok, ABORTED = nothing moved (the worker
# died or refused it), FAILED = a page failed verification, NOT_DONE = not finished.
from hiradix.core.ports import ABORTED, FAILED, NOT_DONE, OK, StepVotes  # noqa: F401 - re-exported


class RankSync(ReducedAgreement):
    """Agrees on which in-flight transfers finished (and how), and on the step's votes, across TP ranks.

    Args:
        group: the TP CPU process group (SGLang's ``CacheInitParams.tp_cache_group``), or
            None for a single rank.
    """

    def __init__(self, group: Optional[Any] = None):
        super().__init__(torch.distributed.get_world_size(group) if group is not None else 1)
        self.group = group

    def all_reduce(self, values: list[int], op: str) -> list[int]:
        """Element-wise MAX or MIN of ``values`` over the TP group (one gloo all-reduce)."""
        data = torch.tensor(values, dtype=torch.int64)
        reduce_op = torch.distributed.ReduceOp.MAX if op == MAX else torch.distributed.ReduceOp.MIN
        torch.distributed.all_reduce(data, op=reduce_op, group=self.group)
        return [int(v) for v in data.tolist()]
