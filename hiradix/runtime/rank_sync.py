"""Tensor-parallel agreement on asynchronous completions (one collective per scheduler step).

With TP, every rank holds its own tree over its own shard of the KV heads, and every rank must
take the same cache decisions in the same step (same hits, same batch), or the ranks enter
different collectives and hang. The decisions are deterministic given the same inputs, except
what arrives asynchronously: copies that finish, worker acks (and whether a page verified), and
prefetch deadlines (wall clock). :class:`RankSync` makes those agree: each step, every rank
lists its in-flight transfers in op-id order (op ids are assigned in the same order on every
rank, because the same decisions prepare them); one MAX all-reduce over the CPU group checks
that every rank has the same number in flight (a mismatch raises on every rank instead of
hanging), and one MIN all-reduce yields, per op, whether it finished on *every* rank, whether
it succeeded on every rank, and whether any rank's deadline passed. Only agreed outcomes are
applied; the rest wait for a later step. This mirrors SGLang's
``_sync_hicache_ready_counts`` / ``loading_check`` MIN all-reduce
(``mem_cache/unified_radix_cache.py``).

With TP = 1 (no group), :meth:`agree` returns its input unchanged and makes no call. This is
the real :class:`hiradix.core.ports.RankAgreement`; the outcome codes are the core's.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

# Per op, in the exchanged tensor: OK = finished ok, ABORTED = nothing moved (the worker died or
# refused it), FAILED = a page failed verification, NOT_DONE = not finished. MIN over ranks: OK
# only if every rank finished ok; a verification failure anywhere wins over an abort; NOT_DONE
# if any rank has not finished.
from hiradix.core.ports import ABORTED, FAILED, NOT_DONE, OK  # noqa: E402,F401 - re-exported


class RankSync:
    """Agrees on which in-flight transfers finished (and how) across TP ranks.

    Args:
        group: the TP CPU process group (SGLang's ``CacheInitParams.tp_cache_group``), or
            None for a single rank.
    """

    def __init__(self, group: Optional[Any] = None):
        self.group = group
        self.size = torch.distributed.get_world_size(group) if group is not None else 1
        self.calls = 0  # collectives issued (equal on every rank)

    def agree(self, in_flight: list[int], local: dict[int, int], expired: set[int]) -> tuple[dict[int, int], set[int]]:
        """Reduce this rank's view of ``in_flight`` op ids to what every rank agrees on.

        Args:
            in_flight: op ids in flight, ascending; identical on every rank.
            local: op id -> ``OK``, ``ABORTED`` or ``FAILED`` for ops this rank saw finish.
            expired: op ids whose deadline passed on this rank.

        Returns:
            ``(finished, expired)``: ops finished on every rank with their common outcome
            (the worst one: FAILED < ABORTED < OK), and ops expired on any rank.

        Raises:
            RuntimeError: ranks disagree on the number of in-flight ops (a determinism bug).
        """
        if self.size == 1:
            return dict(local), set(expired)
        n = len(in_flight)
        lengths = torch.tensor([n, -n], dtype=torch.int64)  # MAX -> (max n, -min n)
        torch.distributed.all_reduce(lengths, op=torch.distributed.ReduceOp.MAX, group=self.group)
        self.calls += 1
        if int(lengths[0]) != n or int(-lengths[1]) != n:
            raise RuntimeError(
                f"hiradix: TP ranks disagree on in-flight transfers ({n} here, "
                f"{int(-lengths[1])}..{int(lengths[0])} across ranks)"
            )
        # One MIN: per op its state, then per op minus its "deadline passed" flag.
        state = [local.get(i, NOT_DONE) for i in in_flight]
        late = [-1 if i in expired else 0 for i in in_flight]
        data = torch.tensor(state + late, dtype=torch.int64)
        torch.distributed.all_reduce(data, op=torch.distributed.ReduceOp.MIN, group=self.group)
        self.calls += 1
        finished = {op: int(data[k]) for k, op in enumerate(in_flight) if int(data[k]) != NOT_DONE}
        return finished, {op for k, op in enumerate(in_flight) if int(data[n + k]) < 0}
