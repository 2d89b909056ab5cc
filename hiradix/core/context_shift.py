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
from typing import Optional, Sequence

from hiradix.core.context_overflow import Truncation
from hiradix.core.tree import TieredRadixTree, TreeNode


def shared_head_tokens(tree: TieredRadixTree, tokens: Sequence[int], namespace: Optional[tuple]) -> int:
    """The longest leading part of ``tokens`` the tree shows shared by several sequences.

    The end of the deepest node on the cached path of ``tokens`` that has two or more children
    (a system prompt that several conversations continue), else 0. Whole pages; read-only.
    """
    m = tree.match(tokens, namespace, split=False, touch=False)
    shared, end = 0, 0
    for node in m.nodes:
        end += node.num_tokens
        if end > m.matched_len:
            break
        if len(node.children) >= 2:
            shared = end
    return shared


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
class ShiftPlan:
    """Copy source slots ``[src_start, src_end)`` of the path ``source_tokens`` (HBM, ending at
    ``source_node``) to the cut prompt's positions ``[dst_start, dst_start + src_end - src_start)``,
    re-rotated by ``delta`` positions (``source_drop - cut.drop_tokens``, <= 0).
    """

    source_tokens: tuple[int, ...]
    source_node: TreeNode
    source_drop: int
    src_start: int
    src_end: int
    dst_start: int
    delta: int

    @property
    def num_tokens(self) -> int:
        return self.src_end - self.src_start


def plan_shift(tree: TieredRadixTree, tokens: Sequence[int], cut: Truncation, namespace: Optional[tuple],
               covered: int, limit: int) -> Optional[ShiftPlan]:
    """The best source for the cut prompt's positions ``[covered, limit)`` (whole pages).

    Args:
        tokens: the uncut prompt (``cut.prompt_tokens`` long).
        covered: tokens of the cut prompt the tree already holds in HBM on its own path (>= the
            head: a plan extends that path).
        limit: cut-prompt tokens worth reusing (whole pages of the cut prompt).

    Returns:
        None when no source holds, in HBM, a page after ``covered``; else the plan with the most
        tokens. Splits nodes at the source's HBM end (like a match); no other change.
    """
    ps, keep, drop = tree.page_size, cut.keep_tokens, cut.drop_tokens
    if covered < keep or covered >= limit:
        return None
    best: Optional[ShiftPlan] = None
    for d in shift_sources(tree, tokens, keep, namespace, max_drop=drop):
        if d >= drop:
            continue  # the cut's own branch: ``covered`` is its match already
        source = tuple(tokens[:keep]) + tuple(tokens[keep + d :])
        m = tree.match(source, namespace, split=True, touch=True)
        lag = drop - d  # the tail sits this much further right on the source path
        src_start, src_end = covered + lag, min(m.hbm_len, limit + lag) // ps * ps
        if src_end - src_start >= ps and (best is None or src_end - src_start > best.num_tokens):
            best = ShiftPlan(source, m.hbm_node, d, src_start, src_end, covered, -lag)
    return best
