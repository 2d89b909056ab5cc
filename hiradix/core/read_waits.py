"""How long admissions wait for reads into DRAM (pure bookkeeping).

A request whose match continues on NVMe or in the cluster store waits at admission for the read
that brings that part into DRAM (or for the store lookup that finds it), up to its load timeout.
:class:`ReadWaits` keeps each such wait's give-up time by op id:

* a read or lookup started at admission has its deadline at once (now + timeout);
* one started by the look-ahead window or in the background has none until its request reaches
  admission (:meth:`ReadWaits.waiting_on` starts it then);
* a part no read covers yet (the read found no DRAM room; each admission attempt tries again)
  gets a pseudo op id from the ledger so its deadline is agreed like a transfer's
  (:meth:`ReadWaits.unread_pending`);
* a request's whole wait is bounded too, by one more pseudo op per held request (kept on its
  :class:`~hiradix.core.lookahead.QueuedKey`, :meth:`ReadWaits.request_pending`): its reads may
  restart (another request's read dropped what had landed), each with a deadline of its own.

Deadlines are judged once per step on each rank (:meth:`ReadWaits.expired_here`) and the TP
ranks agree on which passed (:meth:`ReadWaits.note_expired`); an admission stops waiting for an
op once its expiry is agreed, so every rank admits the request in the same step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from hiradix.core.node import Tier, TreeNode

if TYPE_CHECKING:
    from hiradix.core.lookahead import QueuedKey

UNREAD_KEEP_STEPS = 64  # steps an expired wait for an unread prefix is remembered (not waited again)


class ReadWaits:
    """Give-up times of the reads and lookups admissions wait for, by op id (one TP rank).

    Args:
        new_op_id: the ledger's op id source (pseudo ops advance it the same on every rank).
        clock: monotonic seconds.
    """

    def __init__(self, new_op_id: Callable[[], int], clock: Callable[[], float]):
        self.new_op_id = new_op_id
        self.clock = clock
        self.deadline_s: dict[int, Optional[float]] = {}  # op id -> give-up time; None: not yet waited on
        self.expired: set[int] = set()  # op ids whose deadline passed (agreed)
        # Parts no read covers yet: their first node's id -> pseudo op id, and pseudo op id ->
        # [node, step its expiry was agreed].
        self._unread_ops: dict[int, int] = {}
        self.unread: dict[int, list] = {}
        # Requests held at admission: pseudo op id -> step its expiry was agreed (None: not yet).
        # A request's whole wait is bounded by one deadline, however often its reads restart.
        self.requests: dict[int, Optional[int]] = {}
        self._steps = 0  # calls of settle(), equal on every rank

    def start(self, op_id: int, timeout_s: float, waits_now: bool, deadline_s: Optional[float] = None) -> None:
        """Track ``op_id``: its deadline is ``deadline_s`` if given, else now + ``timeout_s`` when
        a request waits for it now (``waits_now``), else it starts at the first wait."""
        if op_id not in self.deadline_s:
            self.deadline_s[op_id] = (deadline_s if deadline_s is not None
                                      else self.clock() + timeout_s if waits_now else None)

    def waiting_on(self, op_id: int, timeout_s: float) -> bool:
        """An admission waits on ``op_id``: start its deadline if not yet started; False once expired
        (or not tracked)."""
        if op_id not in self.deadline_s or op_id in self.expired:
            return False
        if self.deadline_s[op_id] is None:
            self.deadline_s[op_id] = self.clock() + timeout_s
        return True

    def waited(self, op_id: int) -> bool:
        """Whether a request waits at admission for ``op_id`` now (its wait started, not expired)."""
        return self.deadline_s.get(op_id) is not None and op_id not in self.expired

    def any_pending(self, nodes: list[TreeNode], timeout_s: float) -> bool:
        """Whether a read for one of ``nodes`` is still in flight and within its timeout (a
        look-ahead read's timeout starts here)."""
        pending = False
        for node in nodes:
            for op_id in node.ops:
                pending |= self.waiting_on(op_id, timeout_s)
        return pending

    def unread_pending(self, nodes: list[TreeNode], timeout_s: float) -> bool:
        """Whether an admission should wait for ``nodes`` (its match's NVMe or store part) that no
        read covers: bounded like a read, ``timeout_s`` from the first attempt."""
        first = next((n for n in nodes if n.alive and not n.in_tier(Tier.DRAM) and not n.ops), None)
        if first is None:
            return False
        op_id = self._unread_ops.get(first.id)
        if op_id is None:
            op_id = self.new_op_id()
            self._unread_ops[first.id] = op_id
            self.unread[op_id] = [first, None]
            self.deadline_s[op_id] = self.clock() + timeout_s
        return self.waiting_on(op_id, timeout_s)

    def request_pending(self, key: QueuedKey, timeout_s: float) -> bool:
        """A request (its :class:`QueuedKey`, kept on the request) is held again: True until its
        own deadline, ``timeout_s`` after it was first held, has expired (agreed by the TP ranks).
        Bounds the request's whole wait: each read it waits for has a deadline of its own, and
        when queued requests' reads drop each other's landed DRAM copies, new reads keep
        starting (a livelock without this bound: tests/core/test_admission_livelock.py)."""
        op_id = key.wait_op
        if op_id is None:
            op_id = key.wait_op = self.new_op_id()
            self.requests[op_id] = None
            self.deadline_s[op_id] = self.clock() + timeout_s
        return op_id in self.deadline_s and op_id not in self.expired

    def pseudo_ops(self) -> list[int]:
        """Ids of the waits that are not transfers (unread parts, held requests): agreed too."""
        return list(self.unread) + list(self.requests)

    def expired_here(self, now: float) -> set[int]:
        """Op ids whose deadline passed on this rank's clock (to be agreed)."""
        return {op for op, t in self.deadline_s.items() if t is not None and t <= now}

    def note_expired(self, expired: set[int]) -> None:
        """The ops every rank agreed have expired; then forget the pseudo ops whose node is read,
        being read or gone, or ``UNREAD_KEEP_STEPS`` steps after their expiry. Once per step."""
        self.expired |= expired
        self._steps += 1
        for op_id, agreed in list(self.requests.items()):
            if agreed is None and op_id in self.expired:
                self.requests[op_id] = agreed = self._steps
            if agreed is not None and self._steps - agreed >= UNREAD_KEEP_STEPS:
                del self.requests[op_id]
                self.done(op_id)
        for op_id, entry in list(self.unread.items()):
            node = entry[0]
            if entry[1] is None and op_id in self.expired:
                entry[1] = self._steps
            if (not node.alive or node.in_tier(Tier.DRAM) or node.ops
                    or (entry[1] is not None and self._steps - entry[1] >= UNREAD_KEEP_STEPS)):
                del self.unread[op_id]
                self._unread_ops.pop(node.id, None)
                self.done(op_id)

    def done(self, op_id: int) -> tuple[Optional[float], bool]:
        """Forget ``op_id`` (it completed); returns its deadline and whether it had expired."""
        expired = op_id in self.expired
        self.expired.discard(op_id)
        return self.deadline_s.pop(op_id, None), expired

    def reset(self) -> None:
        self.deadline_s.clear()
        self.expired.clear()
        self._unread_ops.clear()
        self.unread.clear()
        self.requests.clear()
