"""The server's context-overflow glue without a server (hiradix.sglang_plugin.overflow): which cut a
prompt gets, over a real tree."""

from __future__ import annotations

from types import SimpleNamespace

from hiradix.core.tree import TieredRadixTree
from hiradix.sglang_plugin.overflow import MIN_MOVED_TOKENS, ContextOverflow
from tests.helpers.core import FakeClock, SlotPool

PS = 16


def overflow_over(tree: TieredRadixTree) -> ContextOverflow:
    cache = SimpleNamespace(tree=tree, page_size=PS)
    return ContextOverflow(cache, kv_pool=None, mode="shift", rope=None, keep_tokens=32, drop_ratio=0.5)


def insert(tree: TieredRadixTree, pool: SlotPool, tokens: list[int]) -> None:
    slots = pool.alloc(len(tokens))
    dup, _, _ = tree.insert(tokens, slots)
    pool.release(slots[:dup])


def test_an_earlier_cut_is_kept_only_if_its_branch_goes_on():
    """A repeated page is not an earlier cut (found by the quality benchmark: a ShareGPT chat repeats
    a page 128 and 560 tokens after the head; step A cut 560, step B then 'reused' a cut at 128)."""
    tree, pool = TieredRadixTree(PS, clock=FakeClock()), SlotPool(8192)
    head = list(range(1, 33))  # 2 pages
    repeated = list(range(500, 516))
    body = list(range(1000, 1128)) + repeated + list(range(2000, 2416)) + repeated + list(range(3000, 3200))
    tokens = head + body  # the repeated page sits at keep + 128 and keep + 560
    insert(tree, pool, tokens)
    overflow = overflow_over(tree)
    # the first cut (drop 560) made a branch head + tokens[32 + 560:], as a served turn would
    insert(tree, pool, head + tokens[32 + 560 :])
    longer = tokens + list(range(4000, 4040))
    cut = overflow._earlier_cut(longer, 32, None, reserve=8, context=len(longer) - 120)  # 128 and 560 both fit
    assert cut is not None and cut.drop_tokens == 560  # not 128: that branch is one repeated page
    # with only the repeated page at 128 continuing the head, nothing qualifies
    tree2, pool2 = TieredRadixTree(PS, clock=FakeClock()), SlotPool(8192)
    insert(tree2, pool2, tokens)
    insert(tree2, pool2, head + repeated + list(range(9000, 9016)))
    assert overflow_over(tree2)._earlier_cut(longer, 32, None, reserve=8, context=len(longer) - 100) is None
    assert MIN_MOVED_TOKENS >= 2 * PS
    tree.check_integrity()
