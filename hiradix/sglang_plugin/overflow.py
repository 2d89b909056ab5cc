"""Context overflow in the server (``--hiradix-context-overflow``; AttentionStore §3.4).

Three seams of SGLang 0.5.23, all inactive unless the flag is ``shift``, ``recompute`` or
``noshift``:

* the tokenizer manager (launcher process) lets a prompt longer than the context through
  (``TokenizerManager._validate_one_request`` would answer HTTP 400);
* the scheduler cuts it when the request arrives (``Scheduler.init_req_max_new_tokens``, before
  SGLang's own length check): ``tokens[:keep] + tokens[keep + drop:]``
  (:func:`hiradix.core.context_overflow.plan_truncation`; ``keep`` by default the part shared with
  other conversations, :mod:`hiradix.core.kept_head`, for which every prompt is remembered),
  reusing an earlier cut of the same conversation while it still fits, so the conversation keeps
  one truncated history;
* the prefix match (:meth:`ContextOverflow.reuse`, from the cache's ``match_prefix``) copies the
  kept tail's cached KV from where the tree holds it (:mod:`hiradix.core.context_shift`) into new
  device slots, re-rotated by the positions it moved (:mod:`hiradix.dataplane.rope_shift`), and
  inserts it as a branch of its own; only what no source holds in HBM is prefilled.

Per request, ``cached_tokens_details`` (``return_cached_tokens_details``) gains
``context_truncated_tokens`` and ``context_shifted_tokens`` (in OpenAI answers too:
:mod:`hiradix.sglang_plugin.openai_cut`); the server counts them in
``sglang:hiradix_context_truncated_tokens_total`` / ``sglang:hiradix_shifted_tokens_total``.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from hiradix.core.context_overflow import PromptTooLong, Truncation, plan_truncation
from hiradix.core.context_shift import ReusePlan, plan_moved, plan_shift, shift_sources
from hiradix.core.kept_head import KeptHead, PromptEnds, shared_head
from hiradix.core.page_index import PageContentIndex
from hiradix.core.node import Tier
from hiradix.dataplane.rope_shift import RopeShift, ShiftUnsupported, rope_shift_from_config, shift_slots

logger = logging.getLogger(__name__)

HUGE_CONTEXT = 1 << 40  # what the tokenizer manager is told while it checks a request
MIN_MOVED_TOKENS = 64  # the shortest run a client moved that is reused (shorter runs are recomputed)


def around_validate_one_request(original: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    """Launcher: run SGLang's request checks except the context-length ones (the scheduler cuts)."""
    saved = manager.context_len
    manager.context_len = HUGE_CONTEXT
    try:
        return original(manager, *args, **kwargs)
    finally:
        manager.context_len = saved


def around_init_req_max_new_tokens(original: Any, scheduler: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """Scheduler: cut an overflowing prompt before SGLang sizes its new tokens and checks its length."""
    overflow = getattr(scheduler.tree_cache, "overflow", None)
    if overflow is not None and getattr(req, "hiradix_cut", None) is None:
        overflow.cut(req, context_tokens=scheduler.max_req_len, max_prompt_tokens=scheduler.max_req_input_len - 1)
    return original(scheduler, req, *args, **kwargs)


def resolve_mode(mode: str, hf_config: dict) -> tuple[str, Optional[RopeShift], Optional[str]]:
    """``(mode, rope, why)``: ``shift``/``noshift`` fall back to ``recompute`` (``why`` says so)
    when the model's RoPE variant cannot be shifted (:class:`ShiftUnsupported`)."""
    if mode not in ("shift", "noshift"):
        return mode, None, None
    try:
        return mode, rope_shift_from_config(hf_config), None
    except ShiftUnsupported as e:
        return "recompute", None, str(e)


@dataclass
class CutRecord:
    """A request's cut: the uncut prompt and what its match has done with it."""

    cut: Truncation
    tokens: Sequence[int]
    namespace: Optional[tuple]
    pending: bool  # a reuse of the kept tail is still to be tried (shift / noshift)
    shifted_tokens: int = 0


class ContextOverflow:
    """Cuts overflowing prompts and reuses their kept tails, for one scheduler (one TP rank).

    Args:
        cache: the :class:`~hiradix.sglang_plugin.cache.TieredRadixCache` (its tree and core).
        kv_pool: SGLang's device KV pool (``k_buffer``/``v_buffer`` per layer, or MLA ``kv_buffer``).
        mode: ``shift``, ``recompute`` or ``noshift`` (after :func:`resolve_mode`).
        rope: the model's shift (None unless ``shift``/``noshift``).
        keep_tokens: leading tokens kept; -1 = the part shared with other conversations, else the
            first page (:mod:`hiradix.core.kept_head`).
        drop_ratio: share of the rest dropped by a new cut.
    """

    def __init__(self, cache: Any, kv_pool: Any, mode: str, rope: Optional[RopeShift], keep_tokens: int,
                 drop_ratio: float):
        self.cache, self.kv_pool, self.mode, self.rope = cache, kv_pool, mode, rope
        self.keep_tokens, self.drop_ratio = keep_tokens, drop_ratio
        self.counts = {"cut_requests": 0, "truncated_tokens": 0, "shifted_tokens": 0, "too_long": 0,
                       "moved_requests": 0, "promoted_tokens": 0}
        self._logged: set[str] = set()  # kinds of head whose first cut was logged at INFO
        # where earlier prompts ended: the default head is what other conversations share
        self.prompt_ends = PromptEnds(cache.page_size) if keep_tokens < 0 else None
        if mode in ("shift", "noshift"):  # runs a client moved are found by content
            cache.tree.page_index = PageContentIndex(cache.page_size)
            for node in cache.tree.iter_nodes():
                cache.tree.page_index.add(node)

    # ------------------------------------------------------------ arrival
    def cut(self, req: Any, context_tokens: int, max_prompt_tokens: int) -> Optional[Truncation]:
        """Cut ``req.origin_input_ids`` in place if it overflows; None when it fits, or when no cut
        leaves room for its new tokens (the request is then refused: HTTP 400, as stock). Every
        prompt is remembered (:class:`PromptEnds`, with the default head) whether cut or not."""
        if getattr(req, "multimodal_inputs", None) is not None or getattr(req, "input_embeds", None) is not None:
            return None
        from hiradix.sglang_plugin.cache import namespace_of_req  # the cache module imports this one

        tokens, namespace = list(req.origin_input_ids), namespace_of_req(req)
        try:
            return self._cut(req, tokens, namespace, context_tokens, max_prompt_tokens)
        finally:
            if self.prompt_ends is not None:
                self.prompt_ends.add(tokens, namespace)

    def _cut(self, req: Any, tokens: list[int], namespace: Optional[tuple], context_tokens: int,
             max_prompt_tokens: int) -> Optional[Truncation]:
        requested = req.sampling_params.max_new_tokens
        reserve = max(1, requested if requested is not None else 1)
        context = min(context_tokens, max_prompt_tokens + reserve)
        if len(tokens) + reserve <= context:
            return None
        head = self.head(tokens, namespace)
        cut = self._earlier_cut(tokens, head.tokens, namespace, reserve, context)
        if cut is None:
            try:
                cut = plan_truncation(len(tokens), reserve, context, head.tokens, self.drop_ratio, self.cache.page_size)
            except PromptTooLong as e:
                # Refused as stock SGLang refuses it (HTTP 400), not answered with fewer new tokens
                # than asked: the launcher hook let it past the tokenizer manager's total check.
                self.counts["too_long"] += 1
                logger.info("hiradix: context overflow: %s (request %s)", e, req.rid)
                req.set_finish_with_abort(f"hiradix --hiradix-context-overflow: {e}; lower max_tokens")
                return None
        kept = cut.apply(tokens)
        original = req.origin_input_ids
        req.origin_input_ids = array(original.typecode, kept) if isinstance(original, array) else kept
        req.origin_input_ids_unpadded = req.origin_input_ids
        req.hiradix_cut = CutRecord(cut, tokens, namespace, pending=self.mode in ("shift", "noshift"))
        self.counts["cut_requests"] += 1
        self.counts["truncated_tokens"] += cut.drop_tokens
        self._log_cut(cut, head, context_tokens, reserve)
        return cut

    def head(self, tokens: Sequence[int], namespace: Optional[tuple]) -> KeptHead:
        """The head a cut of ``tokens`` keeps: ``--hiradix-keep-tokens``, or by default the part
        shared with other conversations (:func:`hiradix.core.kept_head.shared_head`)."""
        if self.prompt_ends is None:
            return KeptHead(self.keep_tokens // self.cache.page_size * self.cache.page_size, shared=False)
        own_from = self.prompt_ends.first_end(tokens, namespace)
        return shared_head(self.cache.tree, tokens, namespace, own_from)

    def _log_cut(self, cut: Truncation, head: KeptHead, context_tokens: int, reserve: int) -> None:
        """The first cut of each kind of head at INFO (what it keeps and why), the others at DEBUG."""
        if self.prompt_ends is None:
            kind, why = "flag", f"the kept head is --hiradix-keep-tokens {self.keep_tokens}"
        elif head.shared:
            kind, why = "shared", "the kept head is the part shared with other conversations"
        else:
            kind, why = "first", ("no part of it is shared with other conversations: the kept head is its first "
                                  "page, as llama.cpp's n_keep")
        if cut.keep_tokens != head.tokens:
            why += f", but its {head.tokens} tokens left no room: none kept"
        level = logging.DEBUG if kind in self._logged else logging.INFO
        self._logged.add(kind)
        logger.log(level, "hiradix: context overflow (%s): a prompt of %d tokens keeps %d + %d, drops %d (context %d "
                   "tokens, %d new); %s", self.mode, cut.prompt_tokens, cut.keep_tokens,
                   cut.kept_tokens - cut.keep_tokens, cut.drop_tokens, context_tokens, reserve, why)

    def _earlier_cut(self, tokens: list[int], keep: int, namespace: Optional[tuple], reserve: int,
                     context: int) -> Optional[Truncation]:
        """The smallest drop of an earlier cut of this conversation (a branch of the tree after the
        head) with which the prompt fits, or None (only in modes that reuse KV)."""
        if self.mode == "recompute":
            return None
        tree = self.cache.tree
        for drop in shift_sources(tree, tokens, keep, namespace):
            if drop == 0 or len(tokens) - drop + reserve > context:
                continue
            # a branch that only starts with a repeated page is not an earlier cut: it must go on
            want = min(len(tokens) - keep - drop, MIN_MOVED_TOKENS) // tree.page_size * tree.page_size
            m = tree.match(list(tokens[:keep]) + tokens[keep + drop :], namespace, split=False, touch=False)
            if m.matched_len - keep >= want:
                return Truncation(keep_tokens=keep, drop_tokens=drop, prompt_tokens=len(tokens))
        return None

    # ------------------------------------------------------------ match
    def reuse(self, req: Any, key_tokens: Sequence[int], namespace: Optional[tuple]) -> int:
        """Before ``req``'s match: copy the kept tail of a cut prompt (or, in ``shift``/``noshift``,
        a run of the prompt the tree holds after the same head at other positions: a client
        dropped messages) into new slots, re-rotated, and insert it after the head. Tried once per
        request. Returns tokens copied."""
        tree = self.cache.tree
        record: Optional[CutRecord] = getattr(req, "hiradix_cut", None)
        if record is not None:
            if not record.pending:
                return 0
            record.pending = False
            self._promote_sources(record, namespace)
            m = tree.match(key_tokens, namespace, split=True, touch=False)
            plan = plan_shift(tree, record.tokens, record.cut, namespace, m.hbm_len, len(key_tokens))
        else:
            if self.mode not in ("shift", "noshift") or getattr(req, "hiradix_moved_checked", False):
                return 0
            req.hiradix_moved_checked = True
            m = tree.match(key_tokens, namespace, split=True, touch=False)
            if m.matched_len > m.hbm_len:
                return 0  # a lower tier holds more of this very prefix: it is loaded, not shifted
            tree.page_index.compact(tree.iter_nodes())
            plan = plan_moved(tree, tree.page_index, key_tokens, namespace, m.hbm_node, m.hbm_len, len(key_tokens),
                              MIN_MOVED_TOKENS)
        copied = self._apply(plan, m.hbm_node, key_tokens, namespace) if plan is not None else 0
        if copied:
            if record is not None:
                record.shifted_tokens = plan.shifted_tokens
            else:
                req.hiradix_moved_tokens = plan.shifted_tokens
                self.counts["moved_requests"] += 1
            self.counts["shifted_tokens"] += plan.shifted_tokens
        return copied

    def _promote_sources(self, record: CutRecord, namespace: Optional[tuple]) -> None:
        """Bring the DRAM part of every source of the kept tail into HBM first (the shift runs on
        the device after the pages are loaded; NVMe/store-only pages are recomputed)."""
        tree, core, cut = self.cache.tree, self.cache.core, record.cut
        if core.tiers is None:
            return
        head = list(record.tokens[: cut.keep_tokens])
        for d in shift_sources(tree, record.tokens, cut.keep_tokens, namespace, max_drop=cut.drop_tokens):
            if d >= cut.drop_tokens:
                continue
            m = tree.match(head + list(record.tokens[cut.keep_tokens + d :]), namespace, split=True, touch=False)
            tail_start = cut.keep_tokens + cut.drop_tokens - d  # the kept tail on this source path
            if m.dram_len == 0 or m.hbm_len + m.dram_len <= tail_start:
                continue
            core.lock(m.hbm_node)
            try:
                self.counts["promoted_tokens"] += core.promote_now(m.hbm_node, m.dram_node, m.dram_len).loaded
            finally:
                core.unlock(m.hbm_node)

    def _apply(self, plan: ReusePlan, head: Any, key_tokens: Sequence[int], namespace: Optional[tuple]) -> int:
        """Copy the plan's segments into new device slots and insert them after ``head``."""
        tree, core = self.cache.tree, self.cache.core
        sources = [seg.source_node for seg in plan.segments]
        if any(n.pinned[Tier.HBM] for src in sources for n in tree.path(src)):
            return 0  # a load into those slots is still running
        for node in (*sources, head):
            core.lock(node)
        try:
            slots = core.alloc_device(plan.num_tokens)
            if slots is None:
                return 0
            new = slots.to(torch.int64)
            at = 0
            for seg in plan.segments:
                src = core.path_slots(seg.source_node)[seg.src_start : seg.src_end].to(torch.int64)
                self._copy(src, new[at : at + seg.num_tokens], seg.delta if self.mode == "shift" else 0)
                at += seg.num_tokens
            before = core.path_slots(head)[: plan.dst_start]
            end = plan.dst_start + plan.num_tokens
            core.checkpoint(list(key_tokens[:end]), namespace, torch.cat([before, slots]), plan.dst_start)
        finally:
            for node in (*sources, head):
                core.unlock(node)
        return plan.num_tokens

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, delta: int) -> None:
        """Every layer: K (or the MLA latent row) shifted by ``delta`` positions, V copied."""
        pool = self.kv_pool
        if getattr(pool, "kv_buffer", None) is not None and getattr(pool, "kv_lora_rank", None):
            for buffer in pool.kv_buffer:
                shift_slots(buffer, src, dst, delta, self.rope)
            return
        for k_buffer, v_buffer in zip(pool.k_buffer, pool.v_buffer):
            shift_slots(k_buffer, src, dst, delta, self.rope)
            v_buffer[dst] = v_buffer[src]


def details_of(req: Any) -> Optional[dict]:
    """``{"context_truncated_tokens", "context_shifted_tokens"}`` of a cut request, else None."""
    record: Optional[CutRecord] = getattr(req, "hiradix_cut", None)
    if record is None:
        moved = getattr(req, "hiradix_moved_tokens", 0)
        return {"context_shifted_tokens": moved} if moved else None
    return {"context_truncated_tokens": record.cut.drop_tokens, "context_shifted_tokens": record.shifted_tokens}
