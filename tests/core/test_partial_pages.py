"""Partial last pages (issue 31, item 4): kept at a release, matched and claimed for one step,
handed over once, replaced by a longer turn, evicted first and least recently used first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hiradix.core.ledger import Kind
from hiradix.core.partial_pages import PartialPages
from hiradix.core.prefix_cache import TieredPrefixCache
from hiradix.core.tree import TieredRadixTree
from hiradix.testing.sim_ports import SimDevicePool

PS = 4


def prefix_key(namespace, tokens):
    return namespace, tuple(tokens)  # any hashable key of the prefix (the core's: namespace, chain hash)


def copying_cache(record=lambda src, dst: (list(src), list(dst))):
    """A prefix cache with partial pages over a 32-token device pool and a copier that records
    ``record(src, dst)`` of each copy: ``(tree, device, cache, copies)``."""
    tree = TieredRadixTree(PS)
    device = SimDevicePool(32, PS)
    copies = []
    cache = TieredPrefixCache(tree, device, None, partial_pages=True,
                              copy_rows=lambda src, dst: copies.append(record(src, dst)))
    return tree, device, cache, copies


def test_a_kept_page_is_matched_claimed_for_one_step_and_taken_once():
    pages = PartialPages(PS)
    key = prefix_key(None, [1, 2, 3, 4])
    assert pages.keep(key, [5, 6, 7], "slots-a") == (True, [])
    assert pages.match(key, [5, 6, 9], "r1") == (2, pages.match(key, [5, 6, 9], "r1")[1])  # 2 tokens shared
    num, page = pages.match(key, [5, 6, 7], "r1")
    assert num == 3 and page.claimed_by == "r1"
    assert pages.match(key, [5, 6, 7], "r2") == (0, None)  # claimed by r1 in this step
    with pytest.raises(ValueError):
        pages.take(page, "r2", 3)
    pages.new_step()
    assert pages.match(key, [5, 6, 7], "r2")[0] == 3  # the claim lapsed; r2 claims it now
    assert pages.take(page, "r2", 3) == "slots-a" and pages.num_pages == 0
    assert (pages.taken, pages.reused_tokens) == (1, 3)
    assert pages.match(key, [5, 6, 7], "r3") == (0, None)  # handed over: the page is r2's own


def test_other_prefixes_and_namespaces_do_not_match():
    pages = PartialPages(PS)
    pages.keep(prefix_key(("salt",), [1, 2, 3, 4]), [5], "s")
    assert pages.match(prefix_key(None, [1, 2, 3, 4]), [5], "r") == (0, None)
    assert pages.match(prefix_key(("salt",), [1, 2, 3, 9]), [5], "r") == (0, None)
    assert pages.match(prefix_key(("salt",), [1, 2, 3, 4]), [6], "r") == (0, None)
    assert pages.match(prefix_key(("salt",), [1, 2, 3, 4]), [5], "r")[0] == 1


def test_a_longer_turn_replaces_the_older_page_and_a_shorter_one_is_not_kept():
    pages = PartialPages(PS)
    key = prefix_key(None, [1, 2, 3, 4])
    pages.keep(key, [5], "old")
    assert pages.keep(key, [5, 6], "new") == (True, ["old"])  # the caller frees the old page
    assert pages.keep(key, [5], "again") == (False, [])  # as much is kept: the caller frees it
    assert pages.keep(key, [7, 8], "branch") == (True, [])  # another continuation: kept beside
    assert pages.num_pages == 2 and sorted(pages.all_slots()) == ["branch", "new"]
    with pytest.raises(ValueError):
        pages.keep(key, [1, 2, 3, 4], "whole")  # a whole page belongs in the tree


def test_eviction_takes_the_least_recently_used_and_never_a_claimed_page():
    pages = PartialPages(PS)
    for i in range(3):
        pages.keep(prefix_key(None, [i] * PS), [9], f"p{i}")
    pages.match(prefix_key(None, [0] * PS), [9], "r")  # p0: used last, and claimed
    assert pages.evict(1) == ["p1"]
    assert pages.evict(5) == ["p2"]  # p0 is claimed: kept
    pages.new_step()
    assert pages.evict(5) == ["p0"] and pages.evicted == 3


def test_the_prefix_cache_counts_kept_pages_as_evictable_and_evicts_them_before_the_tree():
    tree = TieredRadixTree(PS)
    device = SimDevicePool(64, PS)
    cache = TieredPrefixCache(tree, device, None, partial_pages=True)
    key_len, last = cache.checkpoint(list(range(8)), None, device.alloc(8), 0)
    assert key_len == 8
    tail = device.alloc(PS)  # the request's last page: 2 tokens written
    assert cache.keep_partial(last, None, [8, 9], tail)
    assert cache.evictable_tokens == 8 + PS and device.available_size() == 64 - 8 - PS
    cache.check_integrity(request_tokens=0, used_tokens=64 - device.available_size())
    m = cache.match(list(range(8)) + [8, 9, 10])  # a next turn: the tree matches whole pages
    assert m.hbm_len == 8 and cache.match_partial(m.hbm_node, ("salt",), [8, 9, 10], claimer="r") == (0, None)
    num, page = cache.match_partial(m.hbm_node, None, [8, 9, 10], claimer="r")
    assert num == 2 and list(cache.take_partial(page, "r", num)) == tail[:2]  # r's own now
    device.free(tail)  # r is done with it (at its release, by SGLang)
    assert cache.evictable_tokens == 8
    assert cache.keep_partial(last, None, [8, 9], device.alloc(PS))  # the next turn's
    cache.match_partial(m.hbm_node, None, [8, 9, 10], claimer="r2")
    cache.step()  # the claim lapses
    cache.lock(last)  # the tree has nothing to evict: the partial page goes, whole
    assert cache.evict(1) == PS and cache.evictable_tokens == 0 and device.available_size() == 64 - 8
    cache.unlock(last)
    assert cache.keep_partial(last, None, [8, 9], device.alloc(PS))
    assert cache.evict(1) == 8 + PS  # the prefix left HBM (policy order), its partial page with it
    assert cache.evictable_tokens == 0 and device.available_size() == 64
    assert cache.match_partial(last, None, [8, 9], claimer="r") == (0, None)


def test_a_partial_page_stays_while_its_prefix_is_in_hbm():
    """Eviction follows the tree's policy: another prefix, less recently used, goes first, and
    the partial page after the prefix still in HBM stays."""
    now = [0.0]
    tree = TieredRadixTree(PS, clock=lambda: now[0])
    device = SimDevicePool(64, PS)
    cache = TieredPrefixCache(tree, device, None, partial_pages=True)
    cache.checkpoint([7] * 8, None, device.alloc(8), 0)  # an older prefix
    now[0] = 1.0
    _, last = cache.checkpoint(list(range(8)), None, device.alloc(8), 0)
    assert cache.keep_partial(last, None, [8], device.alloc(PS))
    now[0] = 2.0
    cache.match(list(range(8)))  # used last
    assert cache.evict(4) == 8  # the older prefix
    m = cache.match(list(range(8)) + [8, 9])
    assert cache.match_partial(m.hbm_node, None, [8, 9], claimer="r")[0] == 1


def test_a_split_prefix_keeps_its_pages_matchable():
    """Pages are keyed by the prefix's content (chain hash), not by a node: a node split by a
    diverging request still leads to them."""
    tree = TieredRadixTree(PS)
    device = SimDevicePool(64, PS)
    cache = TieredPrefixCache(tree, device, None, partial_pages=True)
    _, last = cache.checkpoint(list(range(12)), None, device.alloc(12), 0)
    assert cache.keep_partial(last, None, [50], device.alloc(PS))
    cache.checkpoint([0, 1, 2, 3, 4, 5, 6, 7, 90, 91, 92, 93], None, device.alloc(12), 0)  # splits at 8
    m = cache.match(list(range(12)) + [50, 51])
    assert m.hbm_len == 12 and cache.match_partial(m.hbm_node, None, [50, 51], claimer="r")[0] == 1


def test_without_the_option_nothing_is_kept():
    tree = TieredRadixTree(PS)
    cache = TieredPrefixCache(tree, SimDevicePool(64, PS), None)
    assert cache.partial is None and not cache.keep_partial(tree.root, None, [5], [0, 1, 2, 3])
    assert cache.match_partial(tree.root, None, [5], claimer="r") == (0, None)


def test_a_request_diverging_inside_a_tree_page_gets_its_leading_rows_copied_into_a_page_of_its_own():
    """Copy-on-write: the tree's page stays as it is; the copy is the request's (moved to it at
    admission), and a match only copies into free device pages."""
    tree, device, cache, copies = copying_cache()
    _, last = cache.checkpoint(list(range(12)), None, device.alloc(12), 0)
    tree_slots = list(cache.path_slots(last))
    m = cache.match(list(range(8)) + [8, 9, 99, 98])  # diverges inside the third page
    assert m.hbm_len == 8
    num, page = cache.match_partial(m.hbm_node, None, [8, 9, 99], claimer="r")
    assert num == 2 and copies == [(tree_slots[8:10], list(page.slots[:2]))]
    assert list(cache.path_slots(last)) == tree_slots and device.available_size() == 32 - 12 - PS
    assert list(cache.take_partial(page, "r", num)) == list(page.slots[:2])
    assert cache.match_partial(m.hbm_node, None, [8, 9, 99], claimer="r2")[0] == 2  # a new copy for r2
    assert len(copies) == 2
    device.alloc(device.available_size())  # the pool is full: a match never evicts to copy
    cache.step()
    assert cache.match_partial(m.hbm_node, None, [8, 99], claimer="r3")[0] == 2 - 1  # r2's claimed copy lapsed: kept
    assert cache.match_partial(m.hbm_node, None, [9], claimer="r4") == (0, None) and len(copies) == 2


def test_no_copy_from_a_page_whose_rows_are_still_being_promoted():
    """A page promoted from DRAM has its HBM slots at admission and its rows only after the next
    forward: a copy from it would read stale rows (a fresh clone's fault tests caught exactly that)."""
    tree, device, cache, copies = copying_cache(record=lambda src, dst: list(src))
    cache.checkpoint(list(range(12)), None, device.alloc(12), 0)
    m = tree.match(list(range(8)) + [8, 9, 99])
    child = next(iter(m.hbm_node.children.values()))
    child.ops.add(7)  # a promotion in flight on the page below the match
    cache.tiers = SimpleNamespace(books=SimpleNamespace(ops={7: SimpleNamespace(kind=Kind.PROMOTE)}))
    assert cache.match_partial(m.hbm_node, None, [8, 9, 99], claimer="r") == (0, None) and copies == []
    cache.tiers.books.ops = {7: SimpleNamespace(kind=Kind.BACKUP)}  # a backup only reads the rows
    assert cache.match_partial(m.hbm_node, None, [8, 9, 99], claimer="r")[0] == 2 and len(copies) == 1


def test_a_request_leaving_a_kept_page_inside_it_gets_a_copy_and_the_page_stays_for_its_branch():
    """A regenerated answer shares only the start of the kept last page: moving the page to it
    would take the original conversation's rows away (a break-it review saw 21 cached of 25)."""
    tree, device, cache, copies = copying_cache()
    _, last = cache.checkpoint(list(range(8)), None, device.alloc(8), 0)
    kept = device.alloc(PS)
    assert cache.keep_partial(last, None, [8, 9, 10], kept)
    num, page = cache.match_partial(last, None, [8, 99], claimer="regen")
    assert num == 1 and list(page.slots) != kept and copies == [([kept[0]], [page.slots[0]])]
    cache.take_partial(page, "regen", num)
    num, page = cache.match_partial(last, None, [8, 9, 10], claimer="original")
    assert num == 3 and list(page.slots) == kept and len(copies) == 1  # the whole kept page: moved, no copy
