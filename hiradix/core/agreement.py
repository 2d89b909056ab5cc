"""Tensor-parallel agreement as two all-reduces of integer lists (pure; the collective is a subclass's).

With TP, every rank holds its own tree over its own shard of the KV heads, and every rank must
take the same cache decisions in the same step (same hits, same batch, same op ids), or the ranks
enter different collectives and hang. The decisions are deterministic given the same inputs,
except what arrives asynchronously or is read locally: copies that finish, worker acks (and
whether a page verified), prefetch deadlines (wall clock), an I/O client that gave up, and the
wait before a switched-off store is tried again (wall clock). :class:`ReducedAgreement` makes
those agree, once per step:

* one MAX all-reduce of ``[n, -n, io_gave_up, store_wait_left]``: every rank lists its in-flight
  transfers in op-id order (op ids are assigned in the same order on every rank, because the
  same decisions prepare them), so the first two check that every rank has the same number in
  flight (a mismatch raises on every rank instead of hanging); the last two are the
  :class:`~hiradix.core.ports.StepVotes`: NVMe goes off if *any* rank's I/O client gave up, the
  store is tried again only if *no* rank's wait is left (every rank's clock says so);
* one MIN all-reduce, only when something is in flight (every rank knows it from the MAX):
  per op, whether it finished on *every* rank, whether it succeeded on every rank, and whether
  any rank's deadline passed. Only agreed outcomes are applied; the rest wait for a later step.

This mirrors SGLang's ``_sync_hicache_ready_counts`` / ``loading_check`` MIN all-reduce
(``mem_cache/unified_radix_cache.py``). The real collective is the TP CPU group's
(:class:`hiradix.runtime.rank_sync.RankSync`); tests run ranks as threads. With one rank,
:meth:`ReducedAgreement.agree` returns its input unchanged and makes no call.
"""

from __future__ import annotations

from hiradix.core.ports import NOT_DONE, StepVotes

MAX, MIN = "max", "min"  # the reductions :meth:`ReducedAgreement.all_reduce` is asked for


class ReducedAgreement:
    """:class:`~hiradix.core.ports.RankAgreement` over an element-wise all-reduce of int lists.

    Subclasses implement :meth:`all_reduce`. Outcome codes are the core's
    (:data:`hiradix.core.ports.OK` etc.): the MIN over ranks of an op's code is OK only if every
    rank finished it ok; a verification failure anywhere wins over an abort; NOT_DONE if any
    rank has not finished.

    Args:
        size: number of ranks.
    """

    def __init__(self, size: int):
        self.size = size
        self.calls = 0  # collectives issued (equal on every rank)

    def all_reduce(self, values: list[int], op: str) -> list[int]:
        """Element-wise ``op`` (``MAX`` or ``MIN``) of ``values`` over every rank (one collective;
        every rank passes a list of the same length)."""
        raise NotImplementedError

    def _reduce(self, values: list[int], op: str) -> list[int]:
        self.calls += 1
        return self.all_reduce(values, op)

    def agree(self, in_flight: list[int], local: dict[int, int], expired: set[int],
              votes: StepVotes = StepVotes()) -> tuple[dict[int, int], set[int], StepVotes]:
        """Reduce this rank's view of ``in_flight`` op ids and its votes to what every rank agrees on.

        Args:
            in_flight: op ids in flight, ascending; identical on every rank.
            local: op id -> ``OK``, ``ABORTED`` or ``FAILED`` for ops this rank saw finish.
            expired: op ids whose deadline passed on this rank.
            votes: this rank's :class:`~hiradix.core.ports.StepVotes`.

        Returns:
            ``(finished, expired, votes)``: ops finished on every rank with their common outcome
            (the worst one: FAILED < ABORTED < OK), ops expired on any rank, the agreed votes.

        Raises:
            RuntimeError: ranks disagree on the number of in-flight ops (a determinism bug).
        """
        if self.size == 1:
            return dict(local), set(expired), votes
        n = len(in_flight)
        head = self._reduce([n, -n, int(votes.io_gave_up), int(not votes.store_retry_due)], MAX)
        if head[0] != n or -head[1] != n:
            raise RuntimeError(f"hiradix: TP ranks disagree on in-flight transfers ({n} here, "
                               f"{-head[1]}..{head[0]} across ranks)")
        agreed = StepVotes(io_gave_up=head[2] > 0, store_retry_due=head[3] == 0)
        if n == 0:  # the same on every rank: no second collective
            return {}, set(), agreed
        # One MIN: per op its state, then per op minus its "deadline passed" flag.
        state = [local.get(i, NOT_DONE) for i in in_flight]
        late = [-1 if i in expired else 0 for i in in_flight]
        data = self._reduce(state + late, MIN)
        finished = {op: data[k] for k, op in enumerate(in_flight) if data[k] != NOT_DONE}
        return finished, {op for k, op in enumerate(in_flight) if data[n + k] < 0}, agreed
