"""Where a cut prompt's kept tail is cached, and how far it must be shifted (AttentionStore §3.4).

A prompt cut by :mod:`hiradix.core.context_overflow` is ``head ‖ tail`` with ``head =
tokens[:keep]`` and ``tail = tokens[keep + drop:]``. The tree may hold the tail's KV on another
path, at other positions:

* the uncut conversation, ``head ‖ tokens[keep:]`` (the tail ``drop`` tokens further right);
* an earlier cut of the same conversation, ``head ‖ tokens[keep + d:]`` for a smaller (or the
  same) drop ``d``; its KV sits ``drop - d`` positions further right.

Every such *source* continues the head with a page of ``tokens`` at ``keep + d`` for some ``d``
(whole pages): :func:`shift_sources` finds them among the continuations of the head in the tree.
:func:`plan_shift` picks the source that covers the most of the tail in HBM and says which of its
slots to copy, re-rotated by ``d - drop`` positions (:mod:`hiradix.dataplane.rope_shift`), into
new slots that become a branch ``head ‖ tail`` of the tree with pages of its own.

Pure bookkeeping over :class:`~hiradix.core.tree.TieredRadixTree` (token ids only); the
server's glue is :mod:`hiradix.sglang_plugin.overflow`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from hiradix.core.context_overflow import Truncation
from hiradix.core.tree import TieredRadixTree, TreeNode


def _continuations(tree: TieredRadixTree, tokens: Sequence[int], keep: int,
                   namespace: Optional[tuple]) -> Optional[set[tuple]]:
    """First pages the tree holds right after ``tokens[:keep]``; None if the head is not cached."""
    ps = tree.page_size
    if keep == 0:
        node, inside = tree.root, None
    else:
        m = tree.match(tokens[:keep], namespace, split=False, touch=False)
        if m.matched_len < keep:
            return None
        node = m.nodes[-1]
        inside = sum(n.num_tokens for n in m.nodes) - keep  # tokens of the last node past the head
    if inside:
        offset = node.num_tokens - inside
        return {tuple(node.tokens[offset : offset + ps])}
    pages = set()
    for child in node.children.values():
        if child.namespace == namespace:
            pages.add(tuple(child.tokens[:ps]))
    return pages


def shift_sources(tree: TieredRadixTree, tokens: Sequence[int], keep: int, namespace: Optional[tuple],
                  max_drop: Optional[int] = None) -> list[int]:
    """Drops ``d`` (whole pages, ascending) for which the tree continues ``tokens[:keep]`` with
    the page ``tokens[keep + d : keep + d + page_size]``: candidate sources of a cut's tail.

    ``d = 0`` is the uncut conversation. Read-only; O(pages of ``tokens``).
    """
    ps = tree.page_size
    pages = _continuations(tree, tokens, keep, namespace)
    if not pages:
        return []
    limit = (len(tokens) - keep) // ps * ps
    if max_drop is not None:
        limit = min(limit, max_drop + ps)
    return [d for d in range(0, limit, ps) if tuple(tokens[keep + d : keep + d + ps]) in pages]


@dataclass(frozen=True)
class CopySegment:
    """Source slots ``[src_start, src_end)`` of the HBM path ending at ``source_node`` (lock it
    while copying), re-rotated by ``delta`` positions (destination minus source)."""

    source_node: TreeNode
    src_start: int
    src_end: int
    delta: int

    @property
    def num_tokens(self) -> int:
        return self.src_end - self.src_start


@dataclass(frozen=True)
class ReusePlan:
    """Copies that fill the prompt's positions ``[dst_start, dst_start + num_tokens)``, in order;
    ``source_drop``: the drop of the cut branch copied from (0: the uncut path; None: found by
    content, :func:`plan_moved`)."""

    dst_start: int
    segments: tuple[CopySegment, ...]
    source_drop: Optional[int] = None

    @property
    def num_tokens(self) -> int:
        return sum(seg.num_tokens for seg in self.segments)

    @property
    def shifted_tokens(self) -> int:
        """Tokens copied to other positions (a same-position copy of a partial page is not)."""
        return sum(seg.num_tokens for seg in self.segments if seg.delta)


def plan_shift(tree: TieredRadixTree, tokens: Sequence[int], cut: Truncation, namespace: Optional[tuple],
               covered: int, limit: int) -> Optional[ReusePlan]:
    """The best source for the cut prompt's positions ``[covered, limit)`` (whole pages).

    Args:
        tokens: the uncut prompt (``cut.prompt_tokens`` long).
        covered: tokens of the cut prompt the tree already holds in HBM on its own path (>= the
            head: a plan extends that path).
        limit: cut-prompt tokens worth reusing (whole pages of the cut prompt).

    Returns:
        None when no source holds, in HBM, a page after ``covered``; else a one-segment plan with
        the most tokens. Splits nodes at the source's HBM end (like a match); no other change.
    """
    ps, keep, drop = tree.page_size, cut.keep_tokens, cut.drop_tokens
    if covered < keep or covered >= limit:
        return None
    best: Optional[ReusePlan] = None
    for d in shift_sources(tree, tokens, keep, namespace, max_drop=drop):
        if d >= drop:
            continue  # the cut's own branch: ``covered`` is its match already
        source = tuple(tokens[:keep]) + tuple(tokens[keep + d :])
        m = tree.match(source, namespace, split=True, touch=True)
        lag = drop - d  # the tail sits this much further right on the source path
        src_start, src_end = covered + lag, min(m.hbm_len, limit + lag) // ps * ps
        if src_end - src_start >= ps and (best is None or src_end - src_start > best.num_tokens):
            best = ReusePlan(covered, (CopySegment(m.hbm_node, src_start, src_end, -lag),), source_drop=d)
    return best


# ------------------------------------------------------------------ moved by the client
def _path_start(node: TreeNode) -> int:
    """Position of ``node``'s first token on its path."""
    start, node = 0, node.parent
    while node is not None and node.parent is not None:
        start += node.num_tokens
        node = node.parent
    return start


def _below(node: TreeNode, ancestor: TreeNode) -> bool:
    while node is not None:
        if node is ancestor:
            return True
        node = node.parent
    return False


def _divergence(tree: TieredRadixTree, tokens: Sequence[int], head: TreeNode, covered: int) -> tuple[int, Optional[TreeNode]]:
    """``(q, child)``: where ``tokens`` leave the tree inside the page after ``covered`` (a
    message boundary is rarely a page boundary), and the child of ``head`` that holds
    ``tokens[covered:q]`` at the same positions (None when ``q == covered``)."""
    best, holder = 0, None
    for child in head.children.values():
        n = 0
        while n < min(tree.page_size, child.num_tokens) and covered + n < len(tokens) and child.tokens[n] == tokens[covered + n]:
            n += 1
        if n > best and child.hbm_slots is not None:
            best, holder = n, child
    return covered + best, holder


def plan_moved(tree: TieredRadixTree, index: Any, tokens: Sequence[int], namespace: Optional[tuple],
               head: TreeNode, covered: int, limit: int, min_tokens: int) -> Optional[ReusePlan]:
    """A client dropped messages: ``tokens = A ‖ C`` where the tree holds ``A ‖ B ‖ C``.

    ``tokens[:covered]`` is the HBM match, ending at ``head`` (A, whole pages). C is looked up by
    content (:class:`~hiradix.core.page_index.PageContentIndex`) among the pages below ``head``
    in the same namespace, verified token by token, and copied shifted by ``-|B|``; the tokens of
    A in the page after ``covered`` come from the path that holds them at the same positions.

    Args:
        limit: tokens worth reusing (whole pages of the prompt).
        min_tokens: the shortest reuse worth a plan (shorter runs are recomputed).

    Returns:
        None, or the plan; splits nodes at the source's HBM end (like a match), nothing else.
    """
    ps = tree.page_size
    if index is None or limit - covered < max(min_tokens, ps):
        return None
    q, holder = _divergence(tree, tokens, head, covered)
    best: Optional[tuple[int, CopySegment]] = None
    for j in range(ps):
        window = tokens[q + j : q + j + ps]
        if len(window) < ps:
            break
        for node, i in index.find(namespace, window):
            if not _below(node, head) or node.hbm_slots is None:
                continue
            at = _path_start(node) + i * ps  # window's position on the source path
            c0 = at - j  # C's first token there
            path = [t for n in tree.path(node) for t in n.tokens][:at]
            if c0 <= q or path[c0:at] != list(tokens[q : q + j]):
                continue  # not a drop (same or later position), or C does not start there
            m = tree.match(path + list(tokens[q + j :]), namespace, split=True, touch=True)
            reach = (min(m.hbm_len - c0, limit - q) + q) // ps * ps - q
            if reach > 0 and (best is None or reach > best[0]):
                best = (reach, CopySegment(m.hbm_node, c0, c0 + reach, q - c0))
        if best is not None:
            break  # the first aligned window found C; later offsets find the same run
    if best is None or q + best[0] - covered < max(min_tokens, ps):
        return None
    segments = (best[1],) if q == covered else (CopySegment(holder, covered, q, 0), best[1])
    return ReusePlan(covered, segments)
