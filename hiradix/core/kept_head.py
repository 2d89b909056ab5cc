"""The head a cut prompt keeps by default: the part it shares with other conversations.

``--hiradix-keep-tokens -1`` keeps, in whole pages, what the tree shows shared with *other*
conversations -- a system prompt, tool definitions, few-shot examples -- so that the kept head
stays the one cached prefix many conversations hit. In the tree such a prefix ends where another
cached branch leaves the prompt's path. But one conversation also leaves its own path:

* after each answer whose text, re-tokenized in the next turn, departs from the tokens the model
  generated (the dead branch holds the generated tokens);
* where a client edits or regenerates a turn;
* at the head of each of its own cuts.

Keeping up to the deepest such point keeps nearly the whole history and cuts its newer middle.

The rule. :class:`PromptEnds` remembers where the prompts the server received ended (by content,
bounded). For a prompt ``P``, ``own_from`` is the end of the shortest earlier prompt that is a
prefix of ``P``: this conversation's first turn, as far as the server remembers (a request whose
whole prompt ``P`` extends is a turn ``P`` continues). A branch that leaves ``P``'s path at or
after ``own_from`` leaves inside this conversation's own history: an answer, a later turn, an
edit of one. A branch that leaves before it is another prompt that parted from ``P``'s first
prompt: another conversation. The head is the deepest page boundary (> 0) at which such a shared
branch leaves (counted at its first differing token, so also when that lies inside the page
after the boundary). With none, nothing is shared and the head is the first page, as llama.cpp's
``n_keep`` keeps the first tokens (with page size 1: its BOS).

A conversation's own cut -- a branch that goes on with one of the prompt's later pages (the tail
of an earlier cut, :func:`~hiradix.core.context_shift.shift_sources`) -- never counts as another
conversation's. It leaves at the head that cut kept, so the conversation's later turns keep the
same head and find the earlier cut.

Limits: a prompt with no earlier turn the server remembers (after a restart, or more than
``capacity`` prompts since) takes every branch as shared (the rule before); a chat template that
renders earlier turns differently later hides the earlier prompts the same way; conversations
whose first prompts are identical part only in their answers, so they share nothing by this rule.

Pure bookkeeping over :class:`~hiradix.core.tree.TieredRadixTree` (token ids only).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from hiradix.core.tree import TieredRadixTree

DEFAULT_PROMPT_ENDS = 1 << 17  # prompt ends remembered (a dict entry each, about 200 bytes)


class PromptEnds:
    """Where the prompts a server received ended, by content; the most recent ``capacity`` kept.

    A prompt is keyed by a hash chain over its whole pages (one link per page, so the prefixes
    of a longer prompt are looked up in one walk) and the tokens of its last partial page. A hash
    collision can only make a prompt look like an earlier turn: a shorter head, never a wrong cut.

    Args:
        page_size: tokens per link of the chain.
        capacity: whole-page prefixes remembered (prompts, but for those ending in the same
            page); the least recently added are forgotten first.
    """

    def __init__(self, page_size: int, capacity: int = DEFAULT_PROMPT_ENDS):
        assert page_size > 0 and capacity > 0, (page_size, capacity)
        self.page_size, self.capacity = page_size, capacity
        # (namespace, chain link of the whole pages) -> tails (partial last pages) of the prompts
        self._tails: OrderedDict[tuple, tuple[tuple[int, ...], ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tails)

    def _chain(self, tokens: Sequence[int], pages: int) -> Iterator[int]:
        """The chain link after 0, 1, ..., ``pages`` whole pages of ``tokens``."""
        ps, link = self.page_size, 0
        yield link
        for i in range(pages):
            link = hash((link, tuple(tokens[i * ps : (i + 1) * ps])))
            yield link

    def add(self, tokens: Sequence[int], namespace: Optional[tuple]) -> None:
        """Remember that a prompt of ``tokens`` arrived. O(len(tokens))."""
        if not tokens:
            return
        pages = len(tokens) // self.page_size
        *_, link = self._chain(tokens, pages)
        key, tail = (namespace, link), tuple(tokens[pages * self.page_size :])
        tails = self._tails.pop(key, ())
        self._tails[key] = tails if tail in tails else tails + (tail,)
        if len(self._tails) > self.capacity:
            self._tails.popitem(last=False)

    def first_end(self, tokens: Sequence[int], namespace: Optional[tuple]) -> Optional[int]:
        """The length of the shortest remembered prompt that is a proper prefix of ``tokens``
        (None if none). Read-only; O(that length), O(len(tokens)) when there is none."""
        ps = self.page_size
        for pages, link in enumerate(self._chain(tokens, (len(tokens) - 1) // ps)):
            start = pages * ps
            ends = [start + len(t) for t in self._tails.get((namespace, link), ())
                    if 0 < start + len(t) < len(tokens) and tuple(tokens[start : start + len(t)]) == t]
            if ends:
                return min(ends)
        return None


@dataclass(frozen=True)
class KeptHead:
    """The head a cut keeps: ``tokens`` (whole pages); ``shared``: the part shared with other
    conversations (False: nothing is shared and it is the first page, or a fixed head)."""

    tokens: int
    shared: bool


def _leaves_before(branch: Sequence[int], tokens: Sequence[int], at: int, limit: int) -> bool:
    """Whether ``branch`` (cached tokens from position ``at`` on) leaves ``tokens`` at a token
    before ``limit`` (and before ``tokens`` end: a prompt that ends inside a branch leaves nothing)."""
    n = 0
    while n < len(branch) and at + n < len(tokens) and branch[n] == tokens[at + n]:
        n += 1
    return at + n < min(limit, len(tokens)) and n < len(branch)


def shared_head(tree: TieredRadixTree, tokens: Sequence[int], namespace: Optional[tuple],
                own_from: Optional[int]) -> KeptHead:
    """The head of ``tokens`` to keep by default (see the module docstring). Read-only;
    O(len(tokens)) plus the branches looked at.

    Args:
        own_from: where this conversation's own history starts (:meth:`PromptEnds.first_end`;
            None: no earlier turn known, every branch counts as another conversation's).

    Returns:
        The deepest page boundary > 0 where a branch of another conversation leaves the cached
        path of ``tokens`` (``shared``), else the first page (not ``shared``).
    """
    ps = tree.page_size
    limit = len(tokens) if own_from is None else min(own_from, len(tokens))
    later = {tuple(tokens[i : i + ps]): i for i in range(0, len(tokens) - ps + 1, ps)}  # page -> last position

    def shared(branch: Sequence[int], at: int) -> bool:
        """Another conversation's branch; not this one's own cut (it goes on with a later page)."""
        return later.get(tuple(branch[:ps]), -1) <= at and _leaves_before(branch[:ps], tokens, at, limit)

    m = tree.match(tokens, namespace, split=False, touch=False)
    head, start = 0, 0
    for i, node in enumerate(m.nodes):
        end = start + node.num_tokens
        if end > m.matched_len:  # the path leaves inside this node: its rest is another branch
            at = m.matched_len
            if at > 0 and shared(node.tokens[at - start : at - start + ps], at):
                head = at
            break
        after = m.nodes[i + 1] if i + 1 < len(m.nodes) else None
        if end < limit and any(shared(c.tokens, end) for c in node.children.values() if c is not after):
            head = end
        start = end
    return KeptHead(head, True) if head else KeptHead(min(ps, len(tokens) // ps * ps), False)
