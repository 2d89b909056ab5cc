"""Sources of a cut prompt's kept tail in the tree (hiradix.core.context_shift); integrity checked
after every step."""

from __future__ import annotations

from hiradix.core.context_overflow import Truncation
from hiradix.core.context_shift import plan_moved, plan_shift, shift_sources
from hiradix.core.node import Tier
from hiradix.core.page_index import PageContentIndex
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
    seg = plan.segments[0]
    assert plan.source_drop == 0 and seg.delta == -8 and len(plan.segments) == 1
    assert (seg.src_start, seg.src_end, plan.dst_start) == (10, 24, 2)
    source = [s for part in tree.path_hbm_slots(seg.source_node) for s in part]
    assert source[seg.src_start : seg.src_end] == slots[10:24]
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
    seg = plan.segments[0]
    assert plan.source_drop == 8 and seg.delta == -4 and plan.dst_start == 2
    assert seg.src_start == 6 and seg.src_end == 2 + 14 + 4  # through the answer
    assert plan.shifted_tokens == plan.num_tokens == 14
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


def test_a_run_the_client_moved_is_found_by_content_and_verified():
    """The tree holds A ‖ B ‖ C; the client sends A ‖ C ‖ new (it dropped B). |A| = 3 is not a
    page boundary: A's last token comes from its own path, C from B's subtree shifted by -|B|."""
    tree, pool = make()
    tree.page_index = PageContentIndex(PS)
    tree.reset()
    a, b, c = [1, 2, 3], [4, 5, 6, 7, 8, 9], list(range(10, 20))
    slots = insert(tree, pool, a + b + c)  # 19 tokens: 9 pages in the tree
    insert(tree, pool, [1, 2, 77, 78])  # another conversation after the first page
    prompt = a + c + [50, 51, 52, 53]
    m = tree.match(prompt, None, split=True, touch=False)
    assert m.hbm_len == 2
    plan = plan_moved(tree, tree.page_index, prompt, None, m.hbm_node, m.hbm_len, 16, min_tokens=4)
    assert plan is not None and plan.dst_start == 2 and plan.num_tokens == 10 and plan.shifted_tokens == 9
    head, moved = plan.segments
    assert (head.src_start, head.src_end, head.delta) == (2, 3, 0)
    assert (moved.src_start, moved.src_end, moved.delta) == (9, 18, -6)
    source = [s for part in tree.path_hbm_slots(moved.source_node) for s in part]
    assert source[9:18] == slots[9:18]
    # another namespace, or too short a run: no plan
    assert plan_moved(tree, tree.page_index, prompt, ("salt",), m.hbm_node, 2, 16, min_tokens=4) is None
    assert plan_moved(tree, tree.page_index, prompt, None, m.hbm_node, 2, 16, min_tokens=12) is None
    tree.check_integrity()


def test_a_run_outside_the_heads_subtree_is_not_reused():
    tree, pool = make()
    tree.page_index = PageContentIndex(PS)
    tree.reset()
    insert(tree, pool, [1, 2, 3, 4] + list(range(10, 20)))
    insert(tree, pool, [5, 6, 7, 8])
    prompt = [5, 6] + list(range(10, 20))  # C sits below [1, 2], not below [5, 6]
    m = tree.match(prompt, None, split=True, touch=False)
    assert m.hbm_len == 2
    assert plan_moved(tree, tree.page_index, prompt, None, m.hbm_node, 2, 12, min_tokens=4) is None
    tree.check_integrity()


def test_the_page_index_drops_stale_entries():
    tree, pool = make()
    tree.page_index = PageContentIndex(PS)
    tree.reset()
    index = tree.page_index
    insert(tree, pool, [1, 2, 3, 4, 5, 6])
    insert(tree, pool, [1, 2, 3, 4, 7, 8])  # splits [1..6] after 4 tokens: both parts re-registered
    assert [i for _, i in index.find(None, [5, 6])] == [0]
    assert [i for _, i in index.find(None, [3, 4])] == [1]  # on the upper node now
    assert index.find(("x",), [3, 4]) == []
    node = index.find(None, [7, 8])[0][0]
    pool.release(tree.detach(node, Tier.HBM))  # its last copy: deleted, its entry is stale
    assert not node.alive and index.find(None, [7, 8]) == []
    assert not index.compact(tree.iter_nodes())  # few stale entries: nothing to rebuild
    tree.check_integrity()
