"""Streaming sessions on TieredRadixCache, as SGLang's scheduler drives them (issue 36, item 1).

Over the real SGLang CPU pools and tiers of ``test_cache_seam.Seam``, a session's turns make the
scheduler's calls in its order (match at admission, lock, row allocation and hand-over, checkpoint
after the prefill, release at the finish, ``/close_session``). After every step the tree, the
DRAM books and the HBM slot count (used == tree + the session's own rows) are checked.
"""

from __future__ import annotations

import types

import pytest
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, ReqKvInfo
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.session.streaming_session import is_virtual_node

from tests.plugin.test_cache_seam import DEVICE_TOKENS, PS, Seam

SID = "session-1"
A = list(range(1000, 1014))  # turn 1's prompt: 14 tokens, 3 whole pages + 2


class Turn(types.SimpleNamespace):
    """A session turn with the members of SGLang's ``Req`` that the session and the seam read."""

    def detach_kv(self) -> ReqKvInfo:
        kv, self.kv = self.kv, ReqKvInfo()
        return kv

    def finished(self) -> bool:
        return self.finished_reason is not None

    def release_mm_inputs_on_abort(self) -> None:
        pass


@pytest.fixture
def s():
    seam = Seam()
    try:
        yield seam
    finally:
        seam.cache.release_host_resources()


def turn(tokens: list[int], finished: list) -> Turn:
    session = types.SimpleNamespace(session_id=SID, streaming=True, finish_req=finished.append, abort_req=lambda: None)
    return Turn(origin_input_ids=list(tokens), output_ids=[], full_untruncated_fill_ids=list(tokens), extra_key=None,
                cache_salt=None, kv=ReqKvInfo(), lock=None, last_node=None, session=session, to_finish=None,
                finished_reason=None, finished_len=None, swa_branching_seqlen=None, storage_hit_length=0,
                storage_hit_start=None)  # fmt: skip


def admit(s: Seam, t: Turn) -> int:
    """Match (less the last token, as SGLang matches) and lock, as admission does; the prefix length."""
    m = s.cache.match_prefix(MatchPrefixParams(key=RadixKey((t.origin_input_ids + t.output_ids)[:-1]), req=t))
    t.last_node = m.last_device_node
    t.lock = s.cache.lock(t.last_node)
    return m.device_prefix_len


def allocate(s: Seam, t: Turn, prefix_len: int, end: int) -> None:
    """``alloc_for_extend``: a row (a new turn) or the borrowed one, pages for ``[prefix_len, end)``."""
    if not t.kv.holds_kv:
        t.kv.req_pool_idx = s.rows.alloc_rows(1)[0]
    grow(s, t, prefix_len, end)
    s.cache.maybe_hand_to_session(t)


def grow(s: Seam, t: Turn, start: int, end: int) -> None:
    """Row positions up to ``end`` get slots: whole new pages past the page ``start`` ends in (a
    page's slots are contiguous, so the row holds the whole page, as SGLang's paged allocator
    fills it); ``kv_allocated_len = kv_committed_len = end``."""
    first = -(-start // PS) * PS
    if end > first:
        slots = s.alloc.alloc(-(-(end - first) // PS) * PS)
        s.rows.write((t.kv.req_pool_idx, slice(first, first + len(slots))), slots)
    t.kv.kv_allocated_len = t.kv.kv_committed_len = end


def decode(s: Seam, t: Turn, tokens: list[int]) -> None:
    """Decode ``tokens`` (SGLang's decode allocates a page when one fills), then finish by length."""
    grow(s, t, t.kv.kv_allocated_len, len(t.origin_input_ids) + len(tokens))
    t.output_ids = list(tokens)
    t.finished_reason = FINISH_LENGTH(len(tokens))


def session_tokens(s: Seam) -> int:
    """HBM slots the session holds outside the tree (SGLang's ``session_held``)."""
    return sum(-(-kv.kv_allocated_len // PS) * PS - kv.cache_protected_len
               for kv in s.cache.session_records().values() if kv.holds_kv)  # fmt: skip


def test_a_session_keeps_its_row_between_turns_and_frees_it_on_close(s):
    finished: list = []
    # turn 1: nothing cached; the first row allocation hands the row and the lock to the session
    t1 = turn(A, finished)
    assert admit(s, t1) == 0 and t1.last_node is s.cache.root_node
    allocate(s, t1, 0, len(A))
    assert is_virtual_node(t1.last_node) and t1.lock is None
    (kv,) = s.cache.session_records().values()
    assert kv is t1.kv
    # its prefill checkpoint publishes the prompt's whole pages: the session locks them
    s.cache.checkpoint(t1, up_to=len(A))
    assert (s.cache.protected_size(), s.cache.evictable_size()) == (12, 0)
    assert kv.cache_protected_len == 12 and is_virtual_node(t1.last_node)
    s.check(request_tokens=session_tokens(s))
    # it decodes 2 tokens and finishes: the session keeps the row (the scheduler frees nothing)
    decode(s, t1, [7, 8])
    assert s.cache.claim_kv_row(t1) and not t1.kv.holds_kv and finished == [t1]
    assert kv.kv_committed_len == 16 and s.alloc.available_size() == DEVICE_TOKENS - 16
    s.check(request_tokens=session_tokens(s))
    # turn 2 borrows the row: its prefix is turn 1's prompt + completion, without a tree match
    t2 = turn(A + [7, 8] + [30, 31, 32, 33], finished)
    assert admit(s, t2) == 16 and t2.kv is kv and is_virtual_node(t2.last_node) and t2.lock is None
    allocate(s, t2, 16, 20)
    s.cache.checkpoint(t2, up_to=20)  # publishes nothing: the tree never sees a later turn
    assert (s.cache.protected_size(), s.cache.evictable_size()) == (12, 0)
    decode(s, t2, [40])
    assert s.cache.claim_kv_row(t2) and kv.kv_committed_len == 21
    assert s.alloc.available_size() == DEVICE_TOKENS - 24
    s.check(request_tokens=session_tokens(s))
    # /close_session: the prompt becomes evictable, the rest of the row goes back to the pool
    s.cache.release_session(SID)
    assert s.cache.session_records() == {} and not kv.holds_kv
    assert (s.cache.protected_size(), s.cache.evictable_size()) == (0, 12)
    assert s.alloc.available_size() == DEVICE_TOKENS - 12
    s.check(request_tokens=0)


def test_a_retracted_turn_leaves_its_row_to_the_session(s):
    finished: list = []
    t1 = turn(A, finished)
    allocate(s, t1, admit(s, t1), len(A))
    s.cache.checkpoint(t1, up_to=len(A))
    grow(s, t1, len(A), 20)  # decoding (a page ahead), retracted after one token: not finished
    t1.output_ids, t1.kv.kv_committed_len = [7], len(A) + 1
    kv = t1.kv
    assert s.cache.claim_kv_row(t1) and kv.kv_committed_len == 15 and not t1.kv.holds_kv
    assert s.alloc.available_size() == DEVICE_TOKENS - 16  # the page ahead went back
    # back in the queue, it matches its own row again: the slots past what it keeps go back
    assert admit(s, t1) == 14 and t1.kv is kv and kv.kv_allocated_len == 14
    assert s.alloc.available_size() == DEVICE_TOKENS - 16
    s.check(request_tokens=session_tokens(s))
    s.cache.release_session(SID)
    assert s.alloc.available_size() == DEVICE_TOKENS - 12 and s.cache.protected_size() == 0
    s.check(request_tokens=0)


def test_reset_forgets_the_sessions(s):
    t1 = turn(A, [])
    allocate(s, t1, admit(s, t1), len(A))
    s.cache.checkpoint(t1, up_to=len(A))
    s.cache.reset()  # SGLang's flush_cache resets the pools itself
    assert s.cache.session_records() == {} and s.cache.protected_size() == 0
    t2 = turn(A + [5, 6], [])
    assert admit(s, t2) == 0 and t2.last_node is s.cache.root_node  # a plain tree match, on an empty tree
