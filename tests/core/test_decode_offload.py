"""The decode-side offload's bookkeeping (hiradix.core.decode_offload): which pages, which keys,
staging pages held while a PUT is in flight, the counts."""

from __future__ import annotations

import pytest

from hiradix.core.decode_offload import OffloadBooks, offload_span, page_keys
from hiradix.core.keys import ROOT_HASH, chain

PS = 16


@pytest.mark.parametrize("prompt, kv, expected", [
    (164, 175, (10, 0)),   # the answer's KV stops inside the prompt's last page: nothing
    (164, 176, (10, 1)),   # page 10 (prompt tail + answer start) is the decode side's
    (160, 199, (10, 2)),   # a prompt of whole pages: the prefill side shared them all
    (0, 40, (0, 2)),
    (30, 20, (1, 0)),      # fewer KV tokens than the prompt (never negative)
])  # fmt: skip
def test_offload_span_skips_the_prompts_whole_pages(prompt, kv, expected):
    assert offload_span(prompt, kv, PS) == expected


def test_page_keys_are_the_chain_the_prefill_tree_computes_node_by_node():
    tokens = list(range(1000, 1000 + 5 * PS + 3))
    ns = ("lora", "salt")
    # the prefill tree hashes a node's pages after its parent's last page hash (keys.prefix_hash)
    parent = chain(ROOT_HASH, ns, tokens[: 2 * PS], PS)[-1]
    tail = chain(parent, ns, tokens[2 * PS :], PS)
    assert page_keys("p/", tokens, ns, PS, first_page=2) == ["p/" + h.hex() for h in tail]
    assert len(tail) == 3  # whole pages only
    assert page_keys("p/", tokens, None, PS, 2) != page_keys("p/", tokens, ns, PS, 2)  # salts never share


def test_books_hold_staging_until_the_put_ends_and_count_outcomes():
    books = OffloadBooks(staging_pages=3, page_size=PS)
    job, staging = books.reserve(2)                      # 2 of 3 pages held
    assert books.reserve(2) is None                      # full: dropped, counted
    assert books.tokens["staging_full"] == 2 * PS
    books.check_integrity()
    books.finish(job, [True, False])                     # one page stored, one failed
    assert books.tokens == {"stored": PS, "staging_full": 2 * PS, "failed": PS}
    assert books.allocator.num_free == 3
    job2, _ = books.reserve(3)
    books.cancel(job2)                                   # the copy failed: all 3 failed
    assert books.tokens["failed"] == 4 * PS and books.allocator.num_free == 3
    assert books.finish(job2, [True]) is None            # unknown (already ended): ignored
    books.check_integrity()


def test_a_failed_put_is_tried_again_for_its_failed_pages_within_its_budget():
    from hiradix.core.decode_offload import PUT_ATTEMPTS, PUT_RETRY_BACKOFF_S, PUT_RETRY_BUDGET_S

    books = OffloadBooks(staging_pages=4, page_size=PS)
    job, staging = books.reserve(3, ["k0", "k1", "k2"], now_s=100.0)
    # one master RPC timed out: pages 0 and 2 failed, page 1 stored
    books.finish(job, [False, True, False], now_s=100.2)
    assert books.tokens == {"stored": PS, "staging_full": 0, "failed": 0}  # nothing lost yet
    assert books.allocator.num_used == 2  # the failed pages' staging is kept, the stored one freed
    assert books.due_retries(100.2 + PUT_RETRY_BACKOFF_S / 2) == []  # backoff not over
    ((retry_job, retry),) = books.due_retries(100.2 + PUT_RETRY_BACKOFF_S)
    assert retry.keys == ("k0", "k2") and retry.staging == (staging[0], staging[2])
    assert retry.attempt == 2 and books.due_retries(200.0) == []  # handed out once
    books.check_integrity()
    books.finish(retry_job, [True, True], now_s=101.0)  # the retry landed: nothing failed
    assert books.tokens == {"stored": 3 * PS, "staging_full": 0, "failed": 0}
    assert books.allocator.num_used == 0 and books.retried_pages == 2
    books.check_integrity()
    # a store that keeps failing: PUT_ATTEMPTS tries, then the pages count as failed
    job, _ = books.reserve(2, ["a", "b"], now_s=0.0)
    now = 0.0
    for attempt in range(1, PUT_ATTEMPTS + 1):
        books.finish(job, [False, False], now_s=now)
        now += 10 * PUT_RETRY_BACKOFF_S
        due = books.due_retries(now)
        if attempt < PUT_ATTEMPTS:
            ((job, _),) = due
        else:
            assert due == []
    assert books.tokens["failed"] == 2 * PS and books.allocator.num_used == 0
    # no retry starts past the budget, and a PUT without keys is never retried
    job, _ = books.reserve(1, ["late"], now_s=0.0)
    books.finish(job, [False], now_s=PUT_RETRY_BUDGET_S)
    job, _ = books.reserve(1, now_s=0.0)
    books.finish(job, [False], now_s=0.0)
    assert books.retries == {} and books.tokens["failed"] == 4 * PS and books.allocator.num_used == 0
    # a due retry that cannot be submitted is cancelled: failed, staging freed
    job, _ = books.reserve(1, ["c"], now_s=0.0)
    books.finish(job, [False], now_s=0.0)
    ((retry_job, _),) = books.due_retries(PUT_RETRY_BUDGET_S)
    books.cancel(retry_job)
    assert books.tokens["failed"] == 5 * PS and books.allocator.num_used == 0
    books.check_integrity()
