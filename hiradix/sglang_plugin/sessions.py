"""Streaming sessions (``--enable-streaming-session``) on hiradix's tree, with SGLang's own session object.

SGLang 0.5.23 keeps a streaming session's KV in a record the session owns between turns
(``sglang/srt/session/streaming_session.py``, ``StreamingSession``) and wires it into its
``UnifiedRadixCache`` only. Its scheduler reaches the session through ``BasePrefixCache``
members, which this mixin gives :class:`hiradix.sglang_plugin.cache.TieredRadixCache`:

- ``match_prefix`` (admission, ``schedule_policy``): a turn of a session that holds a record
  borrows it, without a tree match;
- ``lock(node)`` (admission, on the match node): the session's stand-in node takes no lock;
- ``maybe_hand_to_session`` (``allocation.alloc_for_extend``, once the row is allocated): the first
  turn's row and tree lock become the session's;
- ``checkpoint`` (``checkpoint_kv_cache``, ``release_kv_cache``): the first turn publishes its
  prompt into the tree; later turns publish nothing;
- ``claim_kv_row`` (``release_kv_cache``, at a finish or a retraction): a finished or retracted
  turn leaves the row to the session; an aborted one takes it back and is released like any request;
- ``release_session`` (``SessionController``, ``/close_session``): unlock, free the row;
- ``session_records`` (pool accounting, the invariant checker): the rows sessions own.

Between turns a session's row stays in HBM, pinned like stock's: its published prompt is locked
in the tree (counted in ``protected_size``), the rest is the session's (SGLang counts it as
session-held). The tree itself never sees a session's later turns.

SGLang's tree-cache factory (``mem_cache/registry.py``, ``create_tree_cache``) refuses
``--enable-streaming-session`` for any cache that is not a ``UnifiedRadixCache`` (an
``isinstance`` check after the factory ran); :func:`around_create_tree_cache`, a declared
scheduler hook (:mod:`hiradix.sglang_plugin.hooks`), builds hiradix's cache with that one setting
hidden from that check, and checks that the cache it got serves sessions.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult, TreeLock
from sglang.srt.session.streaming_session import StreamingSession, is_virtual_node

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ReqKvInfo

logger = logging.getLogger(__name__)


class StreamingSessions:
    """``BasePrefixCache``'s streaming-session members over SGLang's ``StreamingSession``.

    Mixed into a prefix cache that defines ``checkpoint_into_tree(req, up_to=...)`` (the tree's
    own insert), ``inc_lock_ref``, ``page_size``, ``req_to_token_pool`` and
    ``token_to_kv_pool_allocator``; ``StreamingSession`` calls ``unlock``, ``free_kv_row``,
    ``checkpoint_into_tree``, ``req_to_token_pool`` and ``page_size`` of it. The cache calls
    :meth:`init_sessions` in its constructor and :meth:`session_match` first in ``match_prefix``.
    """

    session: StreamingSession  # the sessions' records by session id; set by init_sessions

    def init_sessions(self) -> None:
        """Start with no session records (also after ``reset``: stock drops them the same way)."""
        self.session = StreamingSession(self)

    def session_match(self, params: MatchPrefixParams) -> Optional[MatchResult]:
        """The borrowed record of a session turn (``device_prefix_len`` = its KV kept from the
        previous turns, in tokens; the match node is the session's stand-in), or None: match the
        tree. Frees the record's rows past that length (modifies the pool)."""
        return self.session.try_match_prefix(params)

    def lends_record(self, req: Req) -> bool:
        """Whether ``req`` runs on its session's record (it needs nothing from the tiers)."""
        return self.session.will_lend_record(req)

    def checkpoint(self, req: Req, *, up_to: int, **kwargs: Any) -> None:
        """A session turn publishes only its session's first prompt (then the session keeps the
        lock); any other request goes into the tree (``checkpoint_into_tree``)."""
        if self.session.try_checkpoint(req, up_to=up_to, **kwargs):
            return
        self.checkpoint_into_tree(req, up_to=up_to, **kwargs)

    def lock(self, node: Any) -> Optional[TreeLock]:
        """A tree lock on ``node``; None on a session's stand-in node (its session holds the lock)."""
        if is_virtual_node(node):
            return None
        return super().lock(node)

    def maybe_hand_to_session(self, req: Req) -> None:
        """After a row is allocated: a session's first turn hands its row and tree lock to the
        session and borrows them from here on."""
        self.session.take(req)

    def claim_kv_row(self, req: Req) -> bool:
        """True when the session kept the finished (or retracted) turn's row: the caller frees nothing."""
        return self.session.try_cache_finished_req(req)

    def release_session(self, session_id: str) -> None:
        """The session closed: unlock its published prompt, free the rest of its row."""
        self.session.release_session(session_id)

    def session_records(self) -> dict[str, ReqKvInfo]:
        """The KV records sessions own, by session id (SGLang counts them as session-held)."""
        return {sid: slot.kv for sid, slot in self.session.slots.items()}


def around_create_tree_cache(original: Any, ctx: Any, *args: Any, **kwargs: Any) -> Any:
    """Build hiradix's cache with ``--enable-streaming-session`` hidden from SGLang's
    ``UnifiedRadixCache``-only check (scheduler hook on ``kv_cache_builder.create_tree_cache``).

    Any other build (another backend, no streaming sessions) runs untouched. SGLang's other checks
    in ``create_tree_cache`` still run; only its ``get_serving().enable_streaming_session`` reads
    False while the cache is built (a scoped ``override``, restored on return or error).

    Raises:
        RuntimeError: the cache built is not one that serves streaming sessions.
    """
    from sglang.srt.runtime_context import get_memory, get_serving

    from hiradix.sglang_plugin.refusals import BACKEND_NAME

    serving = get_serving()
    if not serving.enable_streaming_session or get_memory().radix_cache_backend != BACKEND_NAME:
        return original(ctx, *args, **kwargs)
    with serving.override(enable_streaming_session=False):
        cache = original(ctx, *args, **kwargs)
    if not isinstance(cache, StreamingSessions):
        raise RuntimeError(f"hiradix: --enable-streaming-session: the tree cache built is {type(cache).__name__}, "
                           "which does not serve streaming sessions")
    logger.info("hiradix: streaming sessions run on %s (a session's row stays in HBM between turns)",
                type(cache).__name__)
    return cache
