"""Context overflow in the trace simulator: conversations cut to the model's context (issue 20, item 6).

AttentionStore / CachedAttention (USENIX ATC '24, §3.4): when a conversation's prompt plus its
output no longer fits the model's context, the oldest part after a kept head is dropped. The cut
is :func:`hiradix.core.context_overflow.plan_truncation` (the server's function): keep the
head, drop ``context_drop_ratio`` (0.5) of the rest, at least the overflow, in whole pages.

The model (``SimConfig.context_tokens`` set; ``None`` = unlimited, nothing is cut):

* Conversations. The trace has no conversation ids; a request continues the conversation of its
  parent, the latest earlier request holding its deepest block shared with the past (hash ids
  encode their prefix), when it shares more than the head. The head is the leading blocks every
  request of the trace starts with (Mooncake: block 0, 512 tokens, the system prompt): the tree's
  part shared by all conversations, the kept tokens of every cut (``keep_tokens``). Hash ids cannot
  tell a document two users share from one conversation's history: both count as one conversation.
* The client's history. Once a conversation has been cut, the client sends the cut history
  from then on: a request's view is its trace prompt minus the parent's dropped token ranges
  (those inside the part it shares with the parent; positions are the trace's, so a dropped
  range is the same tokens in every later turn). When the view (+ the request's output) overflows
  the context, it is cut again; the sent prompt is ``view[:keep] + view[keep + drop:]``. The cut
  depends on lengths only, so it is planned once for the whole trace, before the replay.
* Keys. A page's id is its trace id (block id, page in block), so the cut prompt's key is the
  trace key without the dropped pages: a new branch after the head. Later turns of the same
  conversation extend that branch and hit it as a normal prefix (in both modes).
* ``recompute`` (every prefix cache today): the overflowing request hits the head only (if
  cached); its kept tail is prefilled again.
* ``shift`` (``--hiradix-context-overflow shift``): the kept tail's pages still cached at their
  old positions (the view's path in the tree, in HBM or DRAM) are re-used, re-rotated to their new
  positions, provided the head hit: a page the request hit at ``hit`` continues with view page
  ``hit + drop``. The re-rotated copy is written to new HBM pages, inserted as the cut prompt's
  branch (it costs capacity like any node); pages read from DRAM cost a DRAM -> HBM read
  (``dram_read_bytes_per_s``) in the cost model, HBM ones are free; NVMe-only pages are not
  shifted (recomputed). The old path is left in the tree for the policy to evict.

Counted: overflowed requests (a new cut), dropped tokens (of those cuts), shifted tokens
(re-used after a shift; they also count as hits, of the tier they were read from), too long
(no cut fits; counted as rejected). Hit rates are over the prompts sent (cut prompts).
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from dataclasses import dataclass
from typing import Optional, Sequence

from hiradix.core.context_overflow import PromptTooLong, Truncation, plan_truncation

OVERFLOW_MODES = ("recompute", "shift")
BLOCK_TOKENS = 512  # tokens per hash id (bench.sim.simulate.BLOCK_TOKENS)
Segments = tuple  # kept trace-token ranges ((start, end), ...), end = math.inf for the last


def check_overflow_config(context_tokens: Optional[int], mode: str, drop_ratio: float) -> None:
    """Raises ValueError for a bad ``--context-tokens``, ``--context-overflow`` or ``--context-drop-ratio``."""
    if context_tokens is not None and context_tokens <= 0:
        raise ValueError(f"context_tokens must be > 0 (or None: unlimited), got {context_tokens}")
    if mode not in OVERFLOW_MODES:
        raise ValueError(f"context_overflow must be one of {', '.join(OVERFLOW_MODES)}; got {mode!r}")
    if not 0.0 < drop_ratio <= 1.0:
        raise ValueError(f"context_drop_ratio must be in (0, 1], got {drop_ratio}")


def common_head_blocks(trace: Sequence) -> int:
    """Leading hash ids every request of ``trace`` starts with (0 for an empty trace)."""
    if not trace:
        return 0
    head = list(trace[0].hash_ids)
    for t in trace[1:]:
        n = 0
        while n < min(len(head), len(t.hash_ids)) and head[n] == t.hash_ids[n]:
            n += 1
        del head[n:]
    return len(head)


def clip(segments: Segments, end: float) -> Segments:
    """The kept ranges of a history that is shared up to ``end`` only; everything after is kept."""
    out = [(a, min(b, end)) for a, b in segments if a < end]
    if out and out[-1][1] == end:
        out[-1] = (out[-1][0], math.inf)
    else:
        out.append((end, math.inf))
    return tuple(out)


def drop_view_span(segments: Segments, start: int, end: int) -> Segments:
    """Remove view positions ``[start, end)`` (view = the kept ranges laid end to end)."""
    out, pos = [], 0
    for a, b in segments:
        n = b - a
        lo, hi = max(start - pos, 0), min(end - pos, n)
        if lo >= hi:
            out.append((a, b))
        else:
            out += [(a, a + lo)] if lo > 0 else []
            out += [(a + hi, b)] if hi < n else []
        pos += n
    return tuple(out)


def kept_tokens(segments: Segments, length: int) -> int:
    """Tokens of ``[0, length)`` the ranges keep."""
    return sum(max(0, min(b, length) - a) for a, b in segments)


@dataclass(frozen=True)
class OverflowView:
    """What one request sends, and (shift mode, a new cut) where its kept tail was cached.

    Attributes:
        trace: the request as sent: ``input_len`` = the cut prompt's tokens; ``hash_ids`` = the
            blocks it keeps a token of (the block hit rate is approximate when cuts split blocks).
        key: tree key of the sent prompt (``make_key`` of the trace without dropped pages).
        source_key: tree key of the uncut view (where the kept tail's KV sits), or None.
        keep_len, drop_len: the new cut's head and dropped part, in tree tokens.
        dropped_tokens: tokens this request's new cut drops (0 when it is not cut).
    """

    trace: object
    key: array
    source_key: Optional[array] = None
    keep_len: int = 0
    drop_len: int = 0
    dropped_tokens: int = 0


class ConversationCuts:
    """The whole trace's cuts at one context length, planned before the replay.

    Args:
        trace: requests sorted by arrival (:class:`bench.sim.simulate.TraceRequest`).
        cfg: the :class:`bench.sim.simulate.SimConfig` (``context_tokens`` set).
    """

    def __init__(self, trace: Sequence, cfg):
        self.trace, self.cfg = trace, cfg
        self.head_blocks = common_head_blocks(trace)
        self.views: list[Segments] = []  # per request: its view (kept trace ranges) before its own cut
        self.cuts: list[Optional[Truncation]] = []  # per request: its own cut of the view
        self.too_long: list[bool] = []
        self.continuing = 0  # requests that continue an earlier conversation
        self.shared_view_tokens: list[int] = []  # per request: leading view tokens an earlier turn sent (cacheable)
        self.counts = {"overflowed_requests": 0, "dropped_tokens": 0, "shifted_tokens": 0, "too_long": 0}
        after: list[Segments] = []  # per request: the view after its own cut (what children inherit)
        last_seen: dict[int, int] = {}  # block id -> latest request holding it
        for i, t in enumerate(trace):
            shared = 0
            while shared < len(t.hash_ids) and t.hash_ids[shared] in last_seen:
                shared += 1
            view: Segments = ((0, math.inf),)
            whole = t.input_len - t.input_len % cfg.page_size
            if shared > self.head_blocks:
                self.continuing += 1
                view = clip(after[last_seen[t.hash_ids[shared - 1]]], min(shared * BLOCK_TOKENS, whole))
            self.shared_view_tokens.append(kept_tokens(view, min(shared * BLOCK_TOKENS, whole)))
            cut, too_long = self._plan(t, view)
            self.views.append(view)
            self.cuts.append(cut)
            self.too_long.append(too_long)
            after.append(drop_view_span(view, cut.keep_tokens, cut.tail_start) if cut else view)
            for b in t.hash_ids:
                last_seen[b] = i

    def _plan(self, t, view: Segments) -> tuple[Optional[Truncation], bool]:
        cfg = self.cfg
        try:
            cut = plan_truncation(kept_tokens(view, t.input_len), t.output_len, cfg.context_tokens,
                                  self.head_blocks * BLOCK_TOKENS, cfg.context_drop_ratio, cfg.page_size)
        except PromptTooLong:
            return None, True
        return cut, False

    def view(self, idx: int, make_key) -> Optional[OverflowView]:
        """What request ``idx`` sends (None: too long for the context); counts its cut.

        ``make_key(trace_request)`` is :func:`bench.sim.simulate.make_key` with the config bound.
        """
        t, cut, u = self.trace[idx], self.cuts[idx], self.cfg.unit_tokens
        if self.too_long[idx]:
            self.counts["too_long"] += 1
            return None
        full = make_key(t)
        view = self.views[idx]
        sent = drop_view_span(view, cut.keep_tokens, cut.tail_start) if cut else view
        key = cut_key(full, sent, u)
        kept = kept_tokens(sent, t.input_len)
        blocks = tuple(dict.fromkeys(t.hash_ids[j] for a, b in sent if a < t.input_len
                                     for j in range(a // BLOCK_TOKENS, -(-int(min(b, t.input_len)) // BLOCK_TOKENS))))
        sent_trace = dataclasses.replace(t, input_len=kept, hash_ids=blocks)
        if cut is None:
            return OverflowView(sent_trace, key)
        self.counts["overflowed_requests"] += 1
        self.counts["dropped_tokens"] += cut.drop_tokens
        source = cut_key(full, view, u) if self.cfg.context_overflow == "shift" else None
        return OverflowView(sent_trace, key, source, cut.keep_tokens // u, cut.drop_tokens // u, cut.drop_tokens)

    def shift_bound_tokens(self) -> int:
        """Tokens an infinite cache could shift: per cut, the kept tail inside the part an earlier turn sent."""
        return sum(max(0, n - c.tail_start) for c, n in zip(self.cuts, self.shared_view_tokens) if c)

    def continuing_share(self) -> float:
        """Share of requests that continue an earlier conversation (share more than the head)."""
        return self.continuing / max(len(self.views), 1)


def cut_key(full: array, segments: Segments, unit_tokens: int) -> array:
    """The tree key of the kept ranges (page-aligned) of a trace key ``full`` (tree tokens)."""
    out = array("q")
    for a, b in segments:
        lo, hi = a // unit_tokens, min(b // unit_tokens if b != math.inf else len(full), len(full))
        out.extend(full[lo:hi])
    return out


def shift_reuse(tree, view: OverflowView, hit_len: int) -> tuple[int, int]:
    """Tree tokens of the cut prompt re-used by a shift after its ``hit_len`` hit: (from HBM, from DRAM).

    The head must have hit (``hit_len >= keep_len``); the cut prompt's token ``hit_len`` is the
    view's ``hit_len + drop_len``, and the re-use runs while the view's pages are in HBM or DRAM.
    Touches the view's path (the shift reads it); changes nothing else.
    """
    if view.source_key is None or hit_len < view.keep_len:
        return 0, 0
    src = tree.match(view.source_key, split=False, touch=True)
    start = hit_len + view.drop_len
    end = min(src.hbm_len + src.dram_len, len(view.source_key))
    if end <= start:
        return 0, 0
    from_hbm = max(0, min(end, src.hbm_len) - start)
    return from_hbm, end - start - from_hbm


def alloc_for_shift(cache, view: Optional[OverflowView], hit_len: int, num_tokens: int) -> tuple:
    """``cache.alloc_device(num_tokens)`` with the view's HBM path locked (shift mode, the head hit).

    The eviction that makes room must not evict the KV the shift copies. Returns ``(slots or
    None, locked node or None)``; the caller unlocks the node (:func:`apply_shift`). When the
    locked path blocks the allocation, it is unlocked and the request allocates without a shift.
    """
    if view is None or view.source_key is None or hit_len < view.keep_len:
        return cache.alloc_device(num_tokens), None
    source = cache.tree.match(view.source_key, split=False, touch=True).hbm_node
    cache.tree.inc_lock(source)
    slots = cache.alloc_device(num_tokens)
    if slots is None:
        cache.tree.dec_lock(source)
        return cache.alloc_device(num_tokens), None
    return slots, source


def apply_shift(cfg, tree, req, plan, hit_len: int, counts: dict, source) -> None:
    """Re-use the kept tail of an admitted request's new cut (shift mode); updates ``req`` and ``counts``.

    Sets ``req.shifted_len`` (tree tokens after the hit, written to the request's new pages, not
    prefilled), adds them to ``req.served`` (HBM, DRAM) and re-times ``req.service_s``: the
    prefill of the rest plus, in the cost model, the DRAM -> HBM read of the DRAM part (serial).
    ``plan`` is the request's :class:`bench.sim.cost.LoadPlan` (cost model) or None; ``source``
    the node :func:`alloc_for_shift` locked (unlocked here: the copy is made at admission).
    """
    u = cfg.unit_tokens
    from_hbm, from_dram = shift_reuse(tree, req.overflow, hit_len)
    tree.dec_lock(source)
    req.shifted_len = from_hbm + from_dram
    req.served = (req.served[0] + from_hbm, req.served[1] + from_dram, req.served[2])
    counts["shifted_tokens"] += req.shifted_len * u
    if plan is None:
        req.service_s = (req.trace.input_len - (hit_len + req.shifted_len) * u) / cfg.prefill_tokens_per_s
        return
    read_s = from_dram * u * cfg.kv_bytes_per_token / cfg.dram_read_bytes_per_s
    plan = dataclasses.replace(plan, uncached_tokens=max(0, plan.uncached_tokens - req.shifted_len * u))
    req.service_s = read_s + plan.service_s(hit_len * u)
