"""Context overflow: which tokens of a too-long prompt to keep (AttentionStore §3.4).

CachedAttention / AttentionStore (USENIX ATC '24, §3.4) keeps a conversation's KV reusable when
it outgrows the model's context: the KV is truncated (the oldest part after a kept head is
dropped) and positions are re-applied to what is kept, so the kept history is not prefilled
again. llama.cpp's context shift does the same with ``n_keep`` and ``n_discard`` (half the rest
by default). This module decides the cut for a prompt, in pure Python, for the server
(:mod:`hiradix.sglang_plugin`) and the simulator (:mod:`bench.sim`) alike:

* the first ``keep_tokens`` tokens stay (a system prompt); by default the leading part the tree
  shows shared with other conversations, never a fork of one conversation's own history, in
  whole pages, else the first page (:mod:`hiradix.core.kept_head`);
* of the rest, the oldest ``drop_ratio`` (at least what the context overflows by) is dropped,
  rounded up to whole pages so the kept tail's cached pages stay page-aligned at their new
  positions;
* the kept tail's tokens move back by the dropped length: a cached K of position ``p`` is
  re-rotated to ``p - drop_tokens`` (:mod:`hiradix.dataplane.rope_shift`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

MODES = ("off", "shift", "recompute", "noshift")
"""``--hiradix-context-overflow``: ``off`` (SGLang's behaviour: refused or cut at the tail),
``shift`` (drop the oldest part, reuse the kept tail's KV shifted), ``recompute`` (drop the same
tokens, prefill the kept tail again: token truncation, the paper's TT), ``noshift`` (reuse the kept
tail's KV at its old positions: a diagnostic, the paper's NKVT; outputs are wrong by design)."""


class PromptTooLong(ValueError):
    """No cut fits the prompt and its new tokens into the context."""


@dataclass(frozen=True)
class Truncation:
    """The cut of one prompt: ``tokens[:keep_tokens] + tokens[keep_tokens + drop_tokens:]``.

    Attributes:
        keep_tokens: leading tokens kept in place (a multiple of the page size).
        drop_tokens: tokens dropped after them (a multiple of the page size, > 0).
        prompt_tokens: the prompt's length before the cut.
    """

    keep_tokens: int
    drop_tokens: int
    prompt_tokens: int

    @property
    def tail_start(self) -> int:
        """Position (in the uncut prompt) of the first kept token after the drop."""
        return self.keep_tokens + self.drop_tokens

    @property
    def shift(self) -> int:
        """Position change of every kept tail token (negative)."""
        return -self.drop_tokens

    @property
    def kept_tokens(self) -> int:
        """Length of the cut prompt."""
        return self.prompt_tokens - self.drop_tokens

    def apply(self, tokens: Sequence[int]) -> list[int]:
        """The cut prompt.

        Raises:
            ValueError: ``tokens`` is not ``prompt_tokens`` long.
        """
        if len(tokens) != self.prompt_tokens:
            raise ValueError(f"the cut is for {self.prompt_tokens} tokens, got {len(tokens)}")
        return list(tokens[: self.keep_tokens]) + list(tokens[self.tail_start :])


def plan_truncation(prompt_tokens: int, max_new_tokens: int, context_tokens: int, keep_tokens: int,
                    drop_ratio: float, page_size: int) -> Optional[Truncation]:
    """The cut for a prompt of ``prompt_tokens`` that must leave ``max_new_tokens`` of room.

    Args:
        context_tokens: the model's context length (SGLang's ``context_len``).
        keep_tokens: leading tokens to keep (rounded down to whole pages; reduced to 0 when the
            head alone leaves no room).
        drop_ratio: share of the tokens after the head to drop, in (0, 1]; at least the overflow,
            at most all but the last (partial) page.

    Returns:
        None when the prompt fits (no cut), else the :class:`Truncation`.

    Raises:
        PromptTooLong: even the newest page-aligned tail does not fit.
        ValueError: bad arguments.
    """
    if not 0.0 < drop_ratio <= 1.0:
        raise ValueError(f"drop_ratio must be in (0, 1], got {drop_ratio}")
    if page_size <= 0 or context_tokens <= 0 or max_new_tokens < 0 or keep_tokens < 0:
        raise ValueError("page_size and context_tokens must be > 0, max_new_tokens and keep_tokens >= 0")
    overflow = prompt_tokens + max_new_tokens - context_tokens
    if overflow <= 0:
        return None
    keep = min(keep_tokens, prompt_tokens) // page_size * page_size
    for head in (keep, 0) if keep else (0,):
        rest = prompt_tokens - head
        drop = max(math.ceil(rest * drop_ratio), overflow)
        drop = min(math.ceil(drop / page_size) * page_size, (rest - 1) // page_size * page_size)
        if drop >= overflow and drop > 0:  # at least one token of the prompt's tail stays
            return Truncation(keep_tokens=head, drop_tokens=drop, prompt_tokens=prompt_tokens)
    raise PromptTooLong(f"a prompt of {prompt_tokens} tokens plus {max_new_tokens} new tokens cannot be cut "
                        f"to fit a context of {context_tokens} tokens in whole pages of {page_size}")
