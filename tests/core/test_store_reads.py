"""Load or recompute at run time (hiradix.core.store_reads) and its wiring into the store tier.

Units in the wiring tests: PAGE_BYTES 64 per 2-token page = 32 bytes per token; at 1,000 prefill
tokens/s the break-even store link is 32 KB/s. No clocks are read: the estimates get the
(amount, seconds) samples a server would measure.
"""

from __future__ import annotations

import logging
import types

import pytest

from hiradix.core.outcomes import LOOKUP_FAILED, found_of
from hiradix.core.node import Tier
from hiradix.core.store_reads import DecayedRate, PrefillRate, StoreReadChoice
from hiradix.testing.sim_ports import SimClock, SimStore
from tests.core.test_store_tier import PS, Server, keys, settle

BYTES_PER_TOKEN = 32.0  # the Server helper's 64-byte pages of 2 tokens


def measured(mode: str, read_bytes_per_s: float, prefill_tokens_per_s: float = 1000.0, **kw) -> StoreReadChoice:
    """A choice whose estimates have their samples already (three of each, constant rates)."""
    choice = StoreReadChoice(mode, BYTES_PER_TOKEN, PS, **kw)
    for tokens in (100, 400, 1600):  # sizes spread enough for the slope fit
        choice.note_prefill(tokens, tokens / prefill_tokens_per_s)
        choice.note_get(tokens * BYTES_PER_TOKEN, tokens * BYTES_PER_TOKEN / read_bytes_per_s)
    return choice


# ------------------------------------------------------------------ estimates
def test_decayed_rate_weighs_samples_by_their_seconds():
    rate = DecayedRate(decay=0.5)
    assert rate.per_s is None and rate.samples == 0
    rate.add(100, 1.0)  # 100/s
    assert rate.per_s == 100
    rate.add(100, 10.0)  # a slow sample pulls hard: (50 + 100) / (0.5 + 10)
    assert rate.per_s == pytest.approx(150 / 10.5)
    rate.add(0, 1.0)
    rate.add(5, 0.0)  # empty or timeless samples are ignored
    assert rate.samples == 2


def test_prefill_rate_is_the_marginal_slope_not_the_throughput():
    fit = PrefillRate()
    for tokens in (100, 2000, 500, 1000):  # 20 ms fixed + 20 us per token: 50k tokens/s marginal
        fit.add(tokens, 0.02 + tokens / 50_000)
    assert fit.per_s == pytest.approx(50_000)
    assert fit.throughput.per_s < 40_000  # what tokens / seconds would have said


def test_prefill_rate_falls_back_to_throughput_when_sizes_are_alike():
    fit = PrefillRate()
    assert fit.per_s is None
    for seconds in (0.010, 0.012, 0.011):
        fit.add(100, seconds)  # no spread in size: no slope
    assert fit.slope_s_per_token is None
    assert fit.per_s == pytest.approx(300 / 0.033, rel=0.02)


# ------------------------------------------------------------------ the choice
def test_prior_reads_everything_until_both_estimates_have_samples():
    choice = StoreReadChoice("auto", BYTES_PER_TOKEN, PS)
    choice.note_get(1, 1.0)  # 1 byte/s: hopeless, but nothing measured about prefill yet
    assert choice.pages_to_read(5) == 5 and choice.skipped_pages == 0


def test_auto_reads_a_fast_store_and_recomputes_from_a_slow_one(caplog):
    fast = measured("auto", read_bytes_per_s=320e3)  # 10x the 32 KB/s break-even
    assert fast.pages_to_read(8) == 8 and fast.skipped_pages == 0
    slow = measured("auto", read_bytes_per_s=3.2e3)  # 10x below
    with caplog.at_level(logging.INFO, logger="hiradix.core.store_reads"):
        assert slow.pages_to_read(8) == 0
        assert slow.pages_to_read(3) == 0
    assert slow.skipped_pages == 11
    first = [r for r in caplog.records if "recomputed instead of read" in r.getMessage()]
    assert len(first) == 1  # the first skip only, with the estimates and the break-even link
    assert "store read 0.0 MB/s" in first[0].getMessage() and "prefill 1000 tokens/s" in first[0].getMessage()


def test_forced_modes_ignore_the_estimates():
    assert measured("always", read_bytes_per_s=1.0).pages_to_read(4) == 4
    never = measured("never", read_bytes_per_s=1e12)
    assert never.pages_to_read(4) == 0 and never.skipped_pages == 4 and not never.reads_store
    with pytest.raises(ValueError, match="auto"):
        StoreReadChoice("sometimes", BYTES_PER_TOKEN, PS)


def test_a_skipped_store_is_probed_now_and_then():
    slow = measured("auto", read_bytes_per_s=3.2e3, probe_every=3)
    assert [slow.pages_to_read(2) for _ in range(6)] == [0, 0, 2, 0, 0, 2]  # every third skip reads
    assert slow.probes == 2 and slow.skipped_pages == 8


def test_lookup_value_carries_the_choice_and_min_over_ranks_agrees():
    result = types.SimpleNamespace(ok=[True, True, True, False], error="")
    assert found_of(result) == 2 + 3
    assert found_of(result, lambda n: 0) == 2  # this rank recomputes: read nothing
    # MIN over ranks: a rank that would read 3 and one that would read 0 agree on 0
    assert min(found_of(result), found_of(result, lambda n: 0)) == 2
    assert found_of(types.SimpleNamespace(ok=[], error="boom"), lambda n: 0) == LOOKUP_FAILED


# ------------------------------------------------------------------ wiring: two servers, one store
@pytest.fixture
def pair():
    clock, store = SimClock(), SimStore()
    return Server(store, clock), Server(store, clock)


def test_slow_store_hit_is_recomputed_as_a_miss_and_counted(pair):
    a, b = pair
    prompt = keys(1, pages=4)
    a.serve(prompt)
    settle(a)
    b.tiers.store.reads = measured("auto", read_bytes_per_s=3.2e3)
    b.cache.match(prompt)  # lookup of the 4 pages A put
    assert b.cache.should_wait(prompt)
    b.step()  # found 4, worth 0: no store-only child, the run's first key held
    assert not b.tree.root.children and b.tree.tier_tokens[Tier.STORE] == 0
    assert b.tiers.store.counts["lookup_found_pages"] == 4 and b.tiers.store.reads.skipped_pages == 4
    assert not b.cache.should_wait(prompt)  # the request is not held back: it prefills
    m, back = b.admit(prompt)
    assert m.cached_len == 0 and back.loaded == 0 and not b.tiers.store.lookups  # no new lookup
    assert b.tiers.store.counts["get_pages"] == 0


def test_fast_store_hit_is_read(pair):
    a, b = pair
    prompt = keys(2, pages=4)
    a.serve(prompt)
    settle(a)
    b.tiers.store.reads = measured("auto", read_bytes_per_s=320e3)
    b.cache.match(prompt)
    settle(b, steps=2)  # found, GET landed
    m, back = b.admit(prompt)
    assert back.read_from[Tier.STORE] == 8 and b.tiers.store.reads.skipped_pages == 0


def test_never_asks_the_store_nothing_but_still_writes_it(pair):
    a, b = pair
    b.tiers.store.reads = StoreReadChoice("never", BYTES_PER_TOKEN, PS)
    prompt = keys(3)
    a.serve(prompt)
    settle(a)
    b.cache.match(prompt)
    assert not b.tiers.store.lookups and not b.cache.should_wait(prompt)
    b.serve(keys(4))
    settle(b)
    assert b.tiers.store.counts["put_pages"] == 3 and b.tiers.store.counts["lookup_pages"] == 0


def test_a_store_only_run_in_the_tree_is_not_waited_for_when_not_worth_reading(pair):
    a, b = pair
    prompt = keys(5)
    a.serve(prompt)
    settle(a)
    store_keys = a.tiers.store.keys_of(a.tree.match(prompt, split=False).nodes[0])
    b.tree.add_child(b.tree.root, prompt, None, Tier.STORE, store_keys)  # as a lookup leaves it
    b.tiers.store.reads = measured("auto", read_bytes_per_s=3.2e3)
    assert not b.tiers.store_read_worth(6)
    m = b.cache.match(prompt)
    assert m.store_len == 6 and not b.tiers.books.in_flight() and not b.cache.should_wait(prompt)
    b.check()
    b.tiers.store.reads = measured("auto", read_bytes_per_s=320e3)
    b.cache.match(prompt)
    assert b.cache.should_wait(prompt)  # worth it: the GET runs and the request waits for it
    settle(b, steps=2)
    assert b.admit(prompt)[1].read_from[Tier.STORE] == 6


def test_under_tp_the_tree_path_reads_unless_never(pair):
    a, _ = pair
    a.tiers.store.reads = measured("auto", read_bytes_per_s=3.2e3)
    a.tiers.store_link.ranks = 2  # two ranks: local estimates are not agreed there
    assert a.tiers.store_read_worth(6)
    a.tiers.store.reads = StoreReadChoice("never", BYTES_PER_TOKEN, PS)
    assert not a.tiers.store_read_worth(6)


# ------------------------------------------------------------------ lookups worth asking
def test_a_tail_lookups_never_find_is_not_asked_when_it_recomputes_faster_than_a_lookup():
    """Issue 31 (fleet: 98% of hiradix's requests waited ~17 ms for a lookup of their new turn,
    which no server has computed and the tiny model prefills in ~5 ms). At 1,000 tokens/s and
    lookups of 50 ms: a 20-token tail whose length lookups never found is not asked; asked are
    tails before both estimates have their samples, tails of a length lookups found, and every
    tail under TP (skip_lookups off); one skip in probe_every asks anyway."""
    choice = measured("always", read_bytes_per_s=320e3, skip_lookups=True, probe_every=3)
    assert choice.lookup_worth(20)  # no lookup measured yet
    for _ in range(3):
        choice.note_lookup(0.05, 20, 1, 0)  # 20-token tails: never found
    assert choice.lookup.per_s == pytest.approx(20.0)
    assert [choice.lookup_worth(20) for _ in range(6)] == [False, False, True, False, False, True]
    assert choice.skipped_lookups == 4
    assert choice.lookup_worth(40)  # another length, not measured: asked
    for _ in range(3):
        choice.note_lookup(0.05, 40, 2, 1)  # half found (a moved history's answer, a new turn)
    assert choice.lookup_worth(40)  # 40 ms of prefill x 0.5 < 50 ms, but found: asked anyway
    tp = measured("always", read_bytes_per_s=320e3)  # skip_lookups off: every rank asks the same lookups
    for _ in range(3):
        tp.note_lookup(0.05, 20, 1, 0)
    assert tp.lookup_worth(20) and tp.skipped_lookups == 0
    assert not measured("never", read_bytes_per_s=1.0, skip_lookups=True).lookup_worth(1000)


def test_tails_of_a_length_lookups_never_find_are_not_asked():
    """A new user turn is never in the store (cache-aware routing: every lookup is of one); a history
    moved from another server is. The saving a lookup can bring is the tail's prefill times the
    share of such tails' pages found: 0 for 200-token tails here, all for 1,000-token ones."""
    choice = measured("always", read_bytes_per_s=320e3, skip_lookups=True)
    for _ in range(3):
        choice.note_lookup(0.05, 200, 12, 0)  # 200-token tails: nothing found
        choice.note_lookup(0.05, 1000, 32, 32)  # 1,000-token tails: all found
    assert choice.found_share.of(200) == 0.0 and choice.found_share.of(1000) == 1.0
    assert choice.found_share.of(5000) == 1.0  # no lookup of that length yet: asked
    assert not choice.lookup_worth(200)  # none of it found: not asked (0 x 200 ms of prefill < 50 ms)
    assert choice.lookup_worth(1000) and choice.lookup_worth(5000)


def test_a_skipped_lookup_admits_the_request_at_once_and_its_round_trip_is_measured():
    clock, store = SimClock(), SimStore()
    b = Server(store, clock, query_s=0.05)
    b.tiers.store.reads = measured("always", read_bytes_per_s=320e3, skip_lookups=True)
    for tag in range(3):  # three new 8-token prompts: looked up (misses), each answered 50 ms later
        b.cache.match(keys(10 + tag, pages=4))
        assert b.cache.should_wait(keys(10 + tag, pages=4))
        clock.advance_to(clock() + 0.05)
        settle(b, steps=1)
    reads = b.tiers.store.reads
    assert reads.lookup.samples == 3 and 1 / reads.lookup.per_s == pytest.approx(0.05) and reads.found_share.of(8) == 0
    b.cache.match(keys(20, pages=4))  # the next new prompt: not asked (8 ms of prefill, never found)
    assert not b.tiers.store.lookups and not b.cache.should_wait(keys(20, pages=4))  # admitted now
    assert reads.skipped_lookups == 1
