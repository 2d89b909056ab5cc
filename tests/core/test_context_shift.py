"""Sources of a cut prompt's kept tail in the tree (hiradix.core.context_shift); integrity checked
after every step."""

from __future__ import annotations

from hiradix.core.context_overflow import Truncation
from hiradix.core.context_shift import plan_shift, shared_head_tokens, shift_sources
from hiradix.core.tree import TieredRadixTree
from tests.helpers.core import FakeClock, SlotPool

PS = 2


def make() -> tuple[TieredRadixTree, SlotPool]:
    return TieredRadixTree(PS, clock=FakeClock()), SlotPool(256)


def insert(tree: TieredRadixTree, pool: SlotPool, tokens, namespace=None) -> list[int]:
    slots = pool.alloc(len(tokens))
    dup_len, _, _ = tree.insert(tokens, slots, namespace)
    pool.release(slots[:dup_len])
    tree.check_integrity()
    return slots


def hbm_path_slots(tree: TieredRadixTree, tokens, namespace=None) -> list[int]:
    m = tree.match(tokens, namespace, split=False, touch=False)
    return [s for part in tree.path_hbm_slots(m.hbm_node) for s in part][: m.hbm_len]


def test_shared_head_is_the_deepest_branching_point():
    tree, pool = make()
    insert(tree, pool, [1, 2, 3, 4, 5, 6])
    assert shared_head_tokens(tree, [1, 2, 3, 4, 5, 6, 9, 9], None) == 0  # one conversation: nothing shared
    insert(tree, pool, [1, 2, 3, 4, 7, 8])
    assert shared_head_tokens(tree, [1, 2, 3, 4, 5, 6, 9, 9], None) == 4
    assert shared_head_tokens(tree, [1, 2, 9, 9], None) == 0  # the branching point lies past its match
    assert shared_head_tokens(tree, [1, 2, 3, 4, 5, 6], ("salt",)) == 0  # another namespace holds nothing
    tree.check_integrity()


def conversation(n_pages: int) -> list[int]:
    return [100 + i for i in range(n_pages * PS)]


def test_the_uncut_conversation_is_the_source_of_its_first_cut():
    tree, pool = make()
    tokens = conversation(12)  # head = 1 page, then 11 pages
    slots = insert(tree, pool, tokens)
    cut = Truncation(keep_tokens=2, drop_tokens=8, prompt_tokens=24)
    assert shift_sources(tree, tokens, 2, None) == list(range(0, 22, 2))[:1]  # only d = 0 continues the head
    cut_tokens = cut.apply(tokens)
    covered = tree.match(cut_tokens, None, split=True, touch=False).hbm_len
    assert covered == 2  # the head only
    plan = plan_shift(tree, tokens, cut, None, covered, len(cut_tokens))
    assert plan is not None and plan.source_drop == 0 and plan.delta == -8
    assert (plan.src_start, plan.src_end, plan.dst_start) == (10, 24, 2)
    assert hbm_path_slots(tree, plan.source_tokens)[plan.src_start : plan.src_end] == slots[10:24]
    tree.check_integrity()


def test_a_later_cut_reuses_the_earlier_cut_branch_that_holds_more():
    tree, pool = make()
    tokens = conversation(12)
    insert(tree, pool, tokens)
    first = Truncation(keep_tokens=2, drop_tokens=8, prompt_tokens=24)
    branch = first.apply(tokens) + [900, 901, 902, 903]  # the cut turn's answer, only on the branch
    insert(tree, pool, branch)
    longer = tokens + [900, 901, 902, 903, 904, 905]  # the next turn: the uncut history + answer + message
    assert shift_sources(tree, longer, 2, None) == [0, 8]
    again = Truncation(keep_tokens=2, drop_tokens=8, prompt_tokens=30)  # the same cut still fits
    covered = tree.match(again.apply(longer), None, split=True, touch=False).hbm_len
    assert covered == 2 + 14 + 4 and plan_shift(tree, longer, again, None, covered, 28) is None
    bigger = Truncation(keep_tokens=2, drop_tokens=12, prompt_tokens=30)
    cut_tokens = bigger.apply(longer)
    covered = tree.match(cut_tokens, None, split=True, touch=False).hbm_len
    plan = plan_shift(tree, longer, bigger, None, covered, len(cut_tokens) // PS * PS)
    # the uncut path lacks the answer; the first cut's branch has it: 4 positions further right
    assert plan.source_drop == 8 and plan.delta == -4 and plan.dst_start == 2
    assert plan.src_start == 6 and plan.src_end == 2 + 14 + 4  # through the answer
    source = hbm_path_slots(tree, plan.source_tokens)
    assert len(source) >= plan.src_end
    tree.check_integrity()


def test_no_plan_without_the_head_or_outside_the_namespace():
    tree, pool = make()
    tokens = conversation(8)
    insert(tree, pool, tokens, ("a",))
    cut = Truncation(keep_tokens=2, drop_tokens=6, prompt_tokens=16)
    assert shift_sources(tree, tokens, 2, ("b",)) == []
    assert plan_shift(tree, tokens, cut, ("b",), 2, 10) is None
    assert plan_shift(tree, tokens, cut, ("a",), 0, 10) is None  # the head is not covered
    plan = plan_shift(tree, tokens, cut, ("a",), 2, 10)
    assert plan is not None and plan.num_tokens == 8
    tree.check_integrity()
